// One sandwich decoder layer of a decode pass for 1-16 rows in one launch: the qkv product,
// RoPE with the K/V write and paged attention, the o product with the residual add and
// norms, gate_up with SiLU-mul, and down with the residual add and the next layer's norm.
//
// Every block of a grid of about one block per SM walks the same five phases, taking every
// grid-th unit of work of each: 16-output tiles of a product (few_row_mma.cuh), or one (row,
// head) of attention. A block's weights stream from each of its tiles into the next, across
// the phases and the waits between them: a tile's last chunks start the next tile's first.
// A block with tiles of a product stages that product's x (a, attn, b or mlp) in shared
// memory once, after the product's wait (stage_x), so that its tiles' chunks read x there
// instead of waiting on the L2 for it at every chunk. A unit that needs earlier results
// waits on a counter in global memory instead of a grid-wide barrier, and only once its own
// first weights are in flight, so the weights stream while the layer's short serial parts
// (attention, the norms) run:
//   - attention of head h waits for the qkv tiles of its q head and of its K/V head;
//   - an o tile waits for every (row, head) of attention;
//   - the block that counts the last o tile adds the residual and takes the norms, then
//     raises a flag for gate_up; the last down tile's block does the same for the layer's
//     output, then zeroes the counters for the next launch that takes them.
// A block's phases run in order and every block is resident at once (the grid is at most
// what the GPU holds), so every wait is for work that runs. Values written in this launch
// are read past the L1 (which is not coherent between SMs).
//
// Attention of a (row, head): 32 groups of 8 lanes take every 32nd position of the row's
// plane, each lane 16 of the head's 128 dimensions, with an online softmax per group; the
// groups' states are combined in shared memory. Rounding as torch's reference rounds
// (ops/torch_ops.py): q and k rotated in float32 and rounded to bf16 after each product and
// sum (the Triton RoPE differs from it in the last bit of some elements), K and V stored
// bf16, scores and sums in float32. Only decode rows that read nothing another row of the pass
// writes (no speculation lanes), head size 128 and a bf16 K/V cache.
//
// Kernels: decode_layer_{w8a16,w16a16}_n{8,16} (float8 or bf16 weights; up to 8 or 16
// rows), each launched with WARPS warps a block and the arguments in one LayerArgs.
#include "few_row_mma.cuh"

namespace {

using namespace few_row;

constexpr int HEAD_DIM = 128;
constexpr int LANES_PER_POSITION = 8;  // a group: 16 dimensions a lane
constexpr int GROUPS = WARPS * 32 / LANES_PER_POSITION;
constexpr int TILES_PER_HEAD = HEAD_DIM / 16;

struct LayerArgs {
  const __nv_bfloat16* x;  // [rows, hidden] the residual stream
  const __nv_bfloat16* a;  // [rows, hidden] its pre-attention norm
  const uint8_t* w_qkv;    // [(heads + 2 kv_heads) * 128, hidden]: q, k, v rows
  const float* s_qkv;      // per-row float8 scales (unread for bf16 weights)
  const uint8_t* w_o;      // [hidden, hidden]
  const float* s_o;
  const uint8_t* w_gate_up;  // [2 inter, hidden], rows gate_0, up_0, gate_1, ...
  const float* s_gate_up;
  const uint8_t* w_down;  // [hidden, inter]
  const float* s_down;
  const __nv_bfloat16* attn_out_norm;  // [hidden] the branch norms (unread without them)
  const __nv_bfloat16* mlp_norm;
  const __nv_bfloat16* mlp_out_norm;
  const __nv_bfloat16* next_norm;
  const __nv_bfloat16* cos;  // [positions, 128]: the first 64 columns are read
  const __nv_bfloat16* sin;
  __nv_bfloat16* k_cache;  // [planes * slots_per_plane, kv_heads, 128]
  __nv_bfloat16* v_cache;
  const int64_t* positions;  // [rows] per row, as AttentionMetadata holds them
  const int64_t* row_tables;
  const int64_t* read_plane;
  const int64_t* write_lo;
  const int64_t* write_hi;
  const int64_t* row_entry;
  const int64_t* block_table;  // [table rows, block_table_stride]
  __nv_bfloat16* qkv;          // scratch [rows, (heads + 2 kv_heads) * 128]
  __nv_bfloat16* attn;         // scratch [rows, hidden]
  __nv_bfloat16* o;            // scratch [rows, hidden]
  __nv_bfloat16* x_mid;        // [rows, hidden] the stream after attention
  __nv_bfloat16* b;            // [rows, hidden] its pre-MLP norm
  __nv_bfloat16* mlp;          // scratch [rows, inter]
  __nv_bfloat16* down;         // scratch [rows, hidden]
  __nv_bfloat16* x_out;        // [rows, hidden] the layer's output stream
  __nv_bfloat16* a_out;        // [rows, hidden] its next norm
  unsigned int* counters;      // [heads + kv_heads + 5], zero at launch and left zero
  unsigned long long* trace;   // null, or [grid, 12]: each block's phase timeline (stamp)
  int rows, hidden, inter, heads, kv_heads;
  int slots_per_plane, block_size, block_table_stride;
  float eps, scale;
  int pdl;  // launched as a programmatic dependent
};

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// With p.trace set, thread 0 of each block writes %globaltimer (ns) at its start (k = 0),
// at the end of each of its five phases (k = 1..5) and at the steps inside them that
// decode_layer.py's STEPS names (k = 6..10; a norm step only in the block that runs it).
constexpr int TRACE_SLOTS = 12;
__device__ __forceinline__ void stamp(const LayerArgs& p, int k) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    p.trace[blockIdx.x * TRACE_SLOTS + k] = now;
  }
}

