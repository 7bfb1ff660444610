// Fused CPU kernels (LayerNorm, causal softmax, bias + GeLU, RMSNorm, SwiGLU; forward and backward) and the
// Python bindings.
//
// These ops are memory-bound: a few FLOPs per byte, so their time is the bytes they move. Each kernel
// reads its inputs once and writes its outputs once, where eager PyTorch runs one kernel per step and
// writes every intermediate to memory. Rows are split across threads (at::parallel_for); inside a row
// the columns go Vectorized<opmath_t>-wide (16 floats with AVX-512), the last partial chunk through a
// masked load/store, and all arithmetic is in at::opmath_type (fp32 for bf16 and fp16 inputs).
// Lesson: lessons/13-fused-kernels.md
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fused_ops.h"

namespace nanomega {
namespace cpu {
namespace {

using at::vec::Vectorized;
template <typename T>
using acc_t = at::opmath_type<T>;  // float for float, bf16 and fp16; double for double
template <typename T>
using fVec = Vectorized<acc_t<T>>;
template <typename T>
constexpr bool kWide = std::is_same_v<T, acc_t<T>>;  // T is its own opmath type

// n <= fVec::size() elements of T at p, widened to opmath; lanes past n read as 0
template <typename T>
inline fVec<T> load(const T* p, int64_t n) {
  if constexpr (kWide<T>) {
    return fVec<T>::loadu(p, n);
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(Vectorized<T>::loadu(p, n)));
  }
}

template <typename T>
inline void store(T* p, const fVec<T>& v, int64_t n) {
  if constexpr (kWide<T>) {
    v.store(p, n);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

// f(j, m) for each chunk [j, j + m) of [0, n): whole vectors (m a compile-time constant once
// inlined), then at most one partial chunk, which load/store mask
template <typename V, typename F>
inline void for_chunks(int64_t n, const F& f) {
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + W <= n; j += W) f(j, W);
  if (j < n) f(j, n - j);
}

template <typename V>
inline typename V::value_type hsum(const V& v) {
  return at::vec::vec_reduce_all<typename V::value_type>([](V a, V b) { return a + b; }, v);
}

template <typename V>
inline typename V::value_type hmax(const V& v) {
  return at::vec::vec_reduce_all<typename V::value_type>(
      [](V a, V b) { return at::vec::maximum(a, b); }, v);
}

// rows per task so that one task touches ~32K elements (ATen's grain size): less is not worth a thread
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width));
}

// where a softmax row keeps its exps: y itself when y holds opmath, else a scratch row
template <typename T>
inline acc_t<T>* exp_row(T* y, std::vector<acc_t<T>>& scratch) {
  if constexpr (kWide<T>) {
    return y;
  } else {
    return scratch.data();
  }
}

// Splits rows into one chunk per thread, each with its own zeroed opmath buffer of `width` column sums
// (no two threads write the same memory), and calls body(r, nr, sums) on blocks of nr <= kRowBlock rows
// so that a block loads and stores its slice of sums once, not once per row; returns the buffers' sum.
constexpr int64_t kRowBlock = 4;

template <typename acc, typename F>
at::Tensor rows_with_column_sums(int64_t rows, int64_t width, const F& body) {
  const int64_t chunks = std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(rows, 1));
  at::Tensor partial = at::zeros({chunks, width}, at::CppTypeToScalarType<acc>::value);
  acc* buf = partial.data_ptr<acc>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t end = rows * (c + 1) / chunks;
      for (int64_t r = rows * c / chunks; r < end; r += kRowBlock) {
        body(r, std::min(kRowBlock, end - r), buf + c * width);
      }
    }
  });
  return partial.sum(0);
}

// gelu_tanh(u) = 0.5 u (1 + tanh z) = u * sigmoid(2z), z = sqrt(2/pi) (u + 0.044715 u^3): one exp
// instead of a tanh. With e = exp(-2z) and s = sigmoid(2z) = 1 / (1 + e):
//   dgelu/du = s + 2 u s (1 - s) z'(u) = s (1 + u (e s) 2z'(u)),   2 z' = a2 (1 + 3 b u^2)
// 1 - s is formed as e s, never as a difference: for u >~ 5, s rounds to within an ulp of 1 and 1 - s
// would be that ulp's noise times u 2z' (~400 at u = 12). A reciprocal's last ulp depends on the ISA
// (AVX2's rcp+Newton vs AVX-512's rcp14+Newton under -ffast-math), so the difference made the kernel
// ~10x less accurate on AVX2; the product e s keeps the relative error of e and s (a few ulp) everywhere.
constexpr double kA2 = 2 * 0.7978845608028654;  // 2 sqrt(2/pi)
constexpr double kB = 0.044715;

