// Fused Adam/AdamW step over flat contiguous fp32 CPU buffers: DeepSpeed's cpu_adam, the host step of
// ZeRO-Offload (issue 32). Python: nanomega/cpu_adam.py (CPUAdamW, reference_step). Bound into the one
// extension module by fused_cpu.cpp's PYBIND11_MODULE (bind() at the bottom).
//
// The step is memory-bound (14 operations per 28 bytes), so the kernel makes ONE pass: each element's param,
// grad, exp_avg and exp_avg_sq are read once, param, exp_avg and exp_avg_sq written once. The buffers are
// cut into chunks of kChunk elements, spread over torch's threads by at::parallel_for (an OpenMP parallel
// region in torch's builds; torch.set_num_threads sets the count, also when called from another thread).
//
// One formula, three compilations. adam_range() is plain C++, written once; it is compiled three times:
// with target("avx512f") (16 floats per instruction), target("avx2") (8), and with vectorization off (one
// float at a time: the fallback for any CPU, and on non-x86 CPUs the only path). The path is chosen at run
// time from what the CPU reports (__builtin_cpu_supports), as DeepSpeed's cpu_adam picks AVX-512 / AVX2 /
// scalar code, whatever -march the extension was built for. $NANOMEGA_ADAM_ISA (or the isa argument)
// forces a path, so a test can run every path this CPU executes. Writing the arithmetic once instead of
// intrinsics per ISA makes the paths agree by construction; tests/test_cpu_adam.py checks it bit for bit.
//
// Bitwise reproducibility. extension.cpu_flags() compiles the extension with -ffast-math, under which GCC 12
// compiles this very loop (checked with objdump) with FMAs (b1*m + omb1*g rounded once instead of three
// times), sqrt and the divisions as reciprocal estimates plus a Newton step -- rsqrt14ps/rcp14ps on the
// AVX-512 path, the coarser rsqrtps/rcpps on the AVX2 path, exact vsqrtss/vdivss in the scalar one: three
// paths giving three answers, none matching a reference written in PyTorch ops. So everything below is
// compiled with no-fast-math and fp-contract=off: every +, -, *, / and sqrt is one IEEE-754 operation rounded
// to nearest, as PyTorch's +, -, *, / on fp32 tensors are (its sqrt is MKL's, not IEEE's: reference_step
// rounds square roots itself). cpu_adam.reference_step writes the same operations in the same order as
// PyTorch ops, so kernel and reference agree to the bit. FMA is not used on purpose: its single rounding
// cannot be written as PyTorch ops (fp64 emulation double-rounds), and the extra roundings cost no time: the
// step is memory-bound (measured: the loop without its sqrt and divisions takes as long).
// (sqrt is __builtin_sqrtf: std::sqrt is an inline function compiled under the command line's -ffast-math,
// which GCC will not inline into code with other math flags -- it would be a call per element.)
//
// The offload step's two neighbours ride the same pass (as DeepSpeed's cpu_adam writes its fp16 copy):
// grad_scale (the clip coefficient, g <- g * scale, as grad.mul_(scale) on fp32) and `out`, the updated
// parameter rounded to bf16 for the upload to the device (round to nearest even, as torch's .to(bfloat16)).
// Done as separate passes they read and write the gradient (8 bytes) and read the master, write the bf16 copy
// (6 bytes): 28 + 14 = 42 bytes per element; inside the kernel 28 + 2 = 30.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define NANOMEGA_X86 1
#define NANOMEGA_BELOW_AVX512 __attribute__((target("no-avx512f")))
#else
#define NANOMEGA_BELOW_AVX512
#endif