// Blocks until *counter reaches target (and, with a second counter, *second too).
struct CounterWait {
  const unsigned int* counter;
  unsigned int target;
  const unsigned int* second = nullptr;
  unsigned int second_target = 0;
  __device__ __forceinline__ void operator()() const {
    if (threadIdx.x == 0) {
      while (load_acquire(counter) < target) __nanosleep(32);
      if (second != nullptr)
        while (load_acquire(second) < second_target) __nanosleep(32);
    }
    __syncthreads();
  }
};

// Counts `units` finished units on `counter` once the block's stores are visible (the
// barrier orders them before thread 0's fence and count); true in the block whose count
// was the last of `total`, which then sees every block's stores.
__device__ __forceinline__ bool count_done(unsigned int* counter, unsigned int total,
                                           unsigned int units = 1) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool is_last = atomicAdd(counter, units) == total - units;
    if (is_last) __threadfence();
    last = is_last;
  }
  __syncthreads();
  return last;
}

// x_out = residual + norm(y) (or + y), normed = w_next * norm(x_out), for every row, by
// the block; residual and y were written in this launch.
template <bool BRANCH_NORMS>
__device__ __forceinline__ void add_norms_rows(const __nv_bfloat16* y,
                                               const __nv_bfloat16* residual,
                                               const __nv_bfloat16* w_branch,
                                               const __nv_bfloat16* w_next,
                                               __nv_bfloat16* x_out, __nv_bfloat16* normed,
                                               int rows, int n, float eps) {
  __shared__ float sums[WARPS];
  const bool vectorized = n % 8 == 0 && n <= 32 * 8 * ROW_VECTORS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int row = vectorized ? warp : 0; row < rows; row += vectorized ? WARPS : 1) {
    const size_t at = (size_t)row * n;
    if (vectorized)
      add_norms_row_by_warp<BRANCH_NORMS, true>(y + at, residual + at, w_branch, w_next,
                                                x_out + at, normed + at, n, eps, lane);
    else
      add_norms_row_by_block<BRANCH_NORMS, true>(y + at, residual + at, w_branch, w_next,
                                                 x_out + at, normed + at, n, eps, sums);
  }
}

__device__ __forceinline__ float bf16_round(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

// 16 bf16 values at p (32 bytes, 16-byte aligned) as floats, read past the L1.
__device__ __forceinline__ void load16(const __nv_bfloat16* p, float (&v)[16]) {
  const uint4 lo = __ldcg(reinterpret_cast<const uint4*>(p));
  const uint4 hi = __ldcg(reinterpret_cast<const uint4*>(p) + 1);
  const __nv_bfloat16* l = reinterpret_cast<const __nv_bfloat16*>(&lo);
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&hi);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = __bfloat162float(l[i]);
    v[i + 8] = __bfloat162float(h[i]);
  }
}

