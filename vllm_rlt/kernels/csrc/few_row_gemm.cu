// Few-row products on the tensor cores: out = x @ w.T for 1-16 rows of bf16 x, with w in
// bf16 or in float8 (e4m3, times a per-row scale: out = x @ (w * scale[:, None]).T). float8
// weights are widened to bf16 in registers. The mma.sync (m16n8k16) roles are swapped: a
// 16-output tile of the weight is the A operand and the rows of x are the 8 (or 16)
// columns of B, so few rows waste no tensor-core work on padding weights, only on padding
// rows.
//
// A thread of an mma holds, for output g (and g + 8) of its tile, k pairs 2t, 2t+1 and
// 2t+8, 2t+9 of each 16-wide k step. The sum over k may run in any order as long as the
// weight and x agree, so physical k = 16 t + 4 s + j within a 64-wide chunk plays logical
// k = 16 s + {2t, 2t+1, 2t+8, 2t+9}[j] of step s: each thread then loads 16 contiguous
// weights of each of its two weight rows per chunk (16 bytes of float8, 32 of bf16), and
// 32 contiguous bytes of its x row.
//
// A block of WARPS warps shares one 16-output tile and splits K between its warps; each
// warp loads its first U chunks of weights before waiting on the previous kernel
// (programmatic dependent launch: so the kernel just before must not write the weights;
// weight updates land between passes, behind kernels that wait), keeps the next U chunks in flight while it multiplies,
// and the block adds its warps' sums in shared memory. The epilogue scales by the row's
// scale (float8) and rounds to bf16; with SILU the interleaved gate/up outputs (2j, 2j+1)
// become silu(gate) * up, rounded like the separate torch ops.
//
// Device code only: extern "C" kernels {w8a16,w16a16}_n{8,16}{,_silu,_add_norm,
// _norm_add_norm} (N8 for 1-8 rows, N16 for 9-16), each launched with one block of WARPS
// warps per 16 outputs; the last two end with a sandwich layer's residual add and norms.
#include "few_row_mma.cuh"

namespace {

using namespace few_row;

// After every block has written its outputs of y = x @ w.T ([rows, n] bf16), the last block
// to finish (counted on `counter`, which it resets for the next launch) computes, per row,
// x_out = residual + w_branch * norm(y) (residual + y without NORM_BRANCH) and
// normed = w_next * norm(x_out), rounding where the torch ops and the Triton norm kernel
// round: the residual add and both norms of a sandwich layer without a kernel of their own.
// With `vectorized` (see add_norms_row_by_warp) each warp takes rows of its own.
template <bool NORM_BRANCH>
__device__ __forceinline__ void add_norms_when_last(
    const __nv_bfloat16* y, const __nv_bfloat16* __restrict__ residual, int res_stride,
    const __nv_bfloat16* __restrict__ w_branch, const __nv_bfloat16* __restrict__ w_next,
    __nv_bfloat16* x_out, __nv_bfloat16* normed, int rows, int n, float eps,
    unsigned int* counter, int vectorized) {
  __shared__ bool last;
  __shared__ float sums[WARPS];
  __threadfence();  // this block's outputs (written by warp 0), seen before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // every block's outputs, seen after all counts
  asm volatile("" ::: "memory");  // and no read of them moved above
  if (vectorized) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int row = warp; row < rows; row += WARPS)
      add_norms_row_by_warp<NORM_BRANCH>(y + (size_t)row * n, residual + (size_t)row * res_stride,
                                         w_branch, w_next, x_out + (size_t)row * n,
                                         normed + (size_t)row * n, n, eps, lane);
  } else {
    for (int row = 0; row < rows; ++row)
      add_norms_row_by_block<NORM_BRANCH>(y + (size_t)row * n, residual + (size_t)row * res_stride,
                                          w_branch, w_next, x_out + (size_t)row * n,
                                          normed + (size_t)row * n, n, eps, sums);
  }
  if (threadIdx.x == 0) *counter = 0u;
}

}  // namespace

// x: [rows, K] bf16 with row stride x_stride; w: [n, K] float8 e4m3 (w8a16) or bf16
// (w16a16), contiguous; scale: [n] float32 (float8 only, else unread); out: [rows, n] (or
// [rows, n / 2] with SILU) bf16 with row stride out_stride. Needs rows within the kernel's
// 8 or 16, n % 16 == 0 (the grid is n / 16 blocks), K % 64 == 0, x and its rows 16-byte
// aligned; pdl: launched as a programmatic dependent.
#define FEW_ROW_KERNEL(NAME, NT, SILU, FP8)                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
      NAME(const __nv_bfloat16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w, \
           const float* __restrict__ scale, __nv_bfloat16* __restrict__ out, int out_stride, \
           int rows, int K, int pdl) {                                                       \
    gemm_body<NT, SILU, FP8>(x, x_stride, w, scale, out, out_stride, rows, K, pdl);         \
  }

// As above without SILU, then the sandwich layer's residual add and norms (see
// add_norms_when_last): y is the [rows, n] bf16 scratch the product goes to.
#define FEW_ROW_NORMS_KERNEL(NAME, NT, FP8, NORM_BRANCH)                                     \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
      NAME(const __nv_bfloat16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w, \
           const float* __restrict__ scale, __nv_bfloat16* y, int rows, int K,             \
           const __nv_bfloat16* __restrict__ residual, int res_stride,                       \
           const __nv_bfloat16* __restrict__ w_branch, const __nv_bfloat16* __restrict__ w_next, \
           __nv_bfloat16* x_out, __nv_bfloat16* normed, float eps, unsigned int* counter,    \
           int vectorized, int pdl) {                                                        \
    const int n = gridDim.x * 16;                                                            \
    gemm_body<NT, false, FP8>(x, x_stride, w, scale, y, n, rows, K, pdl);                   \
    add_norms_when_last<NORM_BRANCH>(y, residual, res_stride, w_branch, w_next, x_out, normed, \
                                     rows, n, eps, counter, vectorized);                     \
  }

FEW_ROW_KERNEL(w8a16_n8, 1, false, true)
FEW_ROW_KERNEL(w8a16_n8_silu, 1, true, true)
FEW_ROW_KERNEL(w8a16_n16, 2, false, true)
FEW_ROW_KERNEL(w8a16_n16_silu, 2, true, true)
FEW_ROW_KERNEL(w16a16_n8, 1, false, false)
FEW_ROW_KERNEL(w16a16_n8_silu, 1, true, false)
FEW_ROW_KERNEL(w16a16_n16, 2, false, false)
FEW_ROW_KERNEL(w16a16_n16_silu, 2, true, false)
FEW_ROW_NORMS_KERNEL(w8a16_n8_add_norm, 1, true, false)
FEW_ROW_NORMS_KERNEL(w8a16_n16_add_norm, 2, true, false)
FEW_ROW_NORMS_KERNEL(w8a16_n8_norm_add_norm, 1, true, true)
FEW_ROW_NORMS_KERNEL(w8a16_n16_norm_add_norm, 2, true, true)
FEW_ROW_NORMS_KERNEL(w16a16_n8_add_norm, 1, false, false)
FEW_ROW_NORMS_KERNEL(w16a16_n16_add_norm, 2, false, false)
FEW_ROW_NORMS_KERNEL(w16a16_n8_norm_add_norm, 1, false, true)
FEW_ROW_NORMS_KERNEL(w16a16_n16_norm_add_norm, 2, false, true)
