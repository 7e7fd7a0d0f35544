// Paged decode attention streamed at the memory's pace (kernels/paged_attention_cuda.py).
//
// A warp takes one decode row, one KV head with its group of query heads and one run of the
// row's keys (split-KV), alone: its own online softmax over the run's tiles of 16
// positions, whose K and V it copies into a ring of shared memory of its own with cp.async,
// STAGES tiles ahead, so it never waits on one load at a time, and its own output. A block
// is WARPS such warps on consecutive KV heads of a row; they share nothing: no barrier and
// no combine, so a warp moves on when its own tiles are done. Few rows split their keys
// into more runs to keep as many warps busy (paged_attention_cuda.decode_splits). K rows are
// padded by 16 bytes in shared memory, so the 8 lanes of a 16-byte load phase hit distinct
// banks. Scores, softmax and sums are float32 as in the Triton kernel
// (kernels/decode_attention.py): the two differ by summation order.
//
// Scores: lane = 16 h + j reads half h of position j's key and the halves meet by a shuffle.
// Values: lane owns VEC contiguous dimensions from lane * VEC, one shared load a position;
// p of position j comes from lane j.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace paged {

constexpr int WARPS = 4;
constexpr int TILE = 16;  // positions a warp attends at a time
constexpr int STAGES = 2;  // tiles a warp has in flight
constexpr unsigned FULL = 0xffffffffu;

struct Args {
  const __nv_bfloat16* q;  // [rows, heads, HEAD_DIM]
  const uint8_t* k_cache;  // [entries, kv_heads, HEAD_DIM]
  const uint8_t* v_cache;
  const float* k_scale;  // [kv_heads], read when scaled (a float8 cache holds K / k_scale)
  const float* v_scale;
  __nv_bfloat16* out;  // [rows, heads, HEAD_DIM]
  float* parts;  // [rows, heads, splits, HEAD_DIM + 2]: (acc, max, sum) when splits > 1
  const int64_t* positions;  // [rows]: row r attends positions 0..positions[r]
  const int64_t* table_rows;  // [rows]: its block-table row
  const int64_t* planes;  // [rows]: the plane it reads
  const int64_t* block_table;  // [table rows, block_table_stride]
  const int64_t* count;  // the decode rows, on the device (a bounded grid), or null
  int64_t block_table_stride;
  int64_t slots_per_plane;
  int rows;  // the decode rows where count is null
  int heads;
  int kv_heads;
  int block_size;
  int splits;
  int scaled;
  int pdl;  // launched as a programmatic dependent
  float scale;
};

enum Kind { BF16 = 0, E4M3 = 1, E5M2 = 2 };

template <int KIND>
struct Cache {
  static constexpr int BYTES = KIND == BF16 ? 2 : 1;  // an element's
  static constexpr int PER_WORD = 16 / BYTES;  // elements a 16-byte word holds
  // The pair of elements in the low 2 * BYTES bytes of `bits` as float32.
  __device__ __forceinline__ static float2 pair(uint32_t bits) {
    if constexpr (KIND == BF16) {  // bf16 is float32's top half: exact
      return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
    } else {
      constexpr __nv_fp8_interpretation_t FMT = KIND == E4M3 ? __NV_E4M3 : __NV_E5M2;
      const __half2_raw raw =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits), FMT);
      return __half22float2(*reinterpret_cast<const __half2*>(&raw));
    }
  }
  // The N elements packed in `words` as float32, a pair at a time.
  template <int N>
  __device__ __forceinline__ static void unpack(const uint32_t* words, float (&v)[N]) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const int at = 2 * BYTES * i;  // the pair's byte
      const float2 f = pair(words[at / 4] >> (8 * (at % 4)));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
  // A 16-byte word's elements as float32 (bf16 words stay one 16-byte load: a bf16x2 cast
  // split it).
  __device__ __forceinline__ static void widen(const uint4& w, float (&v)[PER_WORD]) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    unpack(words, v);
  }
  // N contiguous elements (2 or 4) at p, aligned to their N * BYTES, as float32: one load.
  template <int N>
  __device__ __forceinline__ static void load(const uint8_t* p, float (&v)[N]) {
    static_assert(N == 2 || N == 4, "whole pairs in at most 8 bytes");
    constexpr int SIZE = N * BYTES;
    uint32_t words[(SIZE + 3) / 4];
    if constexpr (SIZE == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(p);
      words[0] = w.x, words[1] = w.y;
    } else if constexpr (SIZE == 4) {
      words[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
      words[0] = *reinterpret_cast<const uint16_t*>(p);
    }
    unpack(words, v);
  }
};

