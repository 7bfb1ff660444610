// Kernel launchers of fused_cuda.cu on raw pointers, so that nvcc compiles the kernels against a few
// light headers and fused_cuda_bind.cpp does the Tensor work with the host compiler.
// Instantiated for float, double, c10::BFloat16 and c10::Half. Lesson: lessons/13-fused-kernels.md
#pragma once
#include <ATen/OpMathType.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace nanomega::cuda {

// how many chunks of rows the parameter gradients' column sums are cut into (their workspace's middle size)
int64_t column_chunks(int64_t rows, int64_t H);

template <typename T>
struct Launch {
  using A = at::opmath_type<T>;  // accumulation type: float for bf16 and fp16
  // rows x H matrices, row-major; b, w: (H,); mean, rstd: (rows,); dwdb: (2, H); db: (H,);
  // part: the column sums' workspace, (2, column_chunks(rows, H), H)
  static void layer_norm_fwd(const T* x, const T* w, const T* b, T* y, A* mean, A* rstd, int64_t rows,
                             int64_t H, A eps, cudaStream_t stream);
  static void layer_norm_bwd(const T* dy, const T* x, const T* w, const A* mean, const A* rstd, T* dx,
                             A* dwdb, A* part, int64_t rows, int64_t H, cudaStream_t stream);
  // rows = batch * sq rows of sk scores
  static void causal_softmax_fwd(const T* x, T* y, int64_t rows, int64_t sq, int64_t sk, A scale,
                                 cudaStream_t stream);
  static void causal_softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t sq, int64_t sk,
                                 A scale, cudaStream_t stream);
  static void bias_gelu_fwd(const T* x, const T* b, T* y, int64_t rows, int64_t H, cudaStream_t stream);
  static void bias_gelu_bwd(const T* dy, const T* x, const T* b, T* dx, A* db, A* part, int64_t rows, int64_t H,
                            cudaStream_t stream);
  // RMSNorm on rows x H: rstd (rows,); dw (H,)
  static void rms_norm_fwd(const T* x, const T* w, T* y, A* rstd, int64_t rows, int64_t H, A eps,
                           cudaStream_t stream);
  static void rms_norm_bwd(const T* dy, const T* x, const T* w, const A* rstd, T* dx, A* dw, A* part,
                           int64_t rows, int64_t H, cudaStream_t stream);
  // SwiGLU: gate_up rows x 2F laid out [gate | up]; y, dy rows x F
  static void swiglu_fwd(const T* gate_up, T* y, int64_t rows, int64_t F, cudaStream_t stream);
  static void swiglu_bwd(const T* dy, const T* gate_up, T* dgate_up, int64_t rows, int64_t F, cudaStream_t stream);
};

}  // namespace nanomega::cuda