// e = exp(-2z) with -2z clamped to [-80, 80]: e^80 keeps s = 1/(1+e) ~ 2e-35, not 0 (under -ffast-math a
// vector division is a reciprocal estimate plus a Newton step, which turns 1 / (1 + inf) into nan), and
// e^-80 ~ 2e-35 is a normal float: past it, s is 1 to the last bit anyway
template <typename V>
inline V exp_neg_2z(const V& u) {
  using A = typename V::value_type;
  const V two_z = u * (V(A(kA2)) + V(A(kA2 * kB)) * u * u);
  return at::vec::clamp(-two_z, V(A(-80)), V(A(80))).exp_u20();
}

template <typename V>
inline V sigmoid_of(const V& e) {
  using A = typename V::value_type;
  return V(A(1)) / (V(A(1)) + e);
}

template <typename V>
inline V gelu_grad(const V& u, const V& e, const V& s) {
  using A = typename V::value_type;
  return s * (V(A(1)) + u * (e * s) * (V(A(kA2)) + V(A(3 * kA2 * kB)) * u * u));
}

// e = exp(-g) with -g clamped to [-80, 80], for sigmoid(g) = 1 / (1 + e): the same guard as exp_neg_2z
template <typename V>
inline V exp_neg(const V& g) {
  using A = typename V::value_type;
  return at::vec::clamp(-g, V(A(-80)), V(A(80))).exp_u20();
}

// v rounded to T and widened back: the value a T tensor would hold (identity when T is its own opmath)
template <typename T>
inline fVec<T> round_to(const fVec<T>& v) {
  if constexpr (kWide<T>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

}  // namespace

void layer_norm_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps,
                    at::Tensor& y, at::Tensor& mean, at::Tensor& rstd) {
  const int64_t H = w.numel(), rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_fwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *X = x.data_ptr<scalar_t>(), *W = w.data_ptr<scalar_t>(), *B = b.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    acc *M = mean.data_ptr<acc>(), *R = rstd.data_ptr<acc>();
    at::parallel_for(0, rows, grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = X + r * H;
        V s(0), q(0);
        for_chunks<V>(H, [&](int64_t j, int64_t m) { s += load(xr + j, m); });
        const acc mu = hsum(s) / H;
        // two passes (mean, then squared deviations): no cancellation; the row is in L1 by now
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          const V d = V::set(V(0), load(xr + j, m) - V(mu), m);
          q += d * d;
        });
        const acc rs = acc(1) / std::sqrt(hsum(q) / H + acc(eps));
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          store(Y + r * H + j, (load(xr + j, m) - V(mu)) * V(rs) * load(W + j, m) + load(B + j, m), m);
        });
        M[r] = mu;
        R[r] = rs;
      }
    });
  });
}

void layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                    const at::Tensor& mean, const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dwdb) {
  const int64_t H = w.numel(), rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_bwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *DY = dy.data_ptr<scalar_t>(), *X = x.data_ptr<scalar_t>(), *W = w.data_ptr<scalar_t>();
    const acc *M = mean.data_ptr<acc>(), *R = rstd.data_ptr<acc>();
    scalar_t* DX = dx.data_ptr<scalar_t>();
    dwdb = rows_with_column_sums<acc>(rows, 2 * H, [&](int64_t r, int64_t nr, acc* sums) {
      // dx = rstd (g - mean(g) - xhat mean(g xhat)),  g = dy w,  xhat = (x - mean) rstd
      acc g_mean[kRowBlock], gx_mean[kRowBlock];
      for (int64_t k = 0; k < nr; ++k) {
        const scalar_t *dyr = DY + (r + k) * H, *xr = X + (r + k) * H;
        const V mu(M[r + k]), rs(R[r + k]);
        V g_sum(0), gx_sum(0);
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          const V g = load(dyr + j, m) * load(W + j, m);  // 0 past m: masks both sums
          g_sum += g;
          gx_sum += g * (load(xr + j, m) - mu) * rs;
        });
        g_mean[k] = hsum(g_sum) / H;
        gx_mean[k] = hsum(gx_sum) / H;
      }
      for_chunks<V>(H, [&](int64_t j, int64_t m) {
        const V w = load(W + j, m);
        V dw = V::loadu(sums + j, m), db = V::loadu(sums + H + j, m);
        for (int64_t k = 0; k < nr; ++k) {
          const int64_t o = (r + k) * H + j;  // offset of (row, column j)
          const V d = load(DY + o, m), rs(R[r + k]), xhat = (load(X + o, m) - V(M[r + k])) * rs;
          store(DX + o, rs * (d * w - V(g_mean[k]) - xhat * V(gx_mean[k])), m);
          dw += d * xhat;
          db += d;
        }
        dw.store(sums + j, m);
        db.store(sums + H + j, m);
      });
    }).view({2, H});
  });
}

