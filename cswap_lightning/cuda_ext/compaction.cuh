// The zvc and rle kernels: part of cswap_codec.cu's one translation unit.
//
// zvc and rle. A thread holds elements as 16-byte packs of E = 16 / elem_size elements, read
// with one 16-byte load where the tensor is 16-byte aligned (element by element otherwise).
// A block of B threads works on tiles of 2 * B packs (B * 32 bytes): pack j * B + t of a tile
// belongs to thread t, so each load instruction of a warp reads 512 contiguous bytes.
//
// A compaction keeps element order with a prefix over the tiles, computed in the pass that
// reads the data: the decoupled look-back of Merrill and Garland ("Single-pass Parallel
// Prefix Scan with Decoupled Look-back", 2016). Blocks claim tiles in order from a counter and
// keep claiming until none is left; a tile publishes its own summary (its aggregate), combines
// the summaries its predecessors published, back to one that has published its inclusive
// prefix, and publishes its own inclusive prefix. Within a tile a block-wide scan places each
// element, and the output goes through shared memory so that global stores (and the decoders'
// loads of values) are coalesced.
//
//   zvc encode: one pass (masks, values; the last tile writes preamble, padding and length).
//   rle encode: two passes, since the lengths and values sections start where the total
//               number of runs puts them: the first summarizes and scans the tiles (non-zeros,
//               runs, the last run start), the second writes starts, lengths and values.
//   zvc decode: one pass: a tile counts its mask bits, looks back, then expands its values.
//   rle decode: the runs become a bitmap of toggles (run start, run end); the zero mask is the
//               prefix XOR of the toggles, and decoding proceeds as for zvc, the tiles'
//               summaries carrying the run state as well as the non-zero count.
#pragma once

#include "codec_common.cuh"

namespace {

constexpr int kPacks = 2;                // 16-byte packs per thread per tile
constexpr uint32_t kTileBytesPerThread = 16 * kPacks;
constexpr uint64_t kWorkspaceHeader = 64;  // the tile counter
constexpr int kMaxSummaryWords = 3;
// The smallest tile: a block of 32 threads on 8-byte elements. It bounds the tile count.
constexpr uint64_t kMinTileElems = 32 * kTileBytesPerThread / 8;

// What every zvc and rle kernel is given. Pointers into the workspace: the tile counter, the
// tiles' published states, and (rle decode) the toggle bitmap, one bit per element.
struct CodecArgs {
  uint64_t numel;
  uint32_t ntiles;
  uint8_t *payload;         // encode: written; decode: read (as const)
  uint64_t payload_nbytes;  // decode: the payload's size
  int64_t *nbytes_out;      // encode: where the payload's size goes (may be null)
  uint32_t *counter;
  uint64_t *states;
  uint32_t *toggles;
};

// 16 bytes of elements, kept as four words so that narrow elements share registers; element
// e is bytes [e * sizeof(T), (e + 1) * sizeof(T)) (little-endian, as in memory).
template <typename T>
struct Pack {
  static constexpr int E = 16 / sizeof(T);
  uint32_t w[4];

  __device__ T get(int e) const {
    if constexpr (sizeof(T) == 8)
      return T{w[2 * e]} | T{w[2 * e + 1]} << 32;
    else
      return static_cast<T>(w[e * sizeof(T) / 4] >> (8 * (e * sizeof(T) % 4)));
  }
  // Sets element e of a pack whose element e is still zero.
  __device__ void put(int e, T x) {
    if constexpr (sizeof(T) == 8) {
      w[2 * e] = static_cast<uint32_t>(x);
      w[2 * e + 1] = static_cast<uint32_t>(x >> 32);
    } else {
      w[e * sizeof(T) / 4] |= uint32_t{x} << (8 * (e * sizeof(T) % 4));
    }
  }
};

// Where tile `tile` starts, and where pack j of this thread starts in a tile starting at
// `tile_first` (elements).
template <int E>
__device__ inline uint64_t tile_start(uint32_t tile) {
  return uint64_t{tile} * blockDim.x * kPacks * E;
}
template <int E>
__device__ inline uint64_t pack_start(uint64_t tile_first, int j) {
  return tile_first + (static_cast<uint64_t>(j) * blockDim.x + threadIdx.x) * E;
}

// Bits of the pack starting at element `first` that hold elements.
template <int E>
__device__ inline uint32_t valid_bits(uint64_t first, uint64_t numel) {
  if (first >= numel) return 0;
  return numel - first >= E ? (1u << E) - 1 : (1u << (numel - first)) - 1;
}

template <typename T, bool kAligned>
__device__ inline Pack<T> load_pack(const T *in, uint64_t first, uint64_t numel) {
  Pack<T> p = {};
  if (kAligned && first + Pack<T>::E <= numel) {
    const uint4 raw = *reinterpret_cast<const uint4 *>(in + first);
    p.w[0] = raw.x, p.w[1] = raw.y, p.w[2] = raw.z, p.w[3] = raw.w;
    return p;
  }
#pragma unroll
  for (int e = 0; e < Pack<T>::E; ++e)
    if (first + e < numel) p.put(e, in[first + e]);
  return p;
}

template <typename T, bool kAligned>
__device__ inline void store_pack(T *out, uint64_t first, uint64_t numel, const Pack<T> &p) {
  if (kAligned && first + Pack<T>::E <= numel) {
    *reinterpret_cast<uint4 *>(out + first) = make_uint4(p.w[0], p.w[1], p.w[2], p.w[3]);
    return;
  }
#pragma unroll
  for (int e = 0; e < Pack<T>::E; ++e)
    if (first + e < numel) out[first + e] = p.get(e);
}

template <typename T>
__device__ inline uint32_t nonzero_bits(const Pack<T> &p, uint32_t valid) {
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < Pack<T>::E; ++e) bits |= static_cast<uint32_t>(p.get(e) != T{0}) << e;
  return bits & valid;
}

