// The device half of each fused op: inputs already checked and made contiguous, outputs allocated.
// fused_cpu.cpp implements namespace cpu and routes CUDA tensors to namespace cuda
// (fused_cuda_bind.cpp, built only when CUDA is available). Lesson: lessons/13-fused-kernels.md
#pragma once
#include <ATen/core/Tensor.h>

#define NANOMEGA_DEVICE_OPS                                                                      \
  /* y = (x - mean) * rstd * w + b per row of width H = w.numel(); mean, rstd (rows,) in opmath */ \
  void layer_norm_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps,   \
                      at::Tensor& y, at::Tensor& mean, at::Tensor& rstd);                          \
  /* dx per row; dwdb (2, H) opmath: column sums of dy * xhat and of dy */                         \
  void layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,              \
                      const at::Tensor& mean, const at::Tensor& rstd, at::Tensor& dx,              \
                      at::Tensor& dwdb);                                                           \
  /* y = softmax(x * scale) over keys j <= i + s_k - s_q; masked keys get 0, never touched */      \
  void causal_softmax_fwd(const at::Tensor& x, double scale, at::Tensor& y);                       \
  /* dx = scale * y * (dy - sum_j dy_j y_j) on visible keys, 0 elsewhere */                        \
  void causal_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale, at::Tensor& dx); \
  /* y = gelu_tanh(x + b), b broadcast over rows */                                                \
  void bias_gelu_fwd(const at::Tensor& x, const at::Tensor& b, at::Tensor& y);                     \
  /* dx = dy * gelu_tanh'(x + b); db (H,) opmath = column sums of dx */                            \
  void bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& b,               \
                     at::Tensor& dx, at::Tensor& db);                                             \
  /* y = w * T(x * rstd) per row of width H (modern.rms_norm's order); rstd (rows,) opmath */       \
  void rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y,           \
                    at::Tensor& rstd);                                                             \
  /* dx per row; dw (H,) opmath: column sums of dy * x * rstd */                                   \
  void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,                \
                    const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw);                       \
  /* y (..., f) = silu(gate) * up of gate_up (..., 2f) laid out [gate | up] */                     \
  void swiglu_fwd(const at::Tensor& gate_up, at::Tensor& y);                                       \
  /* dgate_up = [dy * up * silu'(gate) | dy * silu(gate)] */                                       \
  void swiglu_bwd(const at::Tensor& dy, const at::Tensor& gate_up, at::Tensor& dgate_up);

namespace nanomega::cpu {
NANOMEGA_DEVICE_OPS
}
namespace nanomega::cuda {
NANOMEGA_DEVICE_OPS
}