// RoPE of one (row, head) and its K/V write, then attention over the row's plane into
// attn[row, head * 128 ...]. The whole block takes part.
__device__ __forceinline__ void attend(const LayerArgs& p, int row, int head) {
  __shared__ float q_rot[HEAD_DIM];
  __shared__ float group_acc[GROUPS][HEAD_DIM];
  __shared__ float group_max[GROUPS], group_sum[GROUPS];
  const int group_size = p.heads / p.kv_heads, kv_head = head / group_size;
  const int width = (p.heads + 2 * p.kv_heads) * HEAD_DIM;
  const __nv_bfloat16* qkv_row = p.qkv + (size_t)row * width;
  const int64_t pos = p.positions[row];
  const int tid = threadIdx.x;
  constexpr int HALF = HEAD_DIM / 2;
  if (tid < HEAD_DIM) {  // threads 0-63 rotate q's pair d, threads 64-127 k's pair d
    const int d = tid % HALF;
    const bool is_k = tid >= HALF;
    const int source_head = is_k ? p.heads + kv_head : head;
    const __nv_bfloat16* src = qkv_row + source_head * HEAD_DIM;
    const float x1 = __bfloat162float(load_cg(src + d));
    const float x2 = __bfloat162float(load_cg(src + HALF + d));
    const float c = __bfloat162float(p.cos[pos * HEAD_DIM + d]);
    const float s = __bfloat162float(p.sin[pos * HEAD_DIM + d]);
    const float r1 = bf16_round(bf16_round(x1 * c) + bf16_round(-x2 * s));
    const float r2 = bf16_round(bf16_round(x2 * c) + bf16_round(x1 * s));
    if (!is_k) {
      q_rot[d] = r1;
      q_rot[HALF + d] = r2;
    } else {  // every head of a K/V group writes the same bytes
      const __nv_bfloat16* v_src = qkv_row + (p.heads + p.kv_heads + kv_head) * HEAD_DIM;
      const int64_t entry = p.row_entry[row];
      for (int64_t plane = p.write_lo[row]; plane < p.write_hi[row]; ++plane) {
        const size_t slot = (size_t)(plane * p.slots_per_plane + entry);
        const size_t dst = (slot * p.kv_heads + kv_head) * HEAD_DIM;
        p.k_cache[dst + d] = __float2bfloat16(r1);
        p.k_cache[dst + HALF + d] = __float2bfloat16(r2);
        p.v_cache[dst + d] = load_cg(v_src + d);
        p.v_cache[dst + HALF + d] = load_cg(v_src + HALF + d);
      }
    }
  }
  __syncthreads();  // q in shared memory; this row's own K/V written
  const int group = tid / LANES_PER_POSITION, sub = tid % LANES_PER_POSITION;
  float q[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) q[i] = q_rot[sub * 16 + i];
  const int64_t table_row = p.row_tables[row], plane = p.read_plane[row];
  const int64_t* table = p.block_table + table_row * p.block_table_stride;
  float m = -INFINITY, total = 0.f, acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  // every lane of a warp runs the same steps (the shuffles need them all); a group past
  // the row's last position takes no part in the sums
#pragma unroll 2
  for (int64_t base = 0; base <= pos; base += GROUPS) {
    const int64_t j = base + group;
    float k[16], v[16];
    if (j <= pos) {
      const int key = (int)j;  // positions stay below 2^31
      const int64_t slot = table[key / p.block_size] * p.block_size + key % p.block_size;
      const size_t at =
          ((size_t)(plane * p.slots_per_plane + slot) * p.kv_heads + kv_head) * HEAD_DIM + sub * 16;
      load16(p.k_cache + at, k);
      load16(p.v_cache + at, v);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) k[i] = v[i] = 0.f;
    }
    float score = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) score += k[i] * q[i];
#pragma unroll
    for (int mask = 1; mask < LANES_PER_POSITION; mask <<= 1)
      score += __shfl_xor_sync(0xffffffffu, score, mask);
    if (j <= pos) {
      score *= p.scale;
      const float m_new = fmaxf(m, score);
      const float alpha = __expf(m - m_new), weight = __expf(score - m_new);
      total = total * alpha + weight;
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] = acc[i] * alpha + weight * v[i];
      m = m_new;
    }
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) group_acc[group][sub * 16 + i] = acc[i];
  if (sub == 0) {
    group_max[group] = m;
    group_sum[group] = total;
  }
  __syncthreads();
  if (tid < HEAD_DIM) {
    float most = -INFINITY;
    for (int g = 0; g < GROUPS; ++g) most = fmaxf(most, group_max[g]);
    float sum = 0.f, out = 0.f;
    for (int g = 0; g < GROUPS; ++g) {
      const float w = group_max[g] == -INFINITY ? 0.f : __expf(group_max[g] - most);
      sum += group_sum[g] * w;
      out += group_acc[g][tid] * w;
    }
    p.attn[(size_t)row * p.heads * HEAD_DIM + head * HEAD_DIM + tid] = __float2bfloat16(out / sum);
  }
}