__device__ inline uint32_t lanemask_lt(int lane) { return (1u << lane) - 1; }
__device__ inline uint32_t lanemask_le(int lane) { return lane == 31 ? kFull : (2u << lane) - 1; }

// Bit i of the result is the XOR of bits 0..i of x.
__device__ inline uint32_t prefix_xor(uint32_t x) {
  x ^= x << 1;
  x ^= x << 2;
  x ^= x << 4;
  x ^= x << 8;
  x ^= x << 16;
  return x;
}

struct Add {
  template <typename V>
  __device__ V operator()(V a, V b) const {
    return a + b;
  }
};

// Sum of the low 32 bits, max of the high 32 bits.
struct AddLowMaxHigh {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const {
    const uint64_t low = static_cast<uint32_t>(a) + static_cast<uint32_t>(b);
    return max(a >> 32, b >> 32) << 32 | static_cast<uint32_t>(low);
  }
};

// Max of each 32-bit half.
struct MaxHalves {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const {
    return max(a >> 32, b >> 32) << 32 | max(a & kFull, b & kFull);
  }
};

// Exclusive scan over the block's threads with the associative `op` (identity 0); `*total`
// gets the reduction of all. All threads must call it; `sums` is shared memory of 32 values,
// free again when it returns.
template <typename V, typename Op>
__device__ V block_exclusive_scan(V v, Op op, V *sums, V *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  V x = v;
  for (int d = 1; d < 32; d <<= 1) {
    const V y = __shfl_up_sync(kFull, x, d);
    if (lane >= d) x = op(y, x);
  }
  if (lane == 31) sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    V s = lane < nwarps ? sums[lane] : V{0};
    for (int d = 1; d < 32; d <<= 1) {
      const V y = __shfl_up_sync(kFull, s, d);
      if (lane >= d) s = op(y, s);
    }
    sums[lane] = s;
  }
  __syncthreads();
  const V before_lane = __shfl_up_sync(kFull, x, 1);
  V exclusive = lane > 0 ? before_lane : V{0};
  if (warp > 0) exclusive = op(sums[warp - 1], exclusive);
  *total = sums[nwarps - 1];
  __syncthreads();
  return exclusive;
}

// Tile-relative positions, in element order, of the items marked by bits[k][j] (kind k of
// item, pack j): pos[k][j] is where pack j's first item of kind k goes; totals[k] is the
// tile's count. Up to two kinds, scanned at once in 16-bit fields, one per kind and pack row:
// a row holds at most 1024 threads x 16 elements, so no field overflows.
template <int K>
__device__ void tile_positions(const uint32_t (&bits)[K][kPacks], uint32_t (&pos)[K][kPacks],
                               uint32_t (&totals)[K], uint64_t *sums) {
  static_assert(K * kPacks <= 4, "four 16-bit fields");
  uint64_t counts = 0;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < kPacks; ++j)
      counts |= static_cast<uint64_t>(__popc(bits[k][j])) << 16 * (k * kPacks + j);
  uint64_t total;
  const uint64_t before = block_exclusive_scan(counts, Add{}, sums, &total);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    uint32_t earlier_packs = 0;  // items of this kind in the tile's earlier pack rows
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int field = 16 * (k * kPacks + j);
      pos[k][j] = earlier_packs + (before >> field & 0xffff);
      earlier_packs += total >> field & 0xffff;
    }
    totals[k] = earlier_packs;
  }
}

