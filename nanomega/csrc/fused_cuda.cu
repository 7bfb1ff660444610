// CUDA kernels of the fused ops: one block per row for the row-wise ops (LayerNorm, RMSNorm, causal softmax),
// grid-stride loops for the element-wise ones (bias + GeLU by column tiles, SwiGLU), and a two-stage column sum
// for the parameter gradients.
// Same math as fused_cpu.cpp, accumulated in at::opmath_type. NOT RUN on the project's machines (no GPU):
// tests/test_fused.py only compiles this file with nvcc. Lesson: lessons/13-fused-kernels.md
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "fused_cuda.h"
#include "fused_cuda_limits.h"

namespace nanomega::cuda {
namespace {

struct Sum {
  template <typename A>
  __device__ A operator()(A a, A b) const { return a + b; }
};
struct Max {
  template <typename A>
  __device__ A operator()(A a, A b) const { return a > b ? a : b; }
};

// op over the values v of all kThreads threads of the block; every thread gets the result
template <typename A, typename Op>
__device__ A block_reduce(A v, Op op) {
  __shared__ A partial[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // a previous call may still be reading partial
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  v = partial[0];
  for (int w = 1; w < kWarps; ++w) v = op(v, partial[w]);
  return v;
}

// gelu_tanh(u) = u * sigmoid(2z), z = sqrt(2/pi) (u + 0.044715 u^3); derivation in fused_cpu.cpp
constexpr double kA2 = 2 * 0.7978845608028654;
constexpr double kB = 0.044715;

// e = exp(-2z), -2z clamped to [-80, 80] (as on the CPU, where fast-math division of 1 by 1 + inf is not 0)
template <typename A>
__device__ A exp_neg_2z(A u) {
  const A two_z = u * (A(kA2) + A(kA2 * kB) * u * u);
  return exp(max(min(-two_z, A(80)), A(-80)));
}

template <typename A>
__device__ A gelu_of(A u) {
  return u / (A(1) + exp_neg_2z(u));  // u * sigmoid(2z)
}

// 1 - s formed as e * s, never as a difference (see fused_cpu.cpp: s within an ulp of 1 for u >~ 5)
template <typename A>
__device__ A gelu_grad(A u) {
  const A e = exp_neg_2z(u);
  const A s = A(1) / (A(1) + e);
  return s * (A(1) + u * (e * s) * (A(kA2) + A(3 * kA2 * kB) * u * u));
}

// e = exp(-g), -g clamped to [-80, 80] as above, for sigmoid(g) = 1 / (1 + e)
template <typename A>
__device__ A exp_neg(A g) {
  return exp(max(min(-g, A(80)), A(-80)));
}

// The row is read from global memory once: its values are kept (as A) in dynamic shared memory for the
// variance and output passes when `cached` (layer_norm_row_cache_bytes > 0: the row fits beside
// block_reduce's partials in 48 KiB), else read again (from L2).
// Each thread reads back only the columns it wrote, so no barrier is needed between the passes.

template <typename T, typename A>
__global__ void layer_norm_fwd_kernel(const T* x, const T* w, const T* b, T* y, A* mean, A* rstd,
                                      int64_t H, A eps, bool cached) {
  extern __shared__ __align__(16) unsigned char row_cache[];
  A* row = reinterpret_cast<A*>(row_cache);
  const int64_t r = blockIdx.x;
  const T* xr = x + r * H;
  A s = 0, q = 0;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) {
    const A v = A(xr[j]);
    if (cached) row[j] = v;
    s += v;
  }
  const A mu = block_reduce(s, Sum()) / H;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) {
    const A d = (cached ? row[j] : A(xr[j])) - mu;
    q += d * d;
  }
  const A rs = A(1) / sqrt(block_reduce(q, Sum()) / H + eps);
  for (int64_t j = threadIdx.x; j < H; j += kThreads) {
    y[r * H + j] = T(((cached ? row[j] : A(xr[j])) - mu) * rs * A(w[j]) + A(b[j]));
  }
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename T, typename A>
__global__ void layer_norm_bwd_kernel(const T* dy, const T* x, const T* w, const A* mean, const A* rstd,
                                      T* dx, int64_t H) {
  const int64_t r = blockIdx.x;
  const A mu = mean[r], rs = rstd[r];
  A g_sum = 0, gx_sum = 0;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) {
    const A g = A(dy[r * H + j]) * A(w[j]);
    g_sum += g;
    gx_sum += g * (A(x[r * H + j]) - mu) * rs;
  }
  const A g_mean = block_reduce(g_sum, Sum()) / H, gx_mean = block_reduce(gx_sum, Sum()) / H;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) {
    const A xhat = (A(x[r * H + j]) - mu) * rs;
    dx[r * H + j] = T(rs * (A(dy[r * H + j]) * A(w[j]) - g_mean - xhat * gx_mean));
  }
}