namespace nanomega::cpu_adam {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per task (1 MiB of the four buffers); a multiple of 16

#if defined(__clang__)
// clang's spelling of the same contract (untested here: the project's machines build with GCC)
#pragma float_control(precise, on, push)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off", "no-math-errno")
#endif

// The step's scalars in fp32. They are computed in double exactly as torch.optim.Adam(W)'s single-tensor
// path computes them in Python floats (the same libm pow; no FMA here either), then rounded to fp32 once, as
// PyTorch rounds a Python scalar for an op on fp32 tensors.
struct Coefs {
  float decay;            // AdamW: 1 - lr wd; Adam: unused
  float l2;               // Adam: wd (g += wd p); AdamW: unused
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;        // lr / (1 - beta1^step)
  float bc2_sqrt;         // (1 - beta2^step)^0.5, pow as Python's ** (not sqrt: its last bit can differ)
  float eps;
  float grad_scale;       // the clip coefficient applied to g first (1: none)
};

Coefs coefs(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
            double grad_scale) {
  const double bc1 = 1.0 - __builtin_pow(beta1, step);
  const double bc2 = 1.0 - __builtin_pow(beta2, step);
  return Coefs{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(weight_decay),
               static_cast<float>(beta1), static_cast<float>(1.0 - beta1),
               static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
               static_cast<float>(lr / bc1), static_cast<float>(__builtin_pow(bc2, 0.5)),
               static_cast<float>(eps), static_cast<float>(grad_scale)};
}

// THE formula, for elements [0, n). Every line is one rounding per operation, in the order written (the
// parentheses are the order): reference_step in nanomega/cpu_adam.py is this, line by line.
// Each path below is this loop inlined and compiled for its ISA. A function may inline only code built for a
// subset of its own instruction set, and the AVX2 path excludes AVX-512, so the loop itself is declared for
// the build's -march less AVX-512: a subset of all three paths' sets.
template <bool kDecoupled, bool kOut>
__attribute__((always_inline)) NANOMEGA_BELOW_AVX512 inline void adam_range(
    float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
    uint16_t* __restrict out, int64_t n, const Coefs& c) {
  // locals, not c.x in the loop: a store through p could alias the struct, which blocks vectorizing
  const float decay = c.decay, l2 = c.l2, b1 = c.beta1, omb1 = c.one_minus_beta1, b2 = c.beta2,
              omb2 = c.one_minus_beta2, step_size = c.step_size, bc2_sqrt = c.bc2_sqrt, eps = c.eps,
              scale = c.grad_scale;
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i], gi = g[i] * scale;  // x * 1.0f is x, bit for bit: an unclipped step is unchanged
    if constexpr (kDecoupled) {
      pi = pi * decay;        // AdamW: decoupled decay
    } else {
      gi = gi + l2 * pi;      // Adam: L2, the decay through the gradient
    }
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * (gi * gi);
    const float denom = __builtin_sqrtf(vi) / bc2_sqrt + eps;
    const float pn = pi - (step_size * mi) / denom;
    p[i] = pn;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kOut) {  // bf16: the top 16 bits, rounded to nearest even by adding 0x7FFF + the kept lsb
      uint32_t bits;
      __builtin_memcpy(&bits, &pn, 4);
      const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
      out[i] = static_cast<uint16_t>(pn != pn ? 0x7FC0u : rounded);  // a NaN stays a (quiet) NaN
    }
  }
}

using RangeFn = void (*)(float*, const float*, float*, float*, uint16_t*, int64_t, const Coefs&);

// the fallback: one float at a time, whatever -march the build had (no vector registers: the reading of
// the formula a student would write; on x86 only CPUs without AVX2 take it, unless forced)
template <bool kDecoupled, bool kOut>
__attribute__((optimize("no-tree-vectorize"))) void range_scalar(float* p, const float* g, float* m, float* v,
    uint16_t* out, int64_t n, const Coefs& c) {
  adam_range<kDecoupled, kOut>(p, g, m, v, out, n, c);
}

#ifdef NANOMEGA_X86
// 8 floats per vmulps/vaddps/vdivps/vsqrtps on ymm registers (AVX2; the loop needs only AVX's float ops,
// but AVX2 is what DeepSpeed's AVX256 build and CPUs since 2013 have). no-avx512f: a target attribute adds
// to the command line's -march, and -march=native on an AVX-512 CPU would otherwise vectorize this on zmm.
template <bool kDecoupled, bool kOut>
__attribute__((target("avx2,no-avx512f"))) void range_avx2(float* p, const float* g, float* m, float* v,
    uint16_t* out, int64_t n, const Coefs& c) {
  adam_range<kDecoupled, kOut>(p, g, m, v, out, n, c);
}

// 16 floats per instruction on zmm registers; GCC's default tuning would use 256-bit vectors even here
template <bool kDecoupled, bool kOut>
__attribute__((target("avx512f,prefer-vector-width=512"))) void range_avx512(float* p, const float* g, float* m,
                                                                             float* v, uint16_t* out, int64_t n,
                                                                             const Coefs& c) {
  adam_range<kDecoupled, kOut>(p, g, m, v, out, n, c);
}
#endif

#if defined(__clang__)
#pragma float_control(pop)
#else
#pragma GCC pop_options
#endif

// ---- which path runs ----
struct Path {
  const char* name;
  RangeFn fn[2][2];  // [decoupled][with a bf16 out]
};