// Puts value(j, e) at stage[at(j, e) - first] for every set bit e of bits[j] whose position
// falls in [first, first + cap): the staging half of staged_store.
template <int E, typename V, typename At, typename Value>
__device__ inline void stage_items(const uint32_t (&bits)[kPacks], uint32_t first, V *stage,
                                   uint32_t cap, At at, Value value) {
#pragma unroll
  for (int j = 0; j < kPacks; ++j)
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (bits[j] >> e & 1) {
        const uint32_t q = at(j, e) - first;
        if (q < cap) stage[q] = value(j, e);
      }
}

// dst[i] = stage[i] for i < n, by the whole block: coalesced.
template <typename V>
__device__ inline void copy_out(const V *stage, uint32_t n, V *dst) {
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = stage[i];
}

// Writes value(j, e) to dst[at(j, e)] for every set bit e of bits[j]; the tile's `count`
// positions 0..count-1 are each written once. The values gather in the shared `stage` (room
// for `cap` values), from which the block stores them in order, so that the global stores are
// coalesced; in rounds of `cap` positions when the count exceeds it. All threads must call it.
template <int E, typename V, typename At, typename Value>
__device__ void staged_store(const uint32_t (&bits)[kPacks], uint32_t count, V *stage,
                             uint32_t cap, V *dst, At at, Value value) {
  for (uint32_t first = 0; first < count; first += cap) {
    stage_items<E>(bits, first, stage, cap, at, value);
    __syncthreads();
    copy_out(stage, min(cap, count - first), dst + first);
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Tile summaries and the decoupled look-back.
//
// A summary is N u32 values with an associative combine(earlier, later) whose identity is all
// zeros. A tile's state is N 64-bit words, each a status (high half) and one value (low half),
// written and read whole: a reader takes the values only when all N statuses agree, so it
// needs no fence between the words.

enum : uint32_t { kInvalid = 0, kAggregate = 1, kPrefix = 2 };

// zvc: the non-zero count.
struct NonzeroCount {
  static constexpr int N = 1;
  uint32_t v[N];
  __device__ static NonzeroCount combine(const NonzeroCount &a, const NonzeroCount &b) {
    return {{a.v[0] + b.v[0]}};
  }
};

// rle encode: non-zeros, runs, and the index + 1 of the last run's first element (0: none).
struct RunCount {
  enum { kNnz, kRuns, kLastStart };
  static constexpr int N = 3;
  uint32_t v[N];
  __device__ static RunCount combine(const RunCount &a, const RunCount &b) {
    return {{a.v[kNnz] + b.v[kNnz], a.v[kRuns] + b.v[kRuns],
             max(a.v[kLastStart], b.v[kLastStart])}};
  }
};

// rle decode: a tile seen as a function of the run state it is entered in: the parity of its
// toggles, and its non-zero count when entered outside a run and inside one.
struct RunState {
  enum { kParity, kNnzOutside, kNnzInside };
  static constexpr int N = 3;
  uint32_t v[N];
  __device__ static RunState combine(const RunState &a, const RunState &b) {
    const uint32_t outside = b.v[kNnzOutside], inside = b.v[kNnzInside];
    const bool flip = a.v[kParity];  // b is entered in the other state than a
    return {{a.v[kParity] ^ b.v[kParity], a.v[kNnzOutside] + (flip ? inside : outside),
             a.v[kNnzInside] + (flip ? outside : inside)}};
  }
};

using DeviceU64 = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>;
using DeviceU32 = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>;

template <typename S>
struct TileStates {
  uint64_t *words;  // S::N per tile

  __device__ void publish(uint32_t tile, uint32_t status, const S &s) const {
#pragma unroll
    for (int i = 0; i < S::N; ++i)
      DeviceU64(words[uint64_t{tile} * S::N + i])
          .store(uint64_t{status} << 32 | s.v[i], cuda::memory_order_relaxed);
  }

  // The status of the tile (kInvalid while its words disagree), its summary in *s.
  __device__ uint32_t read(uint32_t tile, S *s) const {
    uint32_t status = kInvalid;
#pragma unroll
    for (int i = 0; i < S::N; ++i) {
      const uint64_t w =
          DeviceU64(words[uint64_t{tile} * S::N + i]).load(cuda::memory_order_relaxed);
      const uint32_t word_status = static_cast<uint32_t>(w >> 32);
      s->v[i] = static_cast<uint32_t>(w);
      status = i == 0 || word_status == status ? word_status : kInvalid;
    }
    return status;
  }
};

template <typename S>
__device__ inline S shfl_down(S s, int d) {
#pragma unroll
  for (int i = 0; i < S::N; ++i) s.v[i] = __shfl_down_sync(kFull, s.v[i], d);
  return s;
}

template <typename S>
__device__ inline S shfl_from(S s, int lane) {
#pragma unroll
  for (int i = 0; i < S::N; ++i) s.v[i] = __shfl_sync(kFull, s.v[i], lane);
  return s;
}

// The combined summary of tiles 0 .. tile - 1 (tile > 0), from their published states; called
// by one whole warp. Lane i reads tile - 1 - i; the warp waits until none of its 32 tiles is
// invalid, combines them back to the nearest inclusive prefix among them, and moves 32 tiles
// further back if there is none.
template <typename S>
__device__ S look_back(const TileStates<S> &states, uint32_t tile) {
  const int lane = threadIdx.x & 31;
  S exclusive = {};
  for (int64_t nearest = int64_t{tile} - 1;; nearest -= 32) {
    const int64_t pred = nearest - lane;
    S s = {};
    uint32_t status = kPrefix;  // before tile 0: the empty prefix
    if (pred >= 0)
      while ((status = states.read(static_cast<uint32_t>(pred), &s)) == kInvalid) __nanosleep(64);
    const uint32_t prefixes = __ballot_sync(kFull, status == kPrefix);
    if (prefixes && lane > __ffs(prefixes) - 1) s = S{};
    // Lane 0 ends up with the summaries of all lanes, later tiles (lower lanes) last.
    for (int d = 1; d < 32; d <<= 1) {
      const S earlier = shfl_down(s, d);
      if (lane + d < 32) s = S::combine(earlier, s);
    }
    exclusive = S::combine(shfl_from(s, 0), exclusive);
    if (prefixes) return exclusive;
  }
}

// Publishes the tile's aggregate and finds its exclusive prefix, then publishes its inclusive
// prefix; returns the exclusive one. Called by warp 0 of the block.
template <typename S>
__device__ S scan_tile(const TileStates<S> &states, uint32_t tile, const S &aggregate) {
  S exclusive = {};
  if (tile > 0) {
    if (threadIdx.x == 0) states.publish(tile, kAggregate, aggregate);
    exclusive = look_back(states, tile);
  }
  if (threadIdx.x == 0) states.publish(tile, kPrefix, S::combine(exclusive, aggregate));
  return exclusive;
}

// The next tile for this block, in claim order: a look-back waits only on tiles already
// claimed by running blocks, so it never waits on a block that has not started.
__device__ inline uint32_t claim_tile(uint32_t *counter) {
  return DeviceU32(*counter).fetch_add(1, cuda::memory_order_relaxed);
}

// Number of runs a decoder may trust: all of them fit in the payload, or none.
__device__ inline uint64_t rle_nruns(const uint8_t *payload, uint64_t payload_nbytes) {
  if (payload_nbytes < 16) return 0;
  uint64_t nruns = *reinterpret_cast<const uint64_t *>(payload);
  if (nruns > (payload_nbytes - 16) / 8) return 0;
  return 16 + 2 * align16(4 * nruns) <= payload_nbytes ? nruns : 0;
}

// Zero bytes [begin, end) of the payload (section padding).
__device__ inline void zero_bytes(uint8_t *payload, uint64_t begin, uint64_t end) {
  for (uint64_t i = begin; i < end; ++i) payload[i] = 0;
}

// ---------------------------------------------------------------------------------------------
// zvc encode: one pass.

template <typename T, bool kAligned>
__global__ void __launch_bounds__(1024) zvc_encode(const T *in, CodecArgs a) {
  constexpr int E = Pack<T>::E, kLanesPerWord = 32 / E;
  extern __shared__ uint4 stage_words[];
  __shared__ uint64_t sums[32];
  __shared__ uint32_t next_tile;
  __shared__ uint32_t values_before;
  T *stage = reinterpret_cast<T *>(stage_words);
  const uint32_t t = threadIdx.x, B = blockDim.x;
  const uint64_t nwords = cdiv(a.numel, 32), values_at = align16(16 + 4 * nwords);
  uint32_t *mask = reinterpret_cast<uint32_t *>(a.payload + 16);
  T *values = reinterpret_cast<T *>(a.payload + values_at);
  const TileStates<NonzeroCount> states{a.states};
  if (t == 0) next_tile = claim_tile(a.counter);
  __syncthreads();
  for (uint32_t tile = next_tile; tile < a.ntiles; tile = next_tile) {
    const uint32_t claimed = t == 0 ? claim_tile(a.counter) : 0;
    const uint64_t tile_first = tile_start<E>(tile);
    Pack<T> pack[kPacks];
    uint32_t nonzero[1][kPacks], pos[1][kPacks], count[1];
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const uint64_t first = pack_start<E>(tile_first, j);
      pack[j] = load_pack<T, kAligned>(in, first, a.numel);
      nonzero[0][j] = nonzero_bits(pack[j], valid_bits<E>(first, a.numel));
      // The lanes holding one mask word OR their bits together; the first writes it.
      uint32_t word = nonzero[0][j] << (t * E % 32);
      for (int d = 1; d < kLanesPerWord; d <<= 1) word |= __shfl_xor_sync(kFull, word, d);
      if (t % kLanesPerWord == 0 && first < a.numel) mask[first / 32] = word;
    }
    tile_positions(nonzero, pos, count, sums);
    // The values go to the stage (a tile has room for all) while warp 0 looks back.
    stage_items<E>(
        nonzero[0], 0, stage, B * kTileBytesPerThread / sizeof(T),
        [&](int j, int e) { return pos[0][j] + __popc(nonzero[0][j] & lanemask_lt(e)); },
        [&](int j, int e) { return pack[j].get(e); });
    if (t < 32) {
      const NonzeroCount before = scan_tile(states, tile, NonzeroCount{{count[0]}});
      if (t == 0) {
        values_before = before.v[0];
        next_tile = claimed;
        if (tile == a.ntiles - 1) {
          const uint64_t nnz = uint64_t{before.v[0]} + count[0];
          auto *preamble = reinterpret_cast<uint64_t *>(a.payload);
          preamble[0] = nnz;
          preamble[1] = 0;
          zero_bytes(a.payload, 16 + 4 * nwords, values_at);
          if (a.nbytes_out) *a.nbytes_out = static_cast<int64_t>(values_at + nnz * sizeof(T));
        }
      }
    }
    __syncthreads();
    copy_out(stage, count[0], values + values_before);
  }
}

// ---------------------------------------------------------------------------------------------
// rle encode: two passes.

// Run starts and run ends (the last zero of each run) among a pack's `zero` bits (element
// first + e in bit e). Called by a whole warp on consecutive packs: a lane learns about its
// neighbouring elements from the lanes beside it, lanes 0 and 31 from memory.
template <typename T>
__device__ inline uint32_t run_starts(const T *in, uint64_t first, uint64_t numel, uint32_t zero) {
  constexpr int E = Pack<T>::E;
  uint32_t zero_before = __shfl_up_sync(kFull, zero >> (E - 1) & 1, 1);
  if (threadIdx.x % 32 == 0) zero_before = first > 0 && first <= numel && in[first - 1] == T{0};
  return zero & ~(zero << 1 | zero_before);
}

template <typename T>
__device__ inline uint32_t run_ends(const T *in, uint64_t first, uint64_t numel, uint32_t zero) {
  constexpr int E = Pack<T>::E;
  uint32_t zero_after = __shfl_down_sync(kFull, zero & 1, 1);
  if (threadIdx.x % 32 == 31) zero_after = first + E < numel && in[first + E] == T{0};
  return zero & ~(zero >> 1 | zero_after << (E - 1));
}

// The index + 1 of the last run start in the pack at `first` (0: none).
__device__ inline uint32_t last_start(uint64_t first, uint32_t starts) {
  return starts ? static_cast<uint32_t>(first) + 32 - __clz(starts) : 0;
}

// Pass 1: each tile's non-zeros, runs and last run start, scanned over the tiles. The last
// tile writes the preamble, the padding of the starts and lengths sections, and the length.
template <typename T, bool kAligned>
__global__ void __launch_bounds__(1024) rle_encode_scan(const T *in, CodecArgs a) {
  constexpr int E = Pack<T>::E;
  __shared__ uint64_t sums[32];
  __shared__ uint32_t next_tile;
  const uint32_t t = threadIdx.x;
  const TileStates<RunCount> states{a.states};
  if (t == 0) next_tile = claim_tile(a.counter);
  __syncthreads();
  for (uint32_t tile = next_tile; tile < a.ntiles; tile = next_tile) {
    const uint32_t claimed = t == 0 ? claim_tile(a.counter) : 0;
    const uint64_t tile_first = tile_start<E>(tile);
    uint64_t mine = 0;  // low half: non-zeros | runs << 16; high half: last start + 1
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const uint64_t first = pack_start<E>(tile_first, j);
      const Pack<T> pack = load_pack<T, kAligned>(in, first, a.numel);
      const uint32_t valid = valid_bits<E>(first, a.numel);
      const uint32_t nonzero = nonzero_bits(pack, valid);
      const uint32_t starts = run_starts(in, first, a.numel, valid & ~nonzero);
      mine = AddLowMaxHigh{}(mine, uint64_t{last_start(first, starts)} << 32 |
                                       (__popc(nonzero) | __popc(starts) << 16));
    }
    uint64_t total;
    block_exclusive_scan(mine, AddLowMaxHigh{}, sums, &total);
    const RunCount aggregate{{static_cast<uint32_t>(total & 0xffff),
                              static_cast<uint32_t>(total >> 16 & 0xffff),
                              static_cast<uint32_t>(total >> 32)}};
    if (t < 32) {
      const RunCount before = scan_tile(states, tile, aggregate);
      if (t == 0) {
        next_tile = claimed;
        if (tile == a.ntiles - 1) {
          const RunCount all = RunCount::combine(before, aggregate);
          const uint64_t nruns = all.v[RunCount::kRuns], nnz = all.v[RunCount::kNnz];
          const uint64_t lengths_at = 16 + align16(4 * nruns);
          const uint64_t values_at = lengths_at + align16(4 * nruns);
          auto *preamble = reinterpret_cast<uint64_t *>(a.payload);
          preamble[0] = nruns;
          preamble[1] = nnz;
          zero_bytes(a.payload, 16 + 4 * nruns, lengths_at);
          zero_bytes(a.payload, lengths_at + 4 * nruns, values_at);
          if (a.nbytes_out) *a.nbytes_out = static_cast<int64_t>(values_at + nnz * sizeof(T));
        }
      }
    }
    __syncthreads();
  }
}