// the two addends of dweight and dbias at (r, j)
template <typename T, typename A>
struct LayerNormParamGrads {
  const T *dy, *x;
  const A *mean, *rstd;
  int64_t H;
  __device__ void operator()(int64_t r, int64_t j, A& dw, A& db) const {
    const A d = A(dy[r * H + j]);
    dw += d * (A(x[r * H + j]) - mean[r]) * rstd[r];
    db += d;
  }
};

// the addend of dbias at (r, j): dx recomputed, not read back in T precision
template <typename T, typename A>
struct BiasGeluBiasGrad {
  const T *dy, *x, *b;
  int64_t H;
  __device__ void operator()(int64_t r, int64_t j, A& db, A&) const {
    db += A(dy[r * H + j]) * gelu_grad(A(x[r * H + j]) + A(b[j]));
  }
};

template <typename T, typename A>
__global__ void rms_norm_fwd_kernel(const T* x, const T* w, T* y, A* rstd, int64_t H, A eps) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * H;
  A q = 0;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) q += A(xr[j]) * A(xr[j]);
  const A rs = A(1) / sqrt(block_reduce(q, Sum()) / H + eps);
  // modern.rms_norm's order: x * rstd rounded to T, then times the weight
  for (int64_t j = threadIdx.x; j < H; j += kThreads) y[r * H + j] = T(A(w[j]) * A(T(A(xr[j]) * rs)));
  if (threadIdx.x == 0) rstd[r] = rs;
}

// dx = rstd (g - xhat mean(g xhat)),  g = dy w,  xhat = x rstd
template <typename T, typename A>
__global__ void rms_norm_bwd_kernel(const T* dy, const T* x, const T* w, const A* rstd, T* dx, int64_t H) {
  const int64_t r = blockIdx.x;
  const A rs = rstd[r];
  A gx_sum = 0;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) gx_sum += A(dy[r * H + j]) * A(w[j]) * A(x[r * H + j]);
  const A gx_mean = block_reduce(gx_sum, Sum()) * rs / H;
  for (int64_t j = threadIdx.x; j < H; j += kThreads) {
    dx[r * H + j] = T(rs * (A(dy[r * H + j]) * A(w[j]) - A(x[r * H + j]) * rs * gx_mean));
  }
}

// the addend of dweight at (r, j)
template <typename T, typename A>
struct RMSNormWeightGrad {
  const T *dy, *x;
  const A* rstd;
  int64_t H;
  __device__ void operator()(int64_t r, int64_t j, A& dw, A&) const {
    dw += A(dy[r * H + j]) * A(x[r * H + j]) * rstd[r];
  }
};