void causal_softmax_fwd(const at::Tensor& x, double scale, at::Tensor& y) {
  const int64_t sq = x.size(-2), sk = x.size(-1), rows = x.numel() / sk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_softmax_fwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t* X = x.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    const V vscale(static_cast<acc>(scale)), lowest(std::numeric_limits<acc>::lowest());
    // task t takes row t/2 from the front or the back: rows i and s-1-i pair up, so every chunk
    // of tasks holds the same number of visible keys whichever way the triangle is cut
    at::parallel_for(0, rows, grain(sk / 2), [&](int64_t t0, int64_t t1) {
      std::vector<acc> tmp(kWide<scalar_t> ? 0 : sk);  // exps in opmath when y is narrower
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t % 2 ? rows - 1 - t / 2 : t / 2;
        const int64_t n = std::min(r % sq + sk - sq + 1, sk);  // visible keys; the rest are skipped
        const scalar_t* xr = X + r * sk;
        scalar_t* yr = Y + r * sk;
        acc* e = exp_row(yr, tmp);
        V vmax = lowest, vsum(0);
        for_chunks<V>(n, [&](int64_t j, int64_t m) {
          vmax = at::vec::maximum(vmax, V::set(lowest, load(xr + j, m) * vscale, m));
        });
        const V mx(hmax(vmax));
        for_chunks<V>(n, [&](int64_t j, int64_t m) {
          const V ej = (load(xr + j, m) * vscale - mx).exp_u20();
          ej.store(e + j, m);
          vsum += V::set(V(0), ej, m);
        });
        const V inv(acc(1) / hsum(vsum));
        for_chunks<V>(n, [&](int64_t j, int64_t m) { store(yr + j, V::loadu(e + j, m) * inv, m); });
        std::fill(yr + n, yr + sk, scalar_t(0));
      }
    });
  });
}

void causal_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale, at::Tensor& dx) {
  const int64_t sq = y.size(-2), sk = y.size(-1), rows = y.numel() / sk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "causal_softmax_bwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *DY = dy.data_ptr<scalar_t>(), *Y = y.data_ptr<scalar_t>();
    scalar_t* DX = dx.data_ptr<scalar_t>();
    const V vscale(static_cast<acc>(scale));
    at::parallel_for(0, rows, grain(sk / 2), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t % 2 ? rows - 1 - t / 2 : t / 2;
        const int64_t n = std::min(r % sq + sk - sq + 1, sk);
        const scalar_t *dyr = DY + r * sk, *yr = Y + r * sk;
        scalar_t* dxr = DX + r * sk;
        V dot(0);
        for_chunks<V>(n, [&](int64_t j, int64_t m) { dot += load(dyr + j, m) * load(yr + j, m); });
        const V vdot(hsum(dot));
        for_chunks<V>(n, [&](int64_t j, int64_t m) {
          store(dxr + j, vscale * load(yr + j, m) * (load(dyr + j, m) - vdot), m);
        });
        std::fill(dxr + n, dxr + sk, scalar_t(0));
      }
    });
  });
}

void bias_gelu_fwd(const at::Tensor& x, const at::Tensor& b, at::Tensor& y) {
  const int64_t H = b.numel(), rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_fwd", [&] {
    using V = fVec<scalar_t>;
    const scalar_t *X = x.data_ptr<scalar_t>(), *B = b.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          const V u = load(X + r * H + j, m) + load(B + j, m);
          store(Y + r * H + j, u * sigmoid_of(exp_neg_2z(u)), m);
        });
      }
    });
  });
}

void bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& b, at::Tensor& dx,
                   at::Tensor& db) {
  const int64_t H = b.numel(), rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_bwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *DY = dy.data_ptr<scalar_t>(), *X = x.data_ptr<scalar_t>(), *B = b.data_ptr<scalar_t>();
    scalar_t* DX = dx.data_ptr<scalar_t>();
    // u = x + b is recomputed, not saved: one read of x instead of a write and a read of u
    db = rows_with_column_sums<acc>(rows, H, [&](int64_t r, int64_t nr, acc* sums) {
      for_chunks<V>(H, [&](int64_t j, int64_t m) {
        const V b = load(B + j, m);
        V dbias = V::loadu(sums + j, m);
        for (int64_t k = 0; k < nr; ++k) {
          const int64_t o = (r + k) * H + j;  // offset of (row, column j)
          const V u = load(X + o, m) + b;
          const V e = exp_neg_2z(u);
          const V g = load(DY + o, m) * gelu_grad(u, e, sigmoid_of(e));
          store(DX + o, g, m);
          dbias += g;
        }
        dbias.store(sums + j, m);
      });
    });
  });
}

void rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd) {
  const int64_t H = w.numel(), rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *X = x.data_ptr<scalar_t>(), *W = w.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    acc* R = rstd.data_ptr<acc>();
    at::parallel_for(0, rows, grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = X + r * H;
        V q(0);  // one reduction, no mean: RMSNorm does not center (LayerNorm needs two)
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          const V v = load(xr + j, m);  // 0 past m
          q += v * v;
        });
        const acc rs = acc(1) / std::sqrt(hsum(q) / H + acc(eps));
        // modern.rms_norm's (HF's) order: x * rstd rounded to x's dtype, then times the weight, so a
        // 16-bit output rounds where eager's does
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          store(Y + r * H + j, load(W + j, m) * round_to<scalar_t>(load(xr + j, m) * V(rs)), m);
        });
        R[r] = rs;
      }
    });
  });
}

void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                  at::Tensor& dx, at::Tensor& dw) {
  const int64_t H = w.numel(), rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *DY = dy.data_ptr<scalar_t>(), *X = x.data_ptr<scalar_t>(), *W = w.data_ptr<scalar_t>();
    const acc* R = rstd.data_ptr<acc>();
    scalar_t* DX = dx.data_ptr<scalar_t>();
    dw = rows_with_column_sums<acc>(rows, H, [&](int64_t r, int64_t nr, acc* sums) {
      // dx = rstd (g - xhat mean(g xhat)),  g = dy w,  xhat = x rstd: LayerNorm's without the mean(g) term
      acc gx_mean[kRowBlock];
      for (int64_t k = 0; k < nr; ++k) {
        const scalar_t *dyr = DY + (r + k) * H, *xr = X + (r + k) * H;
        V gx_sum(0);
        for_chunks<V>(H, [&](int64_t j, int64_t m) {
          gx_sum += load(dyr + j, m) * load(W + j, m) * load(xr + j, m);  // g x; times rstd once, below
        });
        gx_mean[k] = hsum(gx_sum) * R[r + k] / H;
      }
      for_chunks<V>(H, [&](int64_t j, int64_t m) {
        const V w = load(W + j, m);
        V dwj = V::loadu(sums + j, m);
        for (int64_t k = 0; k < nr; ++k) {
          const int64_t o = (r + k) * H + j;  // offset of (row, column j)
          const V d = load(DY + o, m), rs(R[r + k]), xhat = load(X + o, m) * rs;
          store(DX + o, rs * (d * w - xhat * V(gx_mean[k])), m);
          dwj += d * xhat;
        }
        dwj.store(sums + j, m);
      });
    });
  });
}

// gate_up rows of 2F laid out [gate | up]: under tensor parallelism each rank's (..., 2f/t) slice keeps that
// layout, so a row is always two contiguous halves
void swiglu_fwd(const at::Tensor& gu, at::Tensor& y) {
  const int64_t F = y.size(-1), rows = y.numel() / F;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "swiglu_fwd", [&] {
    using V = fVec<scalar_t>;
    const scalar_t* GU = gu.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(2 * F), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *gate = GU + r * 2 * F, *up = gate + F;
        for_chunks<V>(F, [&](int64_t j, int64_t m) {
          const V g = load(gate + j, m);  // silu(g) = g sigmoid(g): one exp, one division
          store(Y + r * F + j, g * sigmoid_of(exp_neg(g)) * load(up + j, m), m);
        });
      }
    });
  });
}