#define NANOMEGA_PATH(name, f) \
  Path { name, {{&f<false, false>, &f<false, true>}, {&f<true, false>, &f<true, true>}} }

// the paths this CPU executes, fastest first
std::vector<Path> paths() {
  std::vector<Path> out;
#ifdef NANOMEGA_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) out.push_back(NANOMEGA_PATH("avx512", range_avx512));
  if (__builtin_cpu_supports("avx2")) out.push_back(NANOMEGA_PATH("avx2", range_avx2));
#endif
  out.push_back(NANOMEGA_PATH("scalar", range_scalar));
  return out;
}

// isa "" -> $NANOMEGA_ADAM_ISA if set, else the fastest path; a path this CPU lacks is refused in one line
Path resolve(const std::string& isa) {
  const char* env = std::getenv("NANOMEGA_ADAM_ISA");
  const std::string want = !isa.empty() ? isa : (env != nullptr ? env : "");
  const std::vector<Path> all = paths();
  if (want.empty()) return all.front();
  std::string names;
  for (const Path& p : all) {
    if (want == p.name) return p;
    names += (names.empty() ? "" : ", ") + std::string(p.name);
  }
  TORCH_CHECK(false, "cpu adam: ISA path '", want, "' (isa argument or NANOMEGA_ADAM_ISA) is not one this CPU ",
              "runs; it runs: ", names);
}

std::string isa_name(const std::string& isa) {
  return resolve(isa).name;
}

std::vector<std::string> isa_names() {
  std::vector<std::string> out;
  for (const Path& p : paths()) out.emplace_back(p.name);
  return out;
}

void check(const at::Tensor& t, const char* what, const at::Tensor& param) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "cpu adam: ", what,
              " must be a contiguous float32 CPU tensor, got ", t.device(), " ", t.scalar_type(),
              t.is_contiguous() ? "" : " non-contiguous");
  TORCH_CHECK(t.numel() == param.numel(), "cpu adam: ", what, " has ", t.numel(), " elements, param ",
              param.numel());
}

// One Adam(W) step of param in place (and of exp_avg, exp_avg_sq), its gradient scaled by grad_scale first,
// the updated param also written to `out` in bf16 if given; -> the name of the path that ran
std::string adam_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                      double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                      bool decoupled, const std::string& isa, double grad_scale,
                      const std::optional<at::Tensor>& out) {
  check(param, "param", param);
  check(grad, "grad", param);
  check(exp_avg, "exp_avg", param);
  check(exp_avg_sq, "exp_avg_sq", param);
  TORCH_CHECK(step >= 1, "cpu adam: step counts from 1, got ", step);
  if (out.has_value()) {
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == at::kBFloat16 && out->is_contiguous() &&
                    out->numel() == param.numel(), "cpu adam: out must be a contiguous bfloat16 CPU tensor of ",
                param.numel(), " elements, got ", out->device(), " ", out->scalar_type(), " of ", out->numel());
  }
  const Path path = resolve(isa);
  const RangeFn range = path.fn[decoupled][out.has_value()];
  const Coefs c = coefs(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  float* p = param.data_ptr<float>();
  const float* g = grad.const_data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  uint16_t* o = out.has_value() ? reinterpret_cast<uint16_t*>(out->data_ptr<at::BFloat16>()) : nullptr;
  const int64_t n = param.numel();
  // one task per chunk; at::parallel_for hands each thread a contiguous run of chunks. Elements never
  // interact, so the bits do not depend on the thread count or on where a chunk (or a vector) begins.
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t begin = c0 * kChunk, end = std::min(n, c1 * kChunk);
    range(p + begin, g + begin, m + begin, v + begin, o != nullptr ? o + begin : nullptr, end - begin, c);
  });
  return path.name;
}

}  // namespace

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("adam_step", &adam_step,
        "(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, decoupled, isa, grad_scale, "
        "out) -> path: one Adam (decoupled=False: L2) or AdamW step in place over contiguous fp32 CPU tensors, "
        "the gradient times grad_scale, the new param also rounded into out (bf16) if given",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("decoupled") = true, py::arg("isa") = "", py::arg("grad_scale") = 1.0,
        py::arg("out") = std::nullopt);
  m.def("adam_isa", &isa_name, "(isa='') -> the path adam_step takes: avx512, avx2 or scalar", py::arg("isa") = "");
  m.def("adam_isas", &isa_names, "() -> the paths this CPU executes, fastest first");
}

}  // namespace nanomega::cpu_adam
