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
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 8;
// Chunks of 64 k in flight per warp: 4 KB of weights a warp either way.
template <bool FP8>
constexpr int IN_FLIGHT = FP8 ? 4 : 2;

// What a thread holds of one weight row for one 64-wide chunk: 16 weights.
template <bool FP8>
struct Slice {
  uint4 word[FP8 ? 1 : 2];
};

template <bool FP8>
__device__ __forceinline__ Slice<FP8> load_slice(const uint8_t* p) {
  Slice<FP8> slice;
  slice.word[0] = __ldg(reinterpret_cast<const uint4*>(p));
  if constexpr (!FP8) slice.word[1] = __ldg(reinterpret_cast<const uint4*>(p) + 1);
  return slice;
}

__device__ __forceinline__ uint32_t widen(uint32_t pair_bytes) {
  // pair_bytes: two e4m3 bytes in the high byte of each 16-bit half. Moving sign,
  // exponent and mantissa into bf16's fields gives the value times 2^-120 (subnormals and
  // zero included); the bf16 multiply by 2^120 is exact.
  uint32_t v = ((pair_bytes >> 4) & 0x07FF07FFu) | (pair_bytes & 0x80008000u);
  __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
  const __nv_bfloat162 two120 = __floats2bfloat162_rn(1.329228e36f, 1.329228e36f);
  h = __hmul2(h, two120);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The A-fragment words of step s (logical k pairs 2t, 2t+1 and 2t+8, 2t+9) of a row.
template <bool FP8>
__device__ __forceinline__ void pairs(const Slice<FP8>& w, int s, uint32_t& lo, uint32_t& hi) {
  if constexpr (FP8) {
    const uint32_t words[4] = {w.word[0].x, w.word[0].y, w.word[0].z, w.word[0].w};
    lo = widen(__byte_perm(words[s], 0, 0x1404));
    hi = widen(__byte_perm(words[s], 0, 0x3424));
  } else {
    const uint4 q = w.word[s >> 1];
    lo = (s & 1) ? q.z : q.x;
    hi = (s & 1) ? q.w : q.y;
  }
}

template <int NT, bool FP8>
__device__ __forceinline__ void multiply_chunk(float (&acc)[NT][4], const Slice<FP8>& wg,
                                               const Slice<FP8>& wg8,
                                               const __nv_bfloat16* __restrict__ x,
                                               int x_stride, int rows, int g, int t,
                                               int k0) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = j * 8 + g;
    uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)row * x_stride + k0 + 16 * t);
      lo = __ldg(p);
      hi = __ldg(p + 1);
    }
    const uint32_t xb[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a0, a1, a2, a3;
      pairs<FP8>(wg, s, a0, a2);
      pairs<FP8>(wg8, s, a1, a3);
      mma(acc[j], a0, a1, a2, a3, xb[2 * s], xb[2 * s + 1]);
    }
  }
}

template <int NT, bool SILU, bool FP8>
__device__ __forceinline__ void gemm_body(
    const __nv_bfloat16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w,
    const float* __restrict__ scale, __nv_bfloat16* __restrict__ out, int out_stride, int rows,
    int K, int pdl) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16;
  const int chunks = K >> 6;
  const int per_warp = (chunks + WARPS - 1) / WARPS;
  const int first = warp * per_warp;
  const int last = min(chunks, first + per_warp);
  constexpr int BYTES = FP8 ? 1 : 2;  // a weight's
  constexpr int U = IN_FLIGHT<FP8>;
  const uint8_t* row_g = w + ((size_t)(n0 + g) * K + 16 * t) * BYTES;
  const uint8_t* row_g8 = row_g + (size_t)8 * K * BYTES;

  Slice<FP8> cur_g[U], cur_g8[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (first + u < last) {
      cur_g[u] = load_slice<FP8>(row_g + (first + u) * 64 * BYTES);
      cur_g8[u] = load_slice<FP8>(row_g8 + (first + u) * 64 * BYTES);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl) {  // weights are read above; x is written by the previous kernel
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
#endif
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int c = first; c < last; c += U) {
    Slice<FP8> next_g[U], next_g8[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + U + u < last) {
        next_g[u] = load_slice<FP8>(row_g + (c + U + u) * 64 * BYTES);
        next_g8[u] = load_slice<FP8>(row_g8 + (c + U + u) * 64 * BYTES);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + u < last)
        multiply_chunk<NT, FP8>(acc, cur_g[u], cur_g8[u], x, x_stride, rows, g, t, (c + u) * 64);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cur_g[u] = next_g[u];
      cur_g8[u] = next_g8[u];
    }
  }

  __shared__ float partial[WARPS][NT][4][32];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][j][i][lane] = acc[j][i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) sum += partial[v][j][i][lane];
        acc[j][i] = sum;
      }
    // acc[j][i]: output n0 + g (i < 2) or n0 + g + 8 (i >= 2), row j * 8 + 2 t + (i & 1)
    const float s_lo = FP8 ? scale[n0 + g] : 1.f, s_hi = FP8 ? scale[n0 + g + 8] : 1.f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = j * 8 + 2 * t + (i & 1);
        const int n = n0 + g + (i >= 2 ? 8 : 0);
        const float y = __bfloat162float(__float2bfloat16(acc[j][i] * (i >= 2 ? s_hi : s_lo)));
        if (SILU) {
          const float up = __shfl_xor_sync(0xffffffffu, y, 4);  // output n + 1 at lane + 4
          if ((g & 1) == 0 && row < rows) {
            const float act = __bfloat162float(__float2bfloat16(y / (1.f + __expf(-y))));
            out[(size_t)row * out_stride + n / 2] = __float2bfloat16(act * up);
          }
        } else if (row < rows) {
          out[(size_t)row * out_stride + n] = __float2bfloat16(y);
        }
      }
  }
}

