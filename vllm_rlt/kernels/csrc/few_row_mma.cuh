// Device code shared by the few-row CUDA kernels (few_row_gemm.cu, decode_layer.cu): the
// swapped-role mma.sync product of a 16-output weight tile with 1-16 bf16 rows, float8
// weights widened in registers, and the residual add and norms of a sandwich layer by a
// warp or a block per row. See few_row_gemm.cu for the product's layout.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace few_row {


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

// x read from global memory at every chunk (COHERENT: past the L1, for x written earlier in
// this launch); rows past `rows` read as zeros.
template <bool COHERENT>
struct GlobalX {
  const __nv_bfloat16* x;
  int stride, rows;
  __device__ __forceinline__ void words(int row, int k, uint4& lo, uint4& hi) const {
    lo = hi = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)row * stride + k);
      lo = COHERENT ? __ldcg(p) : __ldg(p);
      hi = COHERENT ? __ldcg(p + 1) : __ldg(p + 1);
    }
  }
};

// x staged in shared memory by the block once for all its tiles of a product: rows of
// `stride16` 16-byte words (a row and one word of padding, so that the eight rows a load
// instruction reads fall in different banks), zeros past the pass's rows.
struct StagedX {
  const uint4* xs;
  int stride16;
  __device__ __forceinline__ void words(int row, int k, uint4& lo, uint4& hi) const {
    const uint4* p = xs + row * stride16 + k / 8;
    lo = p[0];
    hi = p[1];
  }
};

template <int NT, bool FP8, class X>
__device__ __forceinline__ void multiply_chunk(float (&acc)[NT][4], const Slice<FP8>& wg,
                                               const Slice<FP8>& wg8, const X& x, int g, int t,
                                               int k0) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    uint4 lo, hi;
    x.words(j * 8 + g, k0 + 16 * t, lo, hi);
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

// A warp's share of a 16-output tile: chunks first..last-1 of 64 k, and where its two
// weight rows (outputs n0 + g and n0 + g + 8) start for this thread.
template <bool FP8>
struct WarpShare {
  const uint8_t* row_g;
  const uint8_t* row_g8;
  int first, last;
  __device__ __forceinline__ WarpShare(const uint8_t* w, int K, int n0) {
    constexpr int BYTES = FP8 ? 1 : 2;  // a weight's
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunks = K >> 6, per_warp = (chunks + WARPS - 1) / WARPS;
    first = warp * per_warp;
    last = min(chunks, first + per_warp);
    row_g = w + ((size_t)(n0 + (lane >> 2)) * K + 16 * (lane & 3)) * BYTES;
    row_g8 = row_g + (size_t)8 * K * BYTES;
  }
};

// The first IN_FLIGHT chunks of a warp's share of a tile, in registers: loaded ahead of
// the tile (by the tile before it in the block, so that the block's weights stream across
// tiles and across the waits between phases).
template <bool FP8>
struct Prefetched {
  Slice<FP8> g[IN_FLIGHT<FP8>], g8[IN_FLIGHT<FP8>];

  __device__ __forceinline__ void load(const WarpShare<FP8>& share) {
    constexpr int BYTES = FP8 ? 1 : 2;
#pragma unroll
    for (int u = 0; u < IN_FLIGHT<FP8>; ++u) {
      if (share.first + u < share.last) {
        g[u] = load_slice<FP8>(share.row_g + (share.first + u) * 64 * BYTES);
        g8[u] = load_slice<FP8>(share.row_g8 + (share.first + u) * 64 * BYTES);
      }
    }
  }
};

// Where the tile after this one starts in the block's stream (w == nullptr: none).
struct NextTile {
  const uint8_t* w = nullptr;
  int K = 0, n0 = 0;
};

// Outputs n0..n0+15 of x @ w.T by the whole block, from `pre` holding the first chunks of
// each warp's share (Prefetched::load on this tile); `wait()` runs before x is read (x as
// GlobalX or StagedX gives it). Once the last chunks are in registers, `pre` is loaded with
// the first chunks of `next`, which stream while this tile sums and stores.
template <int NT, bool SILU, bool FP8, class X, class Wait>
__device__ __forceinline__ void gemm_tile_from(
    Prefetched<FP8>& pre, const X& x, const uint8_t* __restrict__ w,
    const float* __restrict__ scale, __nv_bfloat16* out, int out_stride, int rows, int K,
    int n0, Wait wait, NextTile next = NextTile{}) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int BYTES = FP8 ? 1 : 2;  // a weight's
  constexpr int U = IN_FLIGHT<FP8>;
  const WarpShare<FP8> share(w, K, n0);
  const int first = share.first, last = share.last;

  Slice<FP8> cur_g[U], cur_g8[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    cur_g[u] = pre.g[u];
    cur_g8[u] = pre.g8[u];
  }
  wait();  // weights are in flight; x may not be written yet
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int c = first; c < last; c += U) {
    Slice<FP8> next_g[U], next_g8[U];
    if (c + U < last) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c + U + u < last) {
          next_g[u] = load_slice<FP8>(share.row_g + (c + U + u) * 64 * BYTES);
          next_g8[u] = load_slice<FP8>(share.row_g8 + (c + U + u) * 64 * BYTES);
        }
      }
    } else if (next.w != nullptr) {  // the last chunks: the next tile's first ones stream
      pre.load(WarpShare<FP8>(next.w, next.K, next.n0));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + u < last)
        multiply_chunk<NT, FP8>(acc, cur_g[u], cur_g8[u], x, g, t, (c + u) * 64);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cur_g[u] = next_g[u];
      cur_g8[u] = next_g8[u];
    }
  }
  if (first >= last && next.w != nullptr) pre.load(WarpShare<FP8>(next.w, next.K, next.n0));

  __shared__ float partial[WARPS][NT][4][32];
  __syncthreads();  // warp 0 has read the block's previous tile's partial sums
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