// Pass 2: each tile writes its run starts, the lengths of the runs that end in it, and its
// non-zero values, where pass 1's prefixes put them.
template <typename T, bool kAligned>
__global__ void __launch_bounds__(1024) rle_encode_scatter(const T *in, CodecArgs a) {
  constexpr int E = Pack<T>::E;
  extern __shared__ uint4 stage_words[];
  __shared__ uint64_t sums[32];
  __shared__ uint32_t open_at_entry;
  __shared__ uint32_t open_at_exit;
  const uint32_t t = threadIdx.x, B = blockDim.x;
  const uint32_t stage_bytes = B * kTileBytesPerThread;
  const TileStates<RunCount> states{a.states};
  RunCount all;
  states.read(a.ntiles - 1, &all);
  const uint64_t nruns = all.v[RunCount::kRuns], lengths_at = 16 + align16(4 * nruns);
  uint32_t *starts_out = reinterpret_cast<uint32_t *>(a.payload + 16);
  uint32_t *lengths_out = reinterpret_cast<uint32_t *>(a.payload + lengths_at);
  T *values = reinterpret_cast<T *>(a.payload + lengths_at + align16(4 * nruns));
  for (uint32_t tile = blockIdx.x; tile < a.ntiles; tile += gridDim.x) {
    RunCount before = {};
    if (tile > 0) states.read(tile - 1, &before);
    const uint64_t tile_first = tile_start<E>(tile);
    Pack<T> pack[kPacks];
    uint32_t first[kPacks], bits[2][kPacks], ends[kPacks], pos[2][kPacks], count[2];
    uint64_t last_starts = 0;  // per pack, in 32-bit halves
    enum { kNonzero, kStart };
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const uint64_t at = pack_start<E>(tile_first, j);
      first[j] = static_cast<uint32_t>(at);  // only used where at < numel < 2**32
      pack[j] = load_pack<T, kAligned>(in, at, a.numel);
      const uint32_t valid = valid_bits<E>(at, a.numel);
      bits[kNonzero][j] = nonzero_bits(pack[j], valid);
      const uint32_t zero = valid & ~bits[kNonzero][j];
      bits[kStart][j] = run_starts(in, at, a.numel, zero);
      ends[j] = run_ends(in, at, a.numel, zero);
      last_starts |= uint64_t{last_start(at, bits[kStart][j])} << 32 * j;
      // A run crossing into the tile ends here but started before; one crossing out does not.
      if (t == 0 && j == 0) open_at_entry = zero & ~bits[kStart][j] & 1;
      if (t == B - 1 && j == kPacks - 1)
        open_at_exit = tile + 1 < a.ntiles && (zero & ~ends[j]) >> (E - 1);
    }
    tile_positions(bits, pos, count, sums);
    // Read before the next block-wide scan, which the next tile's writes follow.
    const uint32_t entry = open_at_entry, nends = count[kStart] + entry - open_at_exit;
    // The values go to the stage (a tile has room for all) before the next scan, so that the
    // packs are no longer needed during it.
    T *value_stage = reinterpret_cast<T *>(stage_words);
    stage_items<E>(
        bits[kNonzero], 0, value_stage, stage_bytes / sizeof(T),
        [&](int j, int e) { return pos[kNonzero][j] + __popc(bits[kNonzero][j] & lanemask_lt(e)); },
        [&](int j, int e) { return pack[j].get(e); });
    // The last run start before each pack in the tile, else before the tile.
    uint64_t latest;
    const uint64_t earlier = block_exclusive_scan(last_starts, MaxHalves{}, sums, &latest);
    const uint32_t start_before[kPacks] = {
        static_cast<uint32_t>(earlier),
        max(static_cast<uint32_t>(latest), static_cast<uint32_t>(earlier >> 32))};
    static_assert(kPacks == 2, "start_before lists two packs");
    copy_out(value_stage, count[kNonzero], values + before.v[RunCount::kNnz]);
    __syncthreads();
    staged_store<E>(
        bits[kStart], count[kStart], reinterpret_cast<uint32_t *>(stage_words), stage_bytes / 4,
        starts_out + before.v[RunCount::kRuns],
        [&](int j, int e) { return pos[kStart][j] + __popc(bits[kStart][j] & lanemask_lt(e)); },
        [&](int j, int e) { return first[j] + e; });
    // The run ending at element first + e is the last one started at or before it.
    staged_store<E>(
        ends, nends, reinterpret_cast<uint32_t *>(stage_words), stage_bytes / 4,
        lengths_out + before.v[RunCount::kRuns] - entry,
        [&](int j, int e) {
          return entry + pos[kStart][j] + __popc(bits[kStart][j] & lanemask_le(e)) - 1;
        },
        [&](int j, int e) {
          const uint32_t here = bits[kStart][j] & lanemask_le(e);
          const uint32_t start = here ? first[j] + 31 - __clz(here)
                                 : start_before[j] ? start_before[j] - 1
                                                   : before.v[RunCount::kLastStart] - 1;
          return first[j] + e + 1 - start;
        });
  }
}