// Sums over a warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* shared) {
  // The sum of v over the block's threads, in every thread (shared: WARPS floats).
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // shared may still be read from the previous sum
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += shared[w];
  return total;
}

__device__ __forceinline__ float rounded(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

constexpr int ROW_VECTORS = 8;  // 16-byte vectors a lane holds of a row: n <= 2048

// One row of the add-norms epilogue by one warp, each lane holding up to ROW_VECTORS
// 16-byte vectors of it in registers: every load of a pass in flight at once. Needs
// n % 8 == 0, n <= 32 * 8 * ROW_VECTORS and 16-byte aligned rows and norm weights.
template <bool NORM_BRANCH>
__device__ __forceinline__ void add_norms_row_by_warp(
    const __nv_bfloat16* y_row, const __nv_bfloat16* __restrict__ res_row,
    const __nv_bfloat16* __restrict__ w_branch, const __nv_bfloat16* __restrict__ w_next,
    __nv_bfloat16* x_row, __nv_bfloat16* normed_row, int n, float eps, int lane) {
  float v[ROW_VECTORS][8];
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < ROW_VECTORS; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c < n) {
      const uint4 q = __ldcg(reinterpret_cast<const uint4*>(y_row + c));
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&q);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[i][j] = __bfloat162float(h[j]);
        squares += v[i][j] * v[i][j];
      }
    }
  }
  const float rstd = NORM_BRANCH ? 1.f / sqrtf(warp_sum(squares) / n + eps) : 1.f;
  squares = 0.f;
#pragma unroll
  for (int i = 0; i < ROW_VECTORS; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c < n) {
      const uint4 r = __ldg(reinterpret_cast<const uint4*>(res_row + c));
      const __nv_bfloat16* res = reinterpret_cast<const __nv_bfloat16*>(&r);
      uint4 wq = make_uint4(0, 0, 0, 0);
      if (NORM_BRANCH) wq = __ldg(reinterpret_cast<const uint4*>(w_branch + c));
      const __nv_bfloat16* wb = reinterpret_cast<const __nv_bfloat16*>(&wq);
      uint4 out;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float branch = v[i][j];
        if (NORM_BRANCH) branch = rounded(__bfloat162float(wb[j]) * rounded(branch * rstd));
        v[i][j] = rounded(__bfloat162float(res[j]) + branch);
        o[j] = __float2bfloat16(v[i][j]);
        squares += v[i][j] * v[i][j];
      }
      *reinterpret_cast<uint4*>(x_row + c) = out;
    }
  }
  const float x_rstd = 1.f / sqrtf(warp_sum(squares) / n + eps);
#pragma unroll
  for (int i = 0; i < ROW_VECTORS; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c < n) {
      const uint4 wq = __ldg(reinterpret_cast<const uint4*>(w_next + c));
      const __nv_bfloat16* wn = reinterpret_cast<const __nv_bfloat16*>(&wq);
      uint4 out;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        o[j] = __float2bfloat16(__bfloat162float(wn[j]) * rounded(v[i][j] * x_rstd));
      *reinterpret_cast<uint4*>(normed_row + c) = out;
    }
  }
}

// The same for any n and alignment, the whole block on one row.
template <bool NORM_BRANCH>
__device__ __forceinline__ void add_norms_row_by_block(
    const __nv_bfloat16* y_row, const __nv_bfloat16* __restrict__ res_row,
    const __nv_bfloat16* __restrict__ w_branch, const __nv_bfloat16* __restrict__ w_next,
    __nv_bfloat16* x_row, __nv_bfloat16* normed_row, int n, float eps, float* sums) {
  float rstd = 1.f;
  if (NORM_BRANCH) {
    float squares = 0.f;
    for (int c = threadIdx.x; c < n; c += WARPS * 32) {
      const float y = __bfloat162float(__ldcg(y_row + c));
      squares += y * y;
    }
    rstd = 1.f / sqrtf(block_sum(squares, sums) / n + eps);
  }
  float squares = 0.f;
  for (int c = threadIdx.x; c < n; c += WARPS * 32) {
    float branch = __bfloat162float(__ldcg(y_row + c));
    if (NORM_BRANCH) branch = rounded(__bfloat162float(w_branch[c]) * rounded(branch * rstd));
    const float h = rounded(__bfloat162float(res_row[c]) + branch);
    x_row[c] = __float2bfloat16(h);
    squares += h * h;
  }
  const float x_rstd = 1.f / sqrtf(block_sum(squares, sums) / n + eps);
  for (int c = threadIdx.x; c < n; c += WARPS * 32) {
    const float h = __bfloat162float(x_row[c]);  // written by this thread above
    normed_row[c] = __float2bfloat16(__bfloat162float(w_next[c]) * rounded(h * x_rstd));
  }
}

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