// Outputs n0..n0+15 of x @ w.T by the whole block; `wait()` runs once the block's first
// weights are in flight and before x is read.
template <int NT, bool SILU, bool FP8, bool COHERENT, class Wait>
__device__ __forceinline__ void gemm_tile(
    const __nv_bfloat16* x, int x_stride, const uint8_t* __restrict__ w,
    const float* __restrict__ scale, __nv_bfloat16* out, int out_stride, int rows, int K,
    int n0, Wait wait) {
  Prefetched<FP8> pre;
  pre.load(WarpShare<FP8>(w, K, n0));
  gemm_tile_from<NT, SILU, FP8>(pre, GlobalX<COHERENT>{x, x_stride, rows}, w, scale, out,
                                out_stride, rows, K, n0, wait);
}

// Waits on the previous kernel (programmatic dependent launch) when `pdl` is set.
struct PdlWait {
  int pdl;
  __device__ __forceinline__ void operator()() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (pdl) {
      asm volatile("griddepcontrol.wait;" ::: "memory");
      asm volatile("griddepcontrol.launch_dependents;");
    }
#endif
  }
};

// A kernel's block computes the 16 outputs of its index.
template <int NT, bool SILU, bool FP8>
__device__ __forceinline__ void gemm_body(
    const __nv_bfloat16* __restrict__ x, int x_stride, const uint8_t* __restrict__ w,
    const float* __restrict__ scale, __nv_bfloat16* __restrict__ out, int out_stride, int rows,
    int K, int pdl) {
  gemm_tile<NT, SILU, FP8, false>(x, x_stride, w, scale, out, out_stride, rows, K,
                                  blockIdx.x * 16, PdlWait{pdl});
}

// One bf16 value read past the L1 by a volatile load (cuda_bf16.h's __ldcg for bf16 is not
// volatile, so the compiler could move it above the barrier after a wait).
__device__ __forceinline__ __nv_bfloat16 load_cg(const __nv_bfloat16* p) {
  return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(p)));
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
// COHERENT: the residual was written earlier in this kernel (read past the L1).
template <bool NORM_BRANCH, bool COHERENT = false>
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
      const uint4* rp = reinterpret_cast<const uint4*>(res_row + c);
      const uint4 r = COHERENT ? __ldcg(rp) : __ldg(rp);
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
template <bool NORM_BRANCH, bool COHERENT = false>
__device__ __forceinline__ void add_norms_row_by_block(
    const __nv_bfloat16* y_row, const __nv_bfloat16* __restrict__ res_row,
    const __nv_bfloat16* __restrict__ w_branch, const __nv_bfloat16* __restrict__ w_next,
    __nv_bfloat16* x_row, __nv_bfloat16* normed_row, int n, float eps, float* sums) {
  float rstd = 1.f;
  if (NORM_BRANCH) {
    float squares = 0.f;
    for (int c = threadIdx.x; c < n; c += WARPS * 32) {
      const float y = __bfloat162float(load_cg(y_row + c));
      squares += y * y;
    }
    rstd = 1.f / sqrtf(block_sum(squares, sums) / n + eps);
  }
  float squares = 0.f;
  for (int c = threadIdx.x; c < n; c += WARPS * 32) {
    float branch = __bfloat162float(load_cg(y_row + c));
    if (NORM_BRANCH) branch = rounded(__bfloat162float(w_branch[c]) * rounded(branch * rstd));
    const __nv_bfloat16 res = COHERENT ? load_cg(res_row + c) : res_row[c];
    const float h = rounded(__bfloat162float(res) + branch);
    x_row[c] = __float2bfloat16(h);
    squares += h * h;
  }
  const float x_rstd = 1.f / sqrtf(block_sum(squares, sums) / n + eps);
  for (int c = threadIdx.x; c < n; c += WARPS * 32) {
    const float h = __bfloat162float(x_row[c]);  // written by this thread above
    normed_row[c] = __float2bfloat16(__bfloat162float(w_next[c]) * rounded(h * x_rstd));
  }
}

}  // namespace few_row
