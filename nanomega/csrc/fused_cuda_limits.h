// The fused CUDA kernels' block size and the fused LayerNorm forward's shared-memory budget
// (fused_cuda.cu), in plain C++ so that tests/test_fused.py evaluates the budget for every preset's
// width with the host compiler. Lesson: lessons/13-fused-kernels.md
#pragma once
#include <cstdint>

namespace nanomega::cuda {

constexpr int kThreads = 256;  // threads per row-block; a row of any width is walked in strides of it
constexpr int kWarps = kThreads / 32;
// the shared memory, static and dynamic together, a block gets without cudaFuncSetAttribute's opt-in
constexpr int64_t kSharedBytesNoOptIn = 48 * 1024;

// Dynamic shared memory the LayerNorm forward caches its row in: H values of the accumulation type
// (a_size bytes each) when they fit beside the kernel's static shared memory (block_reduce's kWarps
// partials), else 0 and the row is read again. n_embd 12288 in fp32 would need 48 KiB + 32 B:
// over the limit, the launch fails (issue 42 M1), so such a row is read twice instead.
constexpr int64_t layer_norm_row_cache_bytes(int64_t H, int64_t a_size) {
  return (H + kWarps) * a_size <= kSharedBytesNoOptIn ? H * a_size : 0;
}

}  // namespace nanomega::cuda