// dgate = dy up silu'(g), silu'(g) = s (1 + g (1 - s)) with 1 - s = e s, never a difference (gelu_grad's
// reason: s is within an ulp of 1 for large g); dup = dy silu(g). gate_up is read once, dgate_up written once.
void swiglu_bwd(const at::Tensor& dy, const at::Tensor& gu, at::Tensor& dgu) {
  const int64_t F = dy.size(-1), rows = dy.numel() / F;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "swiglu_bwd", [&] {
    using V = fVec<scalar_t>;
    using acc = acc_t<scalar_t>;
    const scalar_t *DY = dy.data_ptr<scalar_t>(), *GU = gu.data_ptr<scalar_t>();
    scalar_t* DGU = dgu.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(2 * F), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *gate = GU + r * 2 * F, *up = gate + F;
        scalar_t *dgate = DGU + r * 2 * F, *dup = dgate + F;
        for_chunks<V>(F, [&](int64_t j, int64_t m) {
          const V g = load(gate + j, m), d = load(DY + r * F + j, m);
          const V e = exp_neg(g), s = sigmoid_of(e);
          store(dgate + j, d * load(up + j, m) * s * (V(acc(1)) + g * (e * s)), m);
          store(dup + j, d * g * s, m);
        });
      }
    });
  });
}

}  // namespace cpu

// ---- the ops Python calls: check, make contiguous, allocate, run the kernel of the tensor's device ----
namespace {

#ifdef NANOMEGA_WITH_CUDA
#define DEVICE_OP(t, op) ((t).is_cuda() ? cuda::op : cpu::op)
#else
#define DEVICE_OP(t, op) (check_cpu(t), cpu::op)
inline void check_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu(), "nanomega fused ops: this build has CPU kernels only, got a tensor on ", t.device());
}
#endif

void check_like(const char* op, const at::Tensor& x, const at::Tensor& other, const char* name) {
  TORCH_CHECK(other.scalar_type() == x.scalar_type() && other.device() == x.device(), op, ": ", name,
              " is ", other.scalar_type(), " on ", other.device(), " but x is ", x.scalar_type(), " on ",
              x.device(), "; cast them to one dtype and device");
}

void check_grad(const char* op, const at::Tensor& x, const at::Tensor& grad) {
  check_like(op, x, grad, "grad");
  TORCH_CHECK(grad.sizes() == x.sizes(), op, ": grad ", grad.sizes(), " must have the shape ", x.sizes());
}

void check_width(const char* op, const at::Tensor& x, const at::Tensor& param, const char* name) {
  check_like(op, x, param, name);
  TORCH_CHECK(param.dim() == 1 && param.numel() > 0 && x.dim() >= 1 && x.size(-1) == param.numel(), op,
              ": x.shape[-1] must equal ", name, ".numel() (", name, " 1-D), got x ", x.sizes(), " and ",
              name, " ", param.sizes());
}

void check_scores(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2 && x.size(-2) <= x.size(-1), op, ": scores must be (..., s_q, s_k) with ",
              "s_q <= s_k (else some queries see no key), got ", x.sizes());
}

std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& b,
                                       double eps) {
  check_width("layer_norm", x_, w, "weight");
  check_width("layer_norm", x_, b, "bias");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({x.numel() / w.numel()}, x.options().dtype(at::toOpMathType(x.scalar_type())));
  at::Tensor rstd = at::empty_like(mean);
  DEVICE_OP(x, layer_norm_fwd)(x, w.contiguous(), b.contiguous(), eps, y, mean, rstd);
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& mean, const at::Tensor& rstd) {
  check_grad("layer_norm backward", x, dy);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous), dwdb;
  DEVICE_OP(x, layer_norm_bwd)(dy.contiguous(), x.contiguous(), w.contiguous(), mean, rstd, dx, dwdb);
  return {dx, dwdb[0].to(w.scalar_type()), dwdb[1].to(w.scalar_type())};
}

at::Tensor causal_softmax_fwd(const at::Tensor& x_, double scale) {
  check_scores("causal_softmax", x_);
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty_like(x);
  if (x.numel() > 0) DEVICE_OP(x, causal_softmax_fwd)(x, scale, y);
  return y;
}