// Shared memory of a block: each warp's ring of STAGES (K tile, V tile), then each warp's q
// in float32. Mirrored by `shared_bytes` in paged_attention_cuda.py.
template <int HEAD_DIM, int KIND, int GROUP>
struct Layout {
  static constexpr int ROW = HEAD_DIM * Cache<KIND>::BYTES;  // a key's or value's bytes
  static constexpr int PADDED = ROW + 16;
  static constexpr int TILE_BYTES = TILE * PADDED;
  static constexpr int RING = STAGES * 2 * TILE_BYTES;  // a warp's
  static constexpr int Q = WARPS * RING;  // the warps' q, GROUP * HEAD_DIM floats each
  static constexpr int STATE = HEAD_DIM + 2;  // (acc, max, sum) of a head in `parts`
};

__device__ __forceinline__ void copy16(uint32_t to, const uint8_t* from, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from),
               "r"(valid ? 16 : 0));
}

// The cache slot of this lane's position of the tile starting at `start` (lanes j and
// j + 16 hold position start + j), or -1 from `end` on.
__device__ __forceinline__ int tile_slot(const Args& a, int64_t start, int64_t end,
                                         int64_t table_row, int64_t plane, int lane) {
  const int64_t pos = start + (lane & (TILE - 1));
  if (pos >= end) return -1;
  const int64_t block = a.block_table[table_row * a.block_table_stride + pos / a.block_size];
  return static_cast<int>(plane * a.slots_per_plane + block * a.block_size + pos % a.block_size);
}