// x [rows, K] (rows K apart) into shared memory for all the block's tiles of a product, as
// StagedX reads it: its rows padded by one 16-byte word, rows from `rows` to NT * 8 zero.
// By the block, after the product's wait, with asynchronous copies (cp.async.cg, past the
// L1, zero-filling the rows past `rows`) that are all in flight at once; the first barrier
// lets the block's reads of the previous product's x end.
template <int NT>
__device__ __forceinline__ StagedX stage_x(uint4* xs, const __nv_bfloat16* x, int rows, int K) {
  const int words = K / 8, stride16 = words + 1;
  __syncthreads();
  for (int row = 0; row < NT * 8; ++row) {
    const bool real = row < rows;
    const uint4* from = reinterpret_cast<const uint4*>(x + (size_t)(real ? row : 0) * K);
    for (int word = threadIdx.x; word < words; word += blockDim.x) {
      const uint4* slot = xs + row * stride16 + word;
      const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(slot));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from + word),
                   "r"(real ? 16 : 0)
                   : "memory");
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  return StagedX{xs, stride16};
}

struct NoWait {
  __device__ __forceinline__ void operator()() const {}
};

// The block's tiles of the four products in the order it runs them (0 qkv, 1 o, 2 gate_up,
// 3 down: every grid-th tile of each), so that each tile can start the next one's weights.
struct BlockTiles {
  const LayerArgs& p;
  int width;
  __device__ __forceinline__ int count(int product) const {
    return (product == 0 ? width : product == 2 ? 2 * p.inter : p.hidden) / 16;
  }
  // The block's first tile at or after `tile` of `product`, or none.
  __device__ __forceinline__ NextTile at(int product, int tile) const {
    for (; product < 4; ++product, tile = blockIdx.x) {
      if (tile < count(product)) {
        const uint8_t* w = product == 0   ? p.w_qkv
                           : product == 1 ? p.w_o
                           : product == 2 ? p.w_gate_up
                                          : p.w_down;
        return NextTile{w, product == 3 ? p.inter : p.hidden, tile * 16};
      }
    }
    return NextTile{};
  }
};