// ---------------------------------------------------------------------------------------------
// Decode.

// ORs bit p (p < numel; none otherwise) of the bitmap, one atomic per word per warp: lanes
// holding the same word hand their bits to the lowest of them. Called by a whole warp.
__device__ inline void or_toggle(uint32_t *toggles, uint64_t p, uint64_t numel) {
  const int lane = threadIdx.x & 31;
  const uint32_t word = p < numel ? static_cast<uint32_t>(p / 32) : kFull;
  uint32_t bits = p < numel ? 1u << (p % 32) : 0;
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t other_word = __shfl_down_sync(kFull, word, d);
    const uint32_t other_bits = __shfl_down_sync(kFull, bits, d);
    if (lane + d < 32 && other_word == word) bits |= other_bits;
  }
  const uint32_t word_before = __shfl_up_sync(kFull, word, 1);
  if (bits && (lane == 0 || word_before != word)) atomicOr(&toggles[word], bits);
}

// Toggle bits at each run's start and end (its first element after the run). The bitmap
// starts out zero.
__global__ void rle_decode_toggles(const uint8_t *payload, uint64_t payload_nbytes, uint64_t numel,
                                   uint32_t *toggles) {
  const uint64_t nruns = rle_nruns(payload, payload_nbytes);
  const uint32_t *starts = reinterpret_cast<const uint32_t *>(payload + 16);
  const uint32_t *lengths = reinterpret_cast<const uint32_t *>(payload + 16 + align16(4 * nruns));
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  // Whole warps walk the runs, so that or_toggle's shuffles see every lane.
  for (uint64_t r = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; r - threadIdx.x % 32 < nruns;
       r += stride) {
    uint64_t start = numel, end = numel;  // no toggle
    if (r < nruns) {
      start = starts[r];
      end = start + lengths[r];
      if (end == start || end > numel) start = end = numel;
    }
    or_toggle(toggles, start, numel);
    or_toggle(toggles, end, numel);
  }
}