// Copy one tile's K and V rows (`slot` as tile_slot gives it; rows at -1 zero-filled) into
// ring slot `buffer`, as one commit group.
template <int HEAD_DIM, int KIND, int GROUP>
__device__ __forceinline__ void copy_tile(const Args& a, uint32_t buffer, int slot, int kv_head,
                                          int lane) {
  using L = Layout<HEAD_DIM, KIND, GROUP>;
  constexpr int WORDS = L::ROW / 16;  // 16-byte words a row
  static_assert((TILE * WORDS) % 32 == 0, "whole words for every lane");
#pragma unroll
  for (int t = 0; t < TILE * WORDS / 32; ++t) {
    const int i = lane + 32 * t;
    const int row = i / WORDS, word = i % WORDS;
    const int row_slot = __shfl_sync(FULL, slot, row);
    const int64_t entry = static_cast<int64_t>(row_slot < 0 ? 0 : row_slot) * a.kv_heads + kv_head;
    const int64_t offset = entry * L::ROW + word * 16;
    const uint32_t to = buffer + row * L::PADDED + word * 16;
    copy16(to, a.k_cache + offset, row_slot >= 0);
    copy16(to + L::TILE_BYTES, a.v_cache + offset, row_slot >= 0);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// One warp's running softmax over its tiles, for each head of the group.
template <int HEAD_DIM, int GROUP>
struct WarpState {
  // A lane's value dimensions, lane * VEC on: whole pairs that one load of at most 8 bytes
  // reads. 96 takes 4, so lanes 24..31 own none (their acc stays 0).
  static constexpr int VEC = HEAD_DIM <= 64 ? 2 : 4;
  static constexpr int OWNERS = HEAD_DIM / VEC;  // lanes that own dimensions
  static_assert(HEAD_DIM % VEC == 0 && OWNERS <= 32, "every dimension owned, once");
  float m[GROUP], l[GROUP], acc[GROUP][VEC];
  __device__ __forceinline__ static bool owner(int lane) { return OWNERS == 32 || lane < OWNERS; }
};

template <int HEAD_DIM, int KIND, int GROUP>
__device__ __forceinline__ void attend_tile(WarpState<HEAD_DIM, GROUP>& s, const uint8_t* k,
                                            const float* q, float scale, bool valid, int lane) {
  using C = Cache<KIND>;
  using L = Layout<HEAD_DIM, KIND, GROUP>;
  constexpr int VEC = WarpState<HEAD_DIM, GROUP>::VEC;
  constexpr int HALF_WORDS = L::ROW / 32;  // 16-byte words in half a key
  const int h = lane >> 4, j = lane & (TILE - 1);
  const uint8_t* key = k + j * L::PADDED + h * (L::ROW / 2);
  float score[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) score[g] = 0.f;
#pragma unroll
  for (int w = 0; w < HALF_WORDS; ++w) {
    float kv[C::PER_WORD];
    C::widen(*reinterpret_cast<const uint4*>(key + 16 * w), kv);
    const int d0 = h * (HEAD_DIM / 2) + w * C::PER_WORD;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float4* qg = reinterpret_cast<const float4*>(q + g * HEAD_DIM + d0);
#pragma unroll
      for (int e = 0; e < C::PER_WORD / 4; ++e) {
        const float4 qv = qg[e];
        score[g] += qv.x * kv[4 * e] + qv.y * kv[4 * e + 1] + qv.z * kv[4 * e + 2] +
                    qv.w * kv[4 * e + 3];
      }
    }
  }
  const uint8_t* values = k + L::TILE_BYTES;
  float p[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float sc = score[g] + __shfl_xor_sync(FULL, score[g], 16);
    sc = valid ? sc * scale : -INFINITY;
    float top = sc;
#pragma unroll
    for (int o = 8; o; o >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, o));
    const float m_new = fmaxf(s.m[g], top);  // finite: a tile's first position is valid
    p[g] = valid ? __expf(sc - m_new) : 0.f;
    float sum = p[g];
#pragma unroll
    for (int o = 8; o; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
    const float alpha = __expf(s.m[g] - m_new);
    s.l[g] = s.l[g] * alpha + sum;
    s.m[g] = m_new;
#pragma unroll
    for (int i = 0; i < VEC; ++i) s.acc[g][i] *= alpha;
  }
  // Rows start at multiples of PADDED, a multiple of 16 bytes: the lane's VEC are aligned.
  const uint8_t* mine = values + lane * VEC * C::BYTES;
  const bool owner = WarpState<HEAD_DIM, GROUP>::owner(lane);
#pragma unroll 4
  for (int jj = 0; jj < TILE; ++jj) {
    float v[VEC];
    if (owner) {
      C::load(mine + jj * L::PADDED, v);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float pj = __shfl_sync(FULL, p[g], jj);
#pragma unroll
      for (int i = 0; i < VEC; ++i) s.acc[g][i] += pj * v[i];
    }
  }
}

// The warp's state stored: the output (one split) or the run's state for the Triton combine
// kernel, which applies v_scale itself.
template <int HEAD_DIM, int KIND, int GROUP>
__device__ __forceinline__ void store(const Args& a, const WarpState<HEAD_DIM, GROUP>& s,
                                      int64_t row, int kv_head, int group, int split, int lane) {
  using L = Layout<HEAD_DIM, KIND, GROUP>;
  constexpr int VEC = WarpState<HEAD_DIM, GROUP>::VEC;
  const int d = lane * VEC;  // the lane's first dimension
  const bool owner = WarpState<HEAD_DIM, GROUP>::owner(lane);
  const float v_scale = a.scaled ? a.v_scale[kv_head] : 1.f;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (g >= group) break;  // padding heads of the tile
    const int64_t head = static_cast<int64_t>(kv_head) * group + g;
    if (a.splits == 1) {
      __nv_bfloat16* out = a.out + (row * a.heads + head) * HEAD_DIM;
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (owner) out[d + i] = __float2bfloat16(s.acc[g][i] / s.l[g] * v_scale);
    } else {  // an empty run stores (0, -inf, 0)
      float* part = a.parts + ((row * a.heads + head) * a.splits + split) * L::STATE;
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (owner) part[d + i] = s.acc[g][i];
      if (lane == 0) part[HEAD_DIM] = s.m[g], part[HEAD_DIM + 1] = s.l[g];
    }
  }
}

