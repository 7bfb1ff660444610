// The CUDA half of the ops in fused_ops.h: pick the dtype, make x's device current, launch on its
// current stream (fused_cuda.cu), check the launch. Built only when CUDA is available; on the
// project's CPU machines tests/test_fused.py compiles it, nothing runs it. Lesson: lessons/13-fused-kernels.md
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fused_cuda.h"
#include "fused_ops.h"

namespace nanomega::cuda {
namespace {

template <typename F>
void on_device(const at::Tensor& x, const F& launch) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nanomega fused op (CUDA)", [&] {
    launch(Launch<scalar_t>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// a tensor's data as whatever T* (or const T*) the launcher parameter asks for; dtypes are checked
struct Ptr {
  void* p;
  template <typename T>
  operator T*() const {
    return static_cast<T*>(p);
  }
};
Ptr ptr(const at::Tensor& t) {
  return {t.data_ptr()};
}

at::Tensor opmath_empty(const at::Tensor& x, at::IntArrayRef shape) {
  return at::empty(shape, x.options().dtype(at::toOpMathType(x.scalar_type())));
}

}  // namespace

void layer_norm_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::Tensor& y,
                    at::Tensor& mean, at::Tensor& rstd) {
  const int64_t H = w.numel();
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.layer_norm_fwd(ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd),
                          x.numel() / H, H, eps, s);
  });
}

void layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& mean,
                    const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dwdb) {
  const int64_t H = w.numel();
  dwdb = opmath_empty(x, {2, H});
  at::Tensor part = opmath_empty(x, {2, column_chunks(x.numel() / H, H), H});
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.layer_norm_bwd(ptr(dy), ptr(x), ptr(w), ptr(mean), ptr(rstd), ptr(dx),
                          ptr(dwdb), ptr(part), x.numel() / H, H, s);
  });
}

void causal_softmax_fwd(const at::Tensor& x, double scale, at::Tensor& y) {
  const int64_t sq = x.size(-2), sk = x.size(-1);
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.causal_softmax_fwd(ptr(x), ptr(y), x.numel() / sk, sq, sk, scale, s);
  });
}

void causal_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale, at::Tensor& dx) {
  const int64_t sq = y.size(-2), sk = y.size(-1);
  on_device(y, [&](auto launch, cudaStream_t s) {
    launch.causal_softmax_bwd(ptr(dy), ptr(y), ptr(dx), y.numel() / sk, sq, sk, scale, s);
  });
}

void bias_gelu_fwd(const at::Tensor& x, const at::Tensor& b, at::Tensor& y) {
  const int64_t H = b.numel();
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.bias_gelu_fwd(ptr(x), ptr(b), ptr(y), x.numel() / H, H, s);
  });
}

void bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& b, at::Tensor& dx,
                   at::Tensor& db) {
  const int64_t H = b.numel();
  db = opmath_empty(x, {H});
  at::Tensor part = opmath_empty(x, {2, column_chunks(x.numel() / H, H), H});
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.bias_gelu_bwd(ptr(dy), ptr(x), ptr(b), ptr(dx), ptr(db), ptr(part), x.numel() / H, H, s);
  });
}

void rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd) {
  const int64_t H = w.numel();
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.rms_norm_fwd(ptr(x), ptr(w), ptr(y), ptr(rstd), x.numel() / H, H, eps, s);
  });
}

void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                  at::Tensor& dx, at::Tensor& dw) {
  const int64_t H = w.numel();
  dw = opmath_empty(x, {H});
  at::Tensor part = opmath_empty(x, {2, column_chunks(x.numel() / H, H), H});
  on_device(x, [&](auto launch, cudaStream_t s) {
    launch.rms_norm_bwd(ptr(dy), ptr(x), ptr(w), ptr(rstd), ptr(dx), ptr(dw), ptr(part), x.numel() / H, H, s);
  });
}

void swiglu_fwd(const at::Tensor& gate_up, at::Tensor& y) {
  const int64_t F = y.size(-1);
  on_device(gate_up, [&](auto launch, cudaStream_t s) {
    launch.swiglu_fwd(ptr(gate_up), ptr(y), y.numel() / F, F, s);
  });
}

void swiglu_bwd(const at::Tensor& dy, const at::Tensor& gate_up, at::Tensor& dgate_up) {
  const int64_t F = dy.size(-1);
  on_device(gate_up, [&](auto launch, cudaStream_t s) {
    launch.swiglu_bwd(ptr(dy), ptr(gate_up), ptr(dgate_up), dy.numel() / F, F, s);
  });
}

}  // namespace nanomega::cuda