at::Tensor causal_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale) {
  check_grad("causal_softmax backward", y, dy);
  at::Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  if (y.numel() > 0) DEVICE_OP(y, causal_softmax_bwd)(dy.contiguous(), y.contiguous(), scale, dx);
  return dx;
}

at::Tensor bias_gelu_fwd(const at::Tensor& x_, const at::Tensor& b) {
  check_width("bias_gelu", x_, b, "bias");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty_like(x);
  DEVICE_OP(x, bias_gelu_fwd)(x, b.contiguous(), y);
  return y;
}

std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& b) {
  check_grad("bias_gelu backward", x, dy);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous), db;
  DEVICE_OP(x, bias_gelu_bwd)(dy.contiguous(), x.contiguous(), b.contiguous(), dx, db);
  return {dx, db.to(b.scalar_type())};
}

std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x_, const at::Tensor& w, double eps) {
  check_width("rms_norm", x_, w, "weight");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({x.numel() / w.numel()}, x.options().dtype(at::toOpMathType(x.scalar_type())));
  DEVICE_OP(x, rms_norm_fwd)(x, w.contiguous(), eps, y, rstd);
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& rstd) {
  check_grad("rms_norm backward", x, dy);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous), dw;
  DEVICE_OP(x, rms_norm_bwd)(dy.contiguous(), x.contiguous(), w.contiguous(), rstd, dx, dw);
  return {dx, dw.to(w.scalar_type())};
}

// the (..., f) output shape of a (..., 2f) gate_up; an odd or empty last dim has no [gate | up] halves
std::vector<int64_t> swiglu_shape(const char* op, const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) > 0 && gu.size(-1) % 2 == 0, op,
              ": gate_up must be (..., 2f) laid out [gate | up], an even last dim > 0, got ", gu.sizes());
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() /= 2;
  return shape;
}

at::Tensor swiglu_fwd(const at::Tensor& gu_) {
  const std::vector<int64_t> shape = swiglu_shape("swiglu", gu_);
  const at::Tensor gu = gu_.contiguous();
  at::Tensor y = at::empty(shape, gu.options());
  DEVICE_OP(gu, swiglu_fwd)(gu, y);
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy, const at::Tensor& gu) {
  const std::vector<int64_t> shape = swiglu_shape("swiglu backward", gu);
  check_like("swiglu backward", gu, dy, "grad");
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(shape), "swiglu backward: grad ", dy.sizes(), " must have the shape ",
              at::IntArrayRef(shape));
  at::Tensor dgu = at::empty_like(gu, at::MemoryFormat::Contiguous);
  DEVICE_OP(gu, swiglu_bwd)(dy.contiguous(), gu.contiguous(), dgu);
  return dgu;
}

}  // namespace
}  // namespace nanomega

namespace nanomega::cpu_adam {
void bind(pybind11::module_& m);  // cpu_adam.cpp: the fused Adam/AdamW step (adam_step, adam_isa, adam_isas)
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace nanomega;
  m.attr("with_cuda") =
#ifdef NANOMEGA_WITH_CUDA
      true;
#else
      false;
#endif
  m.def("layer_norm_fwd", &layer_norm_fwd, "(x, weight, bias, eps) -> [y, mean, rstd]");
  m.def("layer_norm_bwd", &layer_norm_bwd, "(dy, x, weight, mean, rstd) -> [dx, dweight, dbias]");
  m.def("causal_softmax_fwd", &causal_softmax_fwd, "(scores, scale) -> probs");
  m.def("causal_softmax_bwd", &causal_softmax_bwd, "(dprobs, probs, scale) -> dscores");
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "(x, bias) -> gelu_tanh(x + bias)");
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "(dy, x, bias) -> [dx, dbias]");
  m.def("rms_norm_fwd", &rms_norm_fwd, "(x, weight, eps) -> [y, rstd]");
  m.def("rms_norm_bwd", &rms_norm_bwd, "(dy, x, weight, rstd) -> [dx, dweight]");
  m.def("swiglu_fwd", &swiglu_fwd, "(gate_up) -> silu(gate) * up");
  m.def("swiglu_bwd", &swiglu_bwd, "(dy, gate_up) -> dgate_up");
  cpu_adam::bind(m);
}