// Column sums in two stages, deterministic (a fixed order, no atomics). One block of (32, 8) threads per 32
// columns walked every row left 24 blocks for H = 768 on a 132-SM GPU (~0.3-1 ms where ATen takes ~30 us);
// now blockIdx.y cuts the rows into `chunks` (column_chunks: enough blocks to fill any GPU), each block sums
// its chunk's rows of its 32 columns into part[c][j], and column_finish adds the chunks' partials in order.
template <typename A, typename F>
__global__ void column_partials_kernel(F f, int64_t rows, int64_t H, int64_t chunk, A* part0, A* part1) {
  __shared__ A s0[8][33], s1[8][33];  // 33: no shared-memory bank conflicts
  const int64_t j = blockIdx.x * 32 + threadIdx.x, c = blockIdx.y;
  const int64_t hi = min(rows, (c + 1) * chunk);
  A a0 = 0, a1 = 0;
  if (j < H) {
    for (int64_t r = c * chunk + threadIdx.y; r < hi; r += 8) f(r, j, a0, a1);
  }
  s0[threadIdx.y][threadIdx.x] = a0;
  s1[threadIdx.y][threadIdx.x] = a1;
  __syncthreads();
  if (threadIdx.y == 0 && j < H) {
    for (int k = 1; k < 8; ++k) {
      a0 += s0[k][threadIdx.x];
      a1 += s1[k][threadIdx.x];
    }
    part0[c * H + j] = a0;
    if (part1 != nullptr) part1[c * H + j] = a1;
  }
}

template <typename A>
__global__ void column_finish_kernel(const A* part0, const A* part1, int64_t chunks, int64_t H, A* out0, A* out1) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < H; j += int64_t(gridDim.x) * blockDim.x) {
    A a0 = 0, a1 = 0;
    for (int64_t c = 0; c < chunks; ++c) {  // coalesced: neighbouring threads read neighbouring columns
      a0 += part0[c * H + j];
      if (part1 != nullptr) a1 += part1[c * H + j];
    }
    out0[j] = a0;
    if (out1 != nullptr) out1[j] = a1;
  }
}

template <typename T, typename A>
__global__ void causal_softmax_fwd_kernel(const T* x, T* y, int64_t sq, int64_t sk, A scale) {
  const int64_t r = blockIdx.x, n = min(r % sq + sk - sq + 1, sk);  // visible keys of this query
  const T* xr = x + r * sk;
  A m = A(xr[0]) * scale, s = 0;  // key 0 is always visible
  for (int64_t j = threadIdx.x; j < n; j += kThreads) m = max(m, A(xr[j]) * scale);
  m = block_reduce(m, Max());
  for (int64_t j = threadIdx.x; j < n; j += kThreads) s += exp(A(xr[j]) * scale - m);
  const A inv = A(1) / block_reduce(s, Sum());
  for (int64_t j = threadIdx.x; j < sk; j += kThreads) {
    y[r * sk + j] = j < n ? T(exp(A(xr[j]) * scale - m) * inv) : T(0);
  }
}

template <typename T, typename A>
__global__ void causal_softmax_bwd_kernel(const T* dy, const T* y, T* dx, int64_t sq, int64_t sk, A scale) {
  const int64_t r = blockIdx.x, n = min(r % sq + sk - sq + 1, sk);
  A dot = 0;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) dot += A(dy[r * sk + j]) * A(y[r * sk + j]);
  dot = block_reduce(dot, Sum());
  for (int64_t j = threadIdx.x; j < sk; j += kThreads) {
    dx[r * sk + j] = j < n ? T(scale * A(y[r * sk + j]) * (A(dy[r * sk + j]) - dot)) : T(0);
  }
}

// bias + GeLU on a (rows, H) matrix: blockIdx.y picks kThreads columns, each thread loads its bias once and
// walks the rows (grid-stride over blockIdx.x): coalesced, and no 64-bit `i % H` per element as a flat loop needs
template <typename T, typename A>
__global__ void bias_gelu_fwd_kernel(const T* x, const T* b, T* y, int64_t rows, int64_t H) {
  const int64_t j = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (j >= H) return;
  const A bj = A(b[j]);
  for (int64_t i = blockIdx.x * H + j; i < rows * H; i += int64_t(gridDim.x) * H) y[i] = T(gelu_of(A(x[i]) + bj));
}