// The programmatic-dependent wait: Hopper and newer (launches elsewhere are never programmatic).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Element idx of a warp's query tile ([GROUP, HEAD_DIM], float32): zeros for the padding
// heads of the tile, which are not stored.
template <int HEAD_DIM, int GROUP>
__device__ __forceinline__ float query(const Args& a, int64_t row, int kv_head, int group,
                                       int idx) {
  const int g = idx / HEAD_DIM;
  if (g >= group) return 0.f;
  const int64_t head = static_cast<int64_t>(kv_head) * group + g;
  return __bfloat162float(a.q[(row * a.heads + head) * HEAD_DIM + idx % HEAD_DIM]);
}

// One warp's row, KV head and run. The row's fields and its first tiles' slots come before
// `wait` (the programmatic-dependent wait, on the first row a block takes): they are the
// pass's metadata, written before its first kernel, where the kernel just before (the RoPE
// write) writes this row's K, V and q. That holds while every programmatic kernel of a
// pass triggers its dependents only after its own wait (pdl_enter, PdlWait, pdl_wait): a
// kernel that starts early then overlaps only the one before it, and what is older has
// finished.
template <int HEAD_DIM, int KIND, int GROUP>
__device__ __forceinline__ void attend(const Args& a, uint8_t* shared, int64_t row, int kv_head,
                                       bool wait) {
  using L = Layout<HEAD_DIM, KIND, GROUP>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int split = blockIdx.z, group = a.heads / a.kv_heads;
  const int64_t pos = a.positions[row], table_row = a.table_rows[row], plane = a.planes[row];
  const int64_t tiles = (pos + TILE) / TILE;  // of positions 0..pos
  const int64_t run = (tiles + a.splits - 1) / a.splits;
  const int64_t first = split * run, last = first + run < tiles ? first + run : tiles;
  const int64_t end = pos + 1;
  const int64_t mine = last > first ? last - first : 0;  // tiles first..last-1
  int slots[STAGES];
#pragma unroll
  for (int t = 0; t < STAGES; ++t)
    slots[t] = t < mine ? tile_slot(a, (first + t) * TILE, end, table_row, plane, lane) : -1;
  if (wait) pdl_wait();
  // q's loads go out ahead of the tiles' copies, which would otherwise queue before them:
  // into registers where a lane holds at most 4 values (larger groups would spill).
  constexpr int Q_EACH = GROUP * HEAD_DIM / 32;  // a lane's
  constexpr int EARLY = Q_EACH <= 4 ? Q_EACH : 0;
  float q_mine[EARLY > 0 ? EARLY : 1];
#pragma unroll
  for (int i = 0; i < EARLY; ++i)
    q_mine[i] = query<HEAD_DIM, GROUP>(a, row, kv_head, group, lane + 32 * i);
  const uint32_t ring =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared)) + warp * L::RING;