// zvc (kRle = false): expand the payload's values under its mask. rle: the same under the zero
// mask of the toggle bitmap.
template <typename T, bool kAligned, bool kRle>
__global__ void __launch_bounds__(1024) decode(CodecArgs a, T *out) {
  using Summary = std::conditional_t<kRle, RunState, NonzeroCount>;
  constexpr int E = Pack<T>::E;
  extern __shared__ uint4 stage_words[];
  __shared__ uint64_t sums[32];
  __shared__ uint32_t next_tile;
  __shared__ Summary tile_before;
  T *stage = reinterpret_cast<T *>(stage_words);
  const uint32_t t = threadIdx.x, B = blockDim.x;
  const uint8_t *payload = a.payload;
  const uint64_t nwords = cdiv(a.numel, 32);
  const uint64_t values_at = kRle ? 16 + 2 * align16(4 * rle_nruns(payload, a.payload_nbytes))
                                  : align16(16 + 4 * nwords);
  const uint64_t nvalues =
      a.payload_nbytes > values_at ? (a.payload_nbytes - values_at) / sizeof(T) : 0;
  const T *values = reinterpret_cast<const T *>(payload + values_at);
  const uint32_t *words = kRle ? a.toggles : reinterpret_cast<const uint32_t *>(payload + 16);
  const TileStates<Summary> states{a.states};
  if (t == 0) next_tile = claim_tile(a.counter);
  __syncthreads();
  for (uint32_t tile = next_tile; tile < a.ntiles; tile = next_tile) {
    const uint32_t claimed = t == 0 ? claim_tile(a.counter) : 0;
    const uint64_t tile_first = tile_start<E>(tile);
    const uint32_t tile_elems =
        static_cast<uint32_t>(min(a.numel - tile_first, uint64_t{B} * kPacks * E));
    uint32_t word_bits[1][kPacks], nonzero[1][kPacks], pos[1][kPacks], count[1];
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const uint64_t first = pack_start<E>(tile_first, j);
      const uint32_t w = first < a.numel ? words[first / 32] : 0;
      word_bits[0][j] = w >> (t * E % 32) & valid_bits<E>(first, a.numel);
    }
    Summary aggregate;
    if constexpr (kRle) {
      // The zero mask as if the tile were entered outside a run: the toggles' prefix parity.
      uint32_t toggles_before[1][kPacks], ntoggles[1];
      tile_positions(word_bits, toggles_before, ntoggles, sums);
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        const uint64_t first = pack_start<E>(tile_first, j);
        const uint32_t zero = prefix_xor(word_bits[0][j]) ^ (toggles_before[0][j] & 1 ? kFull : 0);
        nonzero[0][j] = ~zero & valid_bits<E>(first, a.numel);
      }
      tile_positions(nonzero, pos, count, sums);
      aggregate = {{ntoggles[0] & 1, count[0], tile_elems - count[0]}};
    } else {
#pragma unroll
      for (int j = 0; j < kPacks; ++j) nonzero[0][j] = word_bits[0][j];
      tile_positions(nonzero, pos, count, sums);
      aggregate = {{count[0]}};
    }
    if (t < 32) {
      const Summary before = scan_tile(states, tile, aggregate);
      if (t == 0) {
        tile_before = before;
        next_tile = claimed;
      }
    }
    __syncthreads();
    const Summary before = tile_before;
    uint64_t values_before = before.v[0];
    if constexpr (kRle) {
      values_before = before.v[RunState::kNnzOutside];
      if (before.v[RunState::kParity]) {  // entered inside a run: zeros and non-zeros swap
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          const uint64_t first = pack_start<E>(tile_first, j);
          const uint32_t elems_before = static_cast<uint32_t>(min(first, a.numel) - tile_first);
          nonzero[0][j] = ~nonzero[0][j] & valid_bits<E>(first, a.numel);
          pos[0][j] = elems_before - pos[0][j];
        }
        count[0] = tile_elems - count[0];
      }
    }
    for (uint32_t i = t; i < count[0]; i += B)
      stage[i] = values_before + i < nvalues ? values[values_before + i] : T{0};
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const uint64_t first = pack_start<E>(tile_first, j);
      Pack<T> p = {};
      uint32_t q = pos[0][j];
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (nonzero[0][j] >> e & 1) p.put(e, stage[q++]);
      store_pack<T, kAligned>(out, first, a.numel, p);
    }
  }
}

}  // namespace