template <int NT, bool FP8, bool BRANCH_NORMS>
__device__ __forceinline__ void decode_layer(const LayerArgs& p, uint4* xs) {
  const int width = (p.heads + 2 * p.kv_heads) * HEAD_DIM;
  unsigned int* q_done = p.counters;                       // [heads] qkv tiles of q head h
  unsigned int* kv_done = q_done + p.heads;                // [kv_heads] its k and v tiles
  unsigned int* attn_done = kv_done + p.kv_heads;          // (row, head) pairs attended
  unsigned int* o_done = attn_done + 1;                    // o tiles
  unsigned int* mid_ready = o_done + 1;                    // 1 once x_mid and b are written
  unsigned int* gate_up_done = mid_ready + 1;              // gate_up tiles
  unsigned int* down_done = gate_up_done + 1;              // down tiles
  const int grid = gridDim.x;
  stamp(p, 0);
  // The block's weights stream from tile to tile, across the phases and their waits: each
  // tile loads the first chunks of the block's next one into `pre` (gemm_tile_from).
  const BlockTiles tiles{p, width};
  Prefetched<FP8> pre;
  const NextTile start = tiles.at(0, blockIdx.x);
  if (start.w != nullptr) pre.load(WarpShare<FP8>(start.w, start.K, start.n0));

  // 1. qkv = a @ w_qkv.T; a was written by the previous kernel
  PdlWait{p.pdl}();  // only weights were read above
  if (blockIdx.x < width / 16) {
    const StagedX a = stage_x<NT>(xs, p.a, p.rows, p.hidden);
    for (int tile = blockIdx.x; tile < width / 16; tile += grid) {
      gemm_tile_from<NT, false, FP8>(pre, a, p.w_qkv, p.s_qkv, p.qkv, width, p.rows, p.hidden,
                                     tile * 16, NoWait{}, tiles.at(0, tile + grid));
      const int column = tile * 16 / HEAD_DIM;  // q heads, then k heads, then v heads
      unsigned int* done = column < p.heads ? q_done + column
                                            : kv_done + (column - p.heads) % p.kv_heads;
      count_done(done, column < p.heads ? TILES_PER_HEAD : 2 * TILES_PER_HEAD);
    }
  }

  stamp(p, 1);
  // 2. RoPE, the K/V write and attention, a (row, head) at a time
  const int pairs = p.rows * p.heads;
  for (int item = blockIdx.x; item < pairs; item += grid) {
    const int row = item / p.heads, head = item % p.heads;
    CounterWait{q_done + head, TILES_PER_HEAD, kv_done + head / (p.heads / p.kv_heads),
                2 * TILES_PER_HEAD}();
    attend(p, row, head);
    count_done(attn_done, pairs);
  }

  stamp(p, 2);
  // 3. o = attn @ w_o.T, then x_mid = x + norm(o), b = mlp_norm(x_mid) by the last tile's block
  if (blockIdx.x < p.hidden / 16) {
    CounterWait{attn_done, (unsigned)pairs}();
    const StagedX attn = stage_x<NT>(xs, p.attn, p.rows, p.hidden);
    for (int tile = blockIdx.x; tile < p.hidden / 16; tile += grid) {
      gemm_tile_from<NT, false, FP8>(pre, attn, p.w_o, p.s_o, p.o, p.hidden, p.rows, p.hidden,
                                     tile * 16, NoWait{}, tiles.at(1, tile + grid));
      if (count_done(o_done, p.hidden / 16)) {
        stamp(p, 6);  // o's last tile is in
        add_norms_rows<BRANCH_NORMS>(p.o, p.x, p.attn_out_norm, p.mlp_norm, p.x_mid, p.b,
                                     p.rows, p.hidden, p.eps);
        __syncthreads();
        stamp(p, 7);  // x_mid and b are written
        if (threadIdx.x == 0) {
          __threadfence();
          atomicExch(mid_ready, 1u);
        }
      }
    }
  }

  stamp(p, 3);
  // 4. mlp = SiLU(gate) * up of b @ w_gate_up.T, counted once a block (down waits for all)
  const int gate_up_tiles = 2 * p.inter / 16;
  if (blockIdx.x < gate_up_tiles) {
    CounterWait{mid_ready, 1u}();
    const StagedX b = stage_x<NT>(xs, p.b, p.rows, p.hidden);
    stamp(p, 8);  // b is staged
    unsigned int mine = 0;
    for (int tile = blockIdx.x; tile < gate_up_tiles; tile += grid, ++mine) {
      gemm_tile_from<NT, true, FP8>(pre, b, p.w_gate_up, p.s_gate_up, p.mlp, p.inter, p.rows,
                                    p.hidden, tile * 16, NoWait{}, tiles.at(2, tile + grid));
    }
    count_done(gate_up_done, gate_up_tiles, mine);
  }

  stamp(p, 4);
  // 5. down = mlp @ w_down.T, then x_out = x_mid + norm(down), a_out = next_norm(x_out)
  if (blockIdx.x < p.hidden / 16) {
    CounterWait{gate_up_done, (unsigned)gate_up_tiles}();
    const StagedX mlp = stage_x<NT>(xs, p.mlp, p.rows, p.inter);
    for (int tile = blockIdx.x; tile < p.hidden / 16; tile += grid) {
      gemm_tile_from<NT, false, FP8>(pre, mlp, p.w_down, p.s_down, p.down, p.hidden, p.rows,
                                     p.inter, tile * 16, NoWait{}, tiles.at(3, tile + grid));
      if (count_done(down_done, p.hidden / 16)) {
        stamp(p, 9);  // down's last tile is in
        add_norms_rows<BRANCH_NORMS>(p.down, p.x_mid, p.mlp_out_norm, p.next_norm, p.x_out,
                                     p.a_out, p.rows, p.hidden, p.eps);
        __syncthreads();  // every block is past its waits: the counters are free again
        stamp(p, 10);  // x_out and a_out are written
        for (int i = threadIdx.x; i < p.heads + p.kv_heads + 5; i += blockDim.x)
          p.counters[i] = 0u;
      }
    }
  }
  stamp(p, 5);
}

}  // namespace

#define DECODE_LAYER_KERNEL(NAME, NT, FP8, BRANCH_NORMS)                  \
  extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(const LayerArgs p) { \
    extern __shared__ uint4 staged_x[]; /* stage_x: as the launcher sizes it */ \
    decode_layer<NT, FP8, BRANCH_NORMS>(p, staged_x);                       \
  }

DECODE_LAYER_KERNEL(decode_layer_w8a16_n8, 1, true, true)
DECODE_LAYER_KERNEL(decode_layer_w8a16_n16, 2, true, true)
DECODE_LAYER_KERNEL(decode_layer_w16a16_n8, 1, false, true)
DECODE_LAYER_KERNEL(decode_layer_w16a16_n16, 2, false, true)