#pragma unroll
  for (int t = 0; t < STAGES; ++t) {
    if (t < mine) {
      copy_tile<HEAD_DIM, KIND, GROUP>(a, ring + t * 2 * L::TILE_BYTES, slots[t], kv_head, lane);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  }
  float* q = reinterpret_cast<float*>(shared + L::Q) + warp * GROUP * HEAD_DIM;
  if constexpr (EARLY > 0) {
#pragma unroll
    for (int i = 0; i < EARLY; ++i) q[lane + 32 * i] = q_mine[i];
  } else {
    for (int idx = lane; idx < GROUP * HEAD_DIM; idx += 32)
      q[idx] = query<HEAD_DIM, GROUP>(a, row, kv_head, group, idx);
  }
  const float scale = a.scaled ? a.scale * a.k_scale[kv_head] : a.scale;
  WarpState<HEAD_DIM, GROUP> s;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    s.m[g] = -INFINITY, s.l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < WarpState<HEAD_DIM, GROUP>::VEC; ++i) s.acc[g][i] = 0.f;
  }
  __syncwarp();  // q is in shared memory
  for (int64_t t = 0; t < mine; ++t) {
    const uint32_t offset = static_cast<uint32_t>(t % STAGES) * 2 * L::TILE_BYTES;
    // The slot of the tile this one's buffer takes next, read before the wait for this one.
    const int64_t start = (first + t) * TILE;
    const int64_t next = start + STAGES * TILE;
    const int slot = t + STAGES < mine ? tile_slot(a, next, end, table_row, plane, lane) : -1;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1) : "memory");
    __syncwarp();
    const bool valid = start + (lane & (TILE - 1)) < end;
    attend_tile<HEAD_DIM, KIND, GROUP>(s, shared + warp * L::RING + offset, q, scale, valid,
                                       lane);
    __syncwarp();  // every lane is done with the slot before it is refilled
    if (t + STAGES < mine) {
      copy_tile<HEAD_DIM, KIND, GROUP>(a, ring + offset, slot, kv_head, lane);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncwarp();  // the ring and q are free for the warp's next row
  store<HEAD_DIM, KIND, GROUP>(a, s, row, kv_head, group, split, lane);
}

template <int HEAD_DIM, int KIND, int GROUP>
__device__ __forceinline__ void paged_decode(const Args& a) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int64_t rows = a.count ? a.count[0] : a.rows;  // metadata: see attend
  const int kv_head = blockIdx.y * WARPS + (threadIdx.x >> 5);
  // A warp without a row or head waits too, so that no kernel after this one runs before
  // the one before it has finished, even where the device counts no row.
  if (a.pdl && (blockIdx.x >= rows || kv_head >= a.kv_heads)) pdl_wait();
  if (kv_head >= a.kv_heads) return;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x)
    attend<HEAD_DIM, KIND, GROUP>(a, shared, row, kv_head, a.pdl && row == blockIdx.x);
}

}  // namespace paged

#define PAGED_DECODE(D, KIND, NAME, G)                                                 \
  extern "C" __global__ void __launch_bounds__(paged::WARPS * 32, 3)                   \
      paged_decode_d##D##_##NAME##_g##G(const paged::Args a) {                           \
    paged::paged_decode<D, paged::KIND, G>(a);                                          \
  }
#define PAGED_DECODE_GROUPS(D, KIND, NAME) \
  PAGED_DECODE(D, KIND, NAME, 1)           \
  PAGED_DECODE(D, KIND, NAME, 2)           \
  PAGED_DECODE(D, KIND, NAME, 4)           \
  PAGED_DECODE(D, KIND, NAME, 8)
#define PAGED_DECODE_KINDS(D)             \
  PAGED_DECODE_GROUPS(D, BF16, bf16)      \
  PAGED_DECODE_GROUPS(D, E4M3, e4m3)      \
  PAGED_DECODE_GROUPS(D, E5M2, e5m2)

PAGED_DECODE_KINDS(64)
PAGED_DECODE_KINDS(96)
PAGED_DECODE_KINDS(128)