template <typename T, typename A>
__global__ void bias_gelu_bwd_kernel(const T* dy, const T* x, const T* b, T* dx, int64_t rows, int64_t H) {
  const int64_t j = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (j >= H) return;
  const A bj = A(b[j]);
  for (int64_t i = blockIdx.x * H + j; i < rows * H; i += int64_t(gridDim.x) * H) {
    dx[i] = T(A(dy[i]) * gelu_grad(A(x[i]) + bj));
  }
}

// element i of the (rows, F) output reads gate (r, j) and up (r, F + j) of the (rows, 2F) input
template <typename T, typename A>
__global__ void swiglu_fwd_kernel(const T* gu, T* y, int64_t n, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t gate = i / F * 2 * F + i % F;
    const A g = A(gu[gate]);
    y[i] = T(g / (A(1) + exp_neg(g)) * A(gu[gate + F]));  // silu(g) * up
  }
}

// dgate = dy up s (1 + g e s) (1 - s formed as e s, see gelu_grad), dup = dy g s
template <typename T, typename A>
__global__ void swiglu_bwd_kernel(const T* dy, const T* gu, T* dgu, int64_t n, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t gate = i / F * 2 * F + i % F;
    const A g = A(gu[gate]), u = A(gu[gate + F]), d = A(dy[i]);
    const A e = exp_neg(g), s = A(1) / (A(1) + e);
    dgu[gate] = T(d * u * s * (A(1) + g * (e * s)));
    dgu[gate + F] = T(d * g * s);
  }
}

unsigned elementwise_blocks(int64_t n) {  // grid-stride loops: enough blocks to fill any GPU, no more
  return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
}

dim3 column_tiles(int64_t rows, int64_t H) {  // (row blocks, column tiles of kThreads): ~4096 blocks at most
  const int64_t tiles = (H + kThreads - 1) / kThreads;
  return dim3(unsigned(std::max<int64_t>(1, std::min<int64_t>(rows, 4096 / tiles))), unsigned(tiles));
}

// out0 (and out1) = column sums of f's addends over `rows`, through part: (2, column_chunks(rows, H), H)
template <typename A, typename F>
void column_sums(F f, int64_t rows, int64_t H, A* out0, A* out1, A* part, cudaStream_t stream) {
  const int64_t chunks = column_chunks(rows, H), chunk = std::max<int64_t>(1, (rows + chunks - 1) / chunks);
  A* part1 = out1 != nullptr ? part + chunks * H : nullptr;
  column_partials_kernel<A><<<dim3(unsigned((H + 31) / 32), unsigned(chunks)), dim3(32, 8), 0, stream>>>(
      f, rows, H, chunk, part, part1);
  column_finish_kernel<A><<<elementwise_blocks(H), kThreads, 0, stream>>>(part, part1, chunks, H, out0, out1);
}

}  // namespace

int64_t column_chunks(int64_t rows, int64_t H) {  // blocks of 32 columns x chunks >= ~1024: any GPU kept busy
  const int64_t column_blocks = (H + 31) / 32, want = (1024 + column_blocks - 1) / column_blocks;
  return std::max<int64_t>(1, std::min<int64_t>(want, (rows + 7) / 8));  // a chunk keeps >= 8 rows
}

// A grid of 0 blocks is a launch error: empty inputs launch only the column sums (which write zeros).
template <typename T>
void Launch<T>::layer_norm_fwd(const T* x, const T* w, const T* b, T* y, A* mean, A* rstd, int64_t rows,
                               int64_t H, A eps, cudaStream_t stream) {
  const int64_t cache = layer_norm_row_cache_bytes(H, sizeof(A));
  if (rows > 0) {
    layer_norm_fwd_kernel<T, A><<<rows, kThreads, cache, stream>>>(x, w, b, y, mean, rstd, H, eps, cache > 0);
  }
}

template <typename T>
void Launch<T>::layer_norm_bwd(const T* dy, const T* x, const T* w, const A* mean, const A* rstd, T* dx,
                               A* dwdb, A* part, int64_t rows, int64_t H, cudaStream_t stream) {
  if (rows > 0) layer_norm_bwd_kernel<T, A><<<rows, kThreads, 0, stream>>>(dy, x, w, mean, rstd, dx, H);
  column_sums<A>(LayerNormParamGrads<T, A>{dy, x, mean, rstd, H}, rows, H, dwdb, dwdb + H, part, stream);
}

template <typename T>
void Launch<T>::causal_softmax_fwd(const T* x, T* y, int64_t rows, int64_t sq, int64_t sk, A scale,
                                   cudaStream_t stream) {
  if (rows > 0) causal_softmax_fwd_kernel<T, A><<<rows, kThreads, 0, stream>>>(x, y, sq, sk, scale);
}

template <typename T>
void Launch<T>::causal_softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t sq, int64_t sk,
                                   A scale, cudaStream_t stream) {
  if (rows > 0) causal_softmax_bwd_kernel<T, A><<<rows, kThreads, 0, stream>>>(dy, y, dx, sq, sk, scale);
}

template <typename T>
void Launch<T>::bias_gelu_fwd(const T* x, const T* b, T* y, int64_t rows, int64_t H, cudaStream_t stream) {
  if (rows > 0) bias_gelu_fwd_kernel<T, A><<<column_tiles(rows, H), kThreads, 0, stream>>>(x, b, y, rows, H);
}

template <typename T>
void Launch<T>::bias_gelu_bwd(const T* dy, const T* x, const T* b, T* dx, A* db, A* part, int64_t rows,
                              int64_t H, cudaStream_t stream) {
  if (rows > 0) {
    bias_gelu_bwd_kernel<T, A><<<column_tiles(rows, H), kThreads, 0, stream>>>(dy, x, b, dx, rows, H);
  }
  column_sums<A>(BiasGeluBiasGrad<T, A>{dy, x, b, H}, rows, H, db, static_cast<A*>(nullptr), part, stream);
}

template <typename T>
void Launch<T>::rms_norm_fwd(const T* x, const T* w, T* y, A* rstd, int64_t rows, int64_t H, A eps,
                             cudaStream_t stream) {
  if (rows > 0) rms_norm_fwd_kernel<T, A><<<rows, kThreads, 0, stream>>>(x, w, y, rstd, H, eps);
}

template <typename T>
void Launch<T>::rms_norm_bwd(const T* dy, const T* x, const T* w, const A* rstd, T* dx, A* dw, A* part,
                             int64_t rows, int64_t H, cudaStream_t stream) {
  if (rows > 0) rms_norm_bwd_kernel<T, A><<<rows, kThreads, 0, stream>>>(dy, x, w, rstd, dx, H);
  column_sums<A>(RMSNormWeightGrad<T, A>{dy, x, rstd, H}, rows, H, dw, static_cast<A*>(nullptr), part, stream);
}

template <typename T>
void Launch<T>::swiglu_fwd(const T* gu, T* y, int64_t rows, int64_t F, cudaStream_t stream) {
  if (rows > 0) swiglu_fwd_kernel<T, A><<<elementwise_blocks(rows * F), kThreads, 0, stream>>>(gu, y, rows * F, F);
}

template <typename T>
void Launch<T>::swiglu_bwd(const T* dy, const T* gu, T* dgu, int64_t rows, int64_t F, cudaStream_t stream) {
  if (rows > 0) {
    swiglu_bwd_kernel<T, A><<<elementwise_blocks(rows * F), kThreads, 0, stream>>>(dy, gu, dgu, rows * F, F);
  }
}

template struct Launch<float>;
template struct Launch<double>;
template struct Launch<c10::BFloat16>;
template struct Launch<c10::Half>;

}  // namespace nanomega::cuda
