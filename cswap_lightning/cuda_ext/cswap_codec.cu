// CUDA kernels for the zvc, rle and lossy payloads; see cswap_codec.h and codecs/format.py.
//
// Every operation views the elements as 32-element words (one mask bit per element) and the
// words as tiles of `block` words. Block b of the grid owns a contiguous range of tiles, so a
// compaction keeps element order with three steps, all on the stream:
//   1. count:   each block counts what it will emit (non-zeros, run starts, ...);
//   2. scan:    one block turns the per-block counts into exclusive offsets and totals, and
//               writes what depends on the totals (preamble, padding, payload length);
//   3. scatter: each block walks its tiles again, scanning the counts of its tile's words to
//               place every element.
// rle decode first turns the runs into a bitmap of toggles (run start, run end); the zero
// mask is then the prefix XOR of the toggles, and decoding proceeds as for zvc.
//
// The lossy codecs need no compaction: a thread block quantizes one quantization block at a
// time (a block-wide max of |x| gives its scale, then each thread codes its elements), and
// decoding is one thread per element.

#include "cswap_codec.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <type_traits>

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kScanThreads = 1024;
constexpr uint64_t kWorkspaceHeader = 64;  // totals: u64[8]

thread_local char g_last_error[512] = "";

int fail(int status, const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return status;
}

__host__ __device__ inline uint64_t cdiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline uint64_t align16(uint64_t n) { return (n + 15) & ~uint64_t{15}; }

// Scratch arrays, one u32 per block, and the rle-decode toggle bitmap.
struct Workspace {
  uint64_t *totals;    // [0] = sum of a, [1] = sum of c
  uint32_t *a;         // non-zeros per block, then their exclusive offsets
  uint32_t *c;         // run starts per block (rle encode), then offsets
  uint32_t *p;         // rle decode: toggle parity per block, then the run state at its start
  uint32_t *toggles;   // rle decode: one bit per element

  __host__ Workspace(void *base, uint32_t nblocks) {
    auto *bytes = static_cast<uint8_t *>(base);
    totals = reinterpret_cast<uint64_t *>(bytes);
    a = reinterpret_cast<uint32_t *>(bytes + kWorkspaceHeader);
    c = a + nblocks;
    p = c + nblocks;
    toggles = reinterpret_cast<uint32_t *>(bytes + kWorkspaceHeader + align16(12ull * nblocks));
  }
};

// How the words are split: `tpb` tiles per block, tiles of blockDim.x words.
struct Layout {
  uint64_t numel;
  uint64_t nwords;
  uint64_t ntiles;
  uint64_t tpb;

  __device__ uint64_t tile_begin() const {
    uint64_t t = blockIdx.x * tpb;
    return t < ntiles ? t : ntiles;
  }
  __device__ uint64_t tile_end() const {
    uint64_t t = tile_begin() + tpb;
    return t < ntiles ? t : ntiles;
  }
  // Bits of word w that hold elements.
  __device__ uint32_t valid_bits(uint64_t w) const {
    if (w >= nwords) return 0;
    uint64_t left = numel - 32 * w;
    return left >= 32 ? kFull : (1u << left) - 1;
  }
};

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

// Exclusive prefix sum over the block's threads; `*total` gets the sum. All threads must call
// it; `sums` is shared memory of 32 words, free again when it returns.
__device__ uint32_t block_exclusive_scan(uint32_t v, uint32_t *sums, uint32_t *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  uint32_t x = v;
  for (int d = 1; d < 32; d <<= 1) {
    uint32_t y = __shfl_up_sync(kFull, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t s = lane < nwarps ? sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      uint32_t y = __shfl_up_sync(kFull, s, d);
      if (lane >= d) s += y;
    }
    sums[lane] = s;
  }
  __syncthreads();
  uint32_t exclusive = x - v + (warp > 0 ? sums[warp - 1] : 0);
  *total = sums[nwarps - 1];
  __syncthreads();
  return exclusive;
}

__device__ inline uint32_t block_sum(uint32_t v, uint32_t *sums) {
  uint32_t total;
  block_exclusive_scan(v, sums, &total);
  return total;
}

// Number of runs a decoder may trust: all of them fit in the payload, or none.
__device__ inline uint64_t rle_nruns(const uint8_t *payload, uint64_t payload_nbytes) {
  if (payload_nbytes < 16) return 0;
  uint64_t nruns = *reinterpret_cast<const uint64_t *>(payload);
  if (nruns > (payload_nbytes - 16) / 8) return 0;
  return 16 + 2 * align16(4 * nruns) <= payload_nbytes ? nruns : 0;
}

// ---------------------------------------------------------------------------------------------
// Encode, step 1: count.

template <typename T>
__global__ void zvc_encode_count(const T *in, Layout l, uint32_t *mask, uint32_t *counts) {
  __shared__ uint32_t sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  uint32_t nnz = 0;
  for (uint64_t tile = l.tile_begin(); tile < l.tile_end(); ++tile) {
    for (uint64_t w = tile * blockDim.x + warp; w < (tile + 1) * blockDim.x && w < l.nwords;
         w += nwarps) {
      uint64_t i = 32 * w + lane;
      uint32_t m = __ballot_sync(kFull, i < l.numel && in[i] != 0);
      if (lane == 0) {
        mask[w] = m;
        nnz += __popc(m);
      }
    }
  }
  nnz = block_sum(nnz, sums);
  if (threadIdx.x == 0) counts[blockIdx.x] = nnz;
}

// The three masks of a word for rle: non-zero elements, run starts and run ends (the last
// zero of each run). Called by a whole warp.
template <typename T>
struct RleWord {
  uint32_t nonzero, starts, ends;
  bool nonzero_here;

  __device__ RleWord(const T *in, uint64_t numel, uint64_t w, int lane) {
    uint64_t i = 32 * w + lane;
    bool valid = i < numel;
    nonzero_here = valid && in[i] != 0;
    bool zero = valid && !nonzero_here;
    bool zero_before = __shfl_up_sync(kFull, zero, 1);
    if (lane == 0) zero_before = i > 0 && in[i - 1] == 0;
    bool zero_after = __shfl_down_sync(kFull, zero, 1);
    if (lane == 31) zero_after = i + 1 < numel && in[i + 1] == 0;
    if (i + 1 >= numel) zero_after = false;
    nonzero = __ballot_sync(kFull, nonzero_here);
    starts = __ballot_sync(kFull, zero && !zero_before);
    ends = __ballot_sync(kFull, zero && !zero_after);
  }
};

template <typename T>
__global__ void rle_encode_count(const T *in, Layout l, uint32_t *nnz_counts,
                                 uint32_t *run_counts) {
  __shared__ uint32_t sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  uint32_t nnz = 0, nruns = 0;
  for (uint64_t tile = l.tile_begin(); tile < l.tile_end(); ++tile) {
    for (uint64_t w = tile * blockDim.x + warp; w < (tile + 1) * blockDim.x && w < l.nwords;
         w += nwarps) {
      RleWord<T> word(in, l.numel, w, lane);
      if (lane == 0) {
        nnz += __popc(word.nonzero);
        nruns += __popc(word.starts);
      }
    }
  }
  nnz = block_sum(nnz, sums);
  nruns = block_sum(nruns, sums);
  if (threadIdx.x == 0) {
    nnz_counts[blockIdx.x] = nnz;
    run_counts[blockIdx.x] = nruns;
  }
}

// ---------------------------------------------------------------------------------------------
// Step 2: scan the per-block counts (one block of kScanThreads threads).

enum ScanMode { kZvcEncode, kRleEncode, kZvcDecode, kRleDecode };

struct ScanArgs {
  Workspace ws;
  uint32_t nblocks;
  uint64_t numel;
  uint64_t block_elems;  // elements per grid block (tiles per block * 32 * block)
  int elem_size;
  uint8_t *payload;         // encode: where the preamble and padding go
  int64_t *payload_nbytes;  // encode: may be null
};

template <ScanMode mode>
__global__ void scan_counts(ScanArgs s) {
  __shared__ uint32_t sums[32];
  uint32_t run_a = 0, run_c = 0, run_p = 0, total;
  for (uint32_t first = 0; first < s.nblocks; first += blockDim.x) {
    const uint32_t b = first + threadIdx.x;
    const bool here = b < s.nblocks;
    uint32_t a = here ? s.ws.a[b] : 0;
    if (mode == kRleDecode) {
      // The run state entering each block is the parity of the toggles before it; a block
      // counted its non-zeros as if entered outside a run, so flip the count if inside one.
      uint32_t parity = here ? s.ws.p[b] & 1 : 0;
      uint32_t inside = (run_p + block_exclusive_scan(parity, sums, &total)) & 1;
      run_p += total;
      if (here) {
        uint64_t lo = min(s.numel, uint64_t{b} * s.block_elems);
        uint64_t hi = min(s.numel, uint64_t{b + 1} * s.block_elems);
        if (inside) a = static_cast<uint32_t>(hi - lo) - a;
        s.ws.p[b] = inside;
      }
    }
    uint32_t offset = run_a + block_exclusive_scan(a, sums, &total);
    run_a += total;
    if (here) s.ws.a[b] = offset;
    if (mode == kRleEncode) {
      uint32_t c = here ? s.ws.c[b] : 0;
      offset = run_c + block_exclusive_scan(c, sums, &total);
      run_c += total;
      if (here) s.ws.c[b] = offset;
    }
  }
  if (threadIdx.x != 0) return;
  s.ws.totals[0] = run_a;
  s.ws.totals[1] = run_c;
  if (mode != kZvcEncode && mode != kRleEncode) return;
  uint64_t nnz = run_a, *preamble = reinterpret_cast<uint64_t *>(s.payload);
  uint64_t values_at;
  if (mode == kZvcEncode) {
    preamble[0] = nnz;
    preamble[1] = 0;
    uint64_t mask_end = 16 + 4 * cdiv(s.numel, 32);
    values_at = align16(mask_end);
    for (uint64_t j = mask_end; j < values_at; ++j) s.payload[j] = 0;
  } else {
    uint64_t nruns = run_c, section = 4 * nruns;
    preamble[0] = nruns;
    preamble[1] = nnz;
    uint64_t lengths_at = 16 + align16(section);
    values_at = lengths_at + align16(section);
    for (uint64_t j = 16 + section; j < lengths_at; ++j) s.payload[j] = 0;
    for (uint64_t j = lengths_at + section; j < values_at; ++j) s.payload[j] = 0;
  }
  if (s.payload_nbytes) *s.payload_nbytes = static_cast<int64_t>(values_at + nnz * s.elem_size);
}

// ---------------------------------------------------------------------------------------------
// Encode, step 3: scatter.

template <typename T>
__global__ void zvc_encode_scatter(const T *in, Layout l, uint8_t *payload, const uint32_t *mask,
                                   const uint32_t *offsets) {
  extern __shared__ uint32_t smem[];
  uint32_t *sums = smem, *word_mask = smem + 32, *word_base = word_mask + blockDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  T *values = reinterpret_cast<T *>(payload + align16(16 + 4 * l.nwords));
  uint32_t base = offsets[blockIdx.x], total;
  for (uint64_t tile = l.tile_begin(); tile < l.tile_end(); ++tile) {
    uint64_t w = tile * blockDim.x + threadIdx.x;
    uint32_t m = w < l.nwords ? mask[w] : 0;
    word_base[threadIdx.x] = block_exclusive_scan(__popc(m), sums, &total);
    word_mask[threadIdx.x] = m;
    __syncthreads();
    for (int k = warp; k < blockDim.x; k += nwarps) {
      w = tile * blockDim.x + k;
      if (w >= l.nwords) break;
      m = word_mask[k];
      if (m >> lane & 1)
        values[base + word_base[k] + __popc(m & lanemask_lt(lane))] = in[32 * w + lane];
    }
    base += total;
    __syncthreads();
  }
}

template <typename T>
__global__ void rle_encode_scatter(const T *in, Layout l, uint8_t *payload, Workspace ws) {
  extern __shared__ uint32_t smem[];
  const uint32_t n = blockDim.x;
  uint32_t *sums = smem, *nz_mask = smem + 32, *start_mask = nz_mask + n, *end_mask = start_mask + n,
           *nz_base = end_mask + n, *run_base = nz_base + n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const uint64_t nruns = ws.totals[1], lengths_at = 16 + align16(4 * nruns);
  uint32_t *starts = reinterpret_cast<uint32_t *>(payload + 16);
  uint32_t *ends = reinterpret_cast<uint32_t *>(payload + lengths_at);  // lengths, later
  T *values = reinterpret_cast<T *>(payload + lengths_at + align16(4 * nruns));
  uint32_t nz_offset = ws.a[blockIdx.x], run_offset = ws.c[blockIdx.x], nz_total, run_total;
  for (uint64_t tile = l.tile_begin(); tile < l.tile_end(); ++tile) {
    for (uint32_t k = warp; k < n; k += nwarps) {
      uint64_t w = tile * n + k;
      if (w >= l.nwords) break;
      RleWord<T> word(in, l.numel, w, lane);
      if (lane == 0) {
        nz_mask[k] = word.nonzero;
        start_mask[k] = word.starts;
        end_mask[k] = word.ends;
      }
    }
    __syncthreads();
    const bool here = tile * n + threadIdx.x < l.nwords;
    uint32_t nz = here ? __popc(nz_mask[threadIdx.x]) : 0;
    uint32_t st = here ? __popc(start_mask[threadIdx.x]) : 0;
    nz_base[threadIdx.x] = block_exclusive_scan(nz, sums, &nz_total);
    run_base[threadIdx.x] = block_exclusive_scan(st, sums, &run_total);
    __syncthreads();
    for (uint32_t k = warp; k < n; k += nwarps) {
      uint64_t w = tile * n + k;
      if (w >= l.nwords) break;
      const uint32_t i = static_cast<uint32_t>(32 * w + lane);
      const uint32_t runs_before = run_offset + run_base[k];
      if (nz_mask[k] >> lane & 1)
        values[nz_offset + nz_base[k] + __popc(nz_mask[k] & lanemask_lt(lane))] = in[i];
      if (start_mask[k] >> lane & 1) starts[runs_before + __popc(start_mask[k] & lanemask_lt(lane))] = i;
      // The run ending here started at or before i: it is the last run started so far.
      if (end_mask[k] >> lane & 1) ends[runs_before + __popc(start_mask[k] & lanemask_le(lane)) - 1] = i + 1;
    }
    nz_offset += nz_total;
    run_offset += run_total;
    __syncthreads();
  }
}

// Step 4 of rle encode: run ends to run lengths.
__global__ void rle_encode_lengths(uint8_t *payload, const uint64_t *totals) {
  const uint64_t nruns = totals[1];
  const uint32_t *starts = reinterpret_cast<const uint32_t *>(payload + 16);
  uint32_t *lengths = reinterpret_cast<uint32_t *>(payload + 16 + align16(4 * nruns));
  for (uint64_t r = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; r < nruns;
       r += uint64_t{gridDim.x} * blockDim.x)
    lengths[r] -= starts[r];
}

// ---------------------------------------------------------------------------------------------
// Decode. `words` holds the zvc mask (RLE = false) or the rle toggle bitmap (RLE = true).

__global__ void rle_decode_toggles(const uint8_t *payload, uint64_t payload_nbytes, uint64_t numel,
                                   uint32_t *toggles) {
  const uint64_t nruns = rle_nruns(payload, payload_nbytes);
  const uint32_t *starts = reinterpret_cast<const uint32_t *>(payload + 16);
  const uint32_t *lengths = reinterpret_cast<const uint32_t *>(payload + 16 + align16(4 * nruns));
  for (uint64_t r = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; r < nruns;
       r += uint64_t{gridDim.x} * blockDim.x) {
    uint64_t start = starts[r], end = start + lengths[r];
    if (end == start || end > numel) continue;
    atomicOr(&toggles[start / 32], 1u << (start % 32));
    if (end < numel) atomicOr(&toggles[end / 32], 1u << (end % 32));
  }
}

// The non-zero mask of a tile's words, one word per thread. For rle, `inside` is the run state
// entering the tile and is advanced past it.
template <bool RLE>
__device__ inline uint32_t decode_word_mask(const uint32_t *words, const Layout &l, uint64_t w,
                                            uint32_t *sums, uint32_t &inside) {
  uint32_t x = w < l.nwords ? words[w] : 0;
  if (!RLE) return x & l.valid_bits(w);
  uint32_t total;
  uint32_t in_run = (inside + block_exclusive_scan(__popc(x) & 1, sums, &total)) & 1;
  inside = (inside + total) & 1;
  uint32_t zero = prefix_xor(x) ^ (in_run ? kFull : 0);
  return ~zero & l.valid_bits(w);
}

template <bool RLE>
__global__ void decode_count(const uint32_t *words, Layout l, Workspace ws) {
  __shared__ uint32_t sums[32];
  uint32_t nnz = 0, inside = 0;
  for (uint64_t tile = l.tile_begin(); tile < l.tile_end(); ++tile)
    nnz += __popc(decode_word_mask<RLE>(words, l, tile * blockDim.x + threadIdx.x, sums, inside));
  nnz = block_sum(nnz, sums);
  if (threadIdx.x == 0) {
    ws.a[blockIdx.x] = nnz;
    if (RLE) ws.p[blockIdx.x] = inside;
  }
}

template <typename T, bool RLE>
__global__ void decode_expand(const uint8_t *payload, uint64_t payload_nbytes, const uint32_t *words,
                              Layout l, Workspace ws, T *out) {
  extern __shared__ uint32_t smem[];
  uint32_t *sums = smem, *word_mask = smem + 32, *word_base = word_mask + blockDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const uint64_t values_at = RLE ? 16 + 2 * align16(4 * rle_nruns(payload, payload_nbytes))
                                 : align16(16 + 4 * l.nwords);
  const uint64_t nvalues = payload_nbytes > values_at ? (payload_nbytes - values_at) / sizeof(T) : 0;
  const T *values = reinterpret_cast<const T *>(payload + values_at);
  uint32_t base = ws.a[blockIdx.x], inside = RLE ? ws.p[blockIdx.x] : 0, total;
  for (uint64_t tile = l.tile_begin(); tile < l.tile_end(); ++tile) {
    uint32_t m = decode_word_mask<RLE>(words, l, tile * blockDim.x + threadIdx.x, sums, inside);
    word_base[threadIdx.x] = block_exclusive_scan(__popc(m), sums, &total);
    word_mask[threadIdx.x] = m;
    __syncthreads();
    for (int k = warp; k < blockDim.x; k += nwarps) {
      uint64_t w = tile * blockDim.x + k, i = 32 * w + lane;
      if (w >= l.nwords) break;
      if (i >= l.numel) continue;
      m = word_mask[k];
      uint64_t index = uint64_t{base} + word_base[k] + __popc(m & lanemask_lt(lane));
      out[i] = (m >> lane & 1) && index < nvalues ? values[index] : T{0};
    }
    base += total;
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Lossy codecs. The element math is __host__ __device__ so that a host build can check it
// against the reference. It matches the reference bit for bit because every float operation is
// a single IEEE operation rounded to nearest: the build uses neither --use_fast_math nor
// operations that --fmad could contract (no product feeds an addition).

constexpr uint64_t kLossyPreamble = 16;

__host__ __device__ inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The codes of format.py, as int8 values (int4: the sign-extended nibble).
template <int C>
struct LossyCodes;
template <>
struct LossyCodes<CSWAP_CODEC_INT8> {
  static constexpr double kLevels = 126;
  static constexpr int kNan = -128, kPosInf = 127, kNegInf = -127;
};
template <>
struct LossyCodes<CSWAP_CODEC_INT4> {
  static constexpr double kLevels = 6;
  static constexpr int kNan = -8, kPosInf = 7, kNegInf = -7;
};
template <>
struct LossyCodes<CSWAP_CODEC_FP8> {
  static constexpr double kLevels = 416;
  static constexpr int kNan = 0x7F, kPosInf = 0x7E, kNegInf = 0xFE - 256;
};

__host__ __device__ inline uint64_t lossy_codes_offset(uint64_t numel, uint64_t block_size) {
  return kLossyPreamble + align16(4 * cdiv(numel, block_size));
}

__host__ __device__ inline uint64_t lossy_payload_bytes(int codec, uint64_t numel,
                                                        uint64_t block_size) {
  const uint64_t code_bytes = codec == CSWAP_CODEC_INT4 ? cdiv(numel, 2) : numel;
  return lossy_codes_offset(numel, block_size) + code_bytes;
}

// The 16-byte preamble as u32 words: block size, seed (0 for fp8, which has no noise), 0, 0.
template <int C>
__host__ __device__ inline void lossy_preamble(uint32_t block_size, uint32_t seed, uint32_t *out) {
  out[0] = block_size;
  out[1] = C == CSWAP_CODEC_FP8 ? 0 : seed;
  out[2] = out[3] = 0;
}

// s = RU(absmax / L): the smallest float32 not below the float64 quotient.
template <int C>
__host__ __device__ inline float lossy_scale(float absmax) {
  const double quotient = static_cast<double>(absmax) / LossyCodes<C>::kLevels;
#ifdef __CUDA_ARCH__
  return __double2float_ru(quotient);
#else
  const float nearest = static_cast<float>(quotient);
  return static_cast<double>(nearest) < quotient ? std::nextafter(nearest, INFINITY) : nearest;
#endif
}

// The code of element `index` (int4: in the low nibble), given its block's scale.
template <int C>
__host__ __device__ inline int8_t quantize(float x, float scale, uint32_t index, uint32_t key) {
  using Codes = LossyCodes<C>;
  if (isnan(x)) return Codes::kNan;
  if (isinf(x)) return x > 0.f ? Codes::kPosInf : Codes::kNegInf;
  const float y = x / (scale > 0.f ? scale : 1.f);
  if constexpr (C == CSWAP_CODEC_FP8) {
    return static_cast<int8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
  } else {
    const float a = fabsf(y), low = floorf(a);
    const float u = static_cast<float>(lowbias32(index ^ key) >> 8) * 0x1p-24f;  // exact
    const float magnitude = u < a - low ? low + 1.f : low;
    const int q = static_cast<int>(magnitude);
    return static_cast<int8_t>(y < 0.f ? -q : q);
  }
}

template <int C>
__host__ __device__ inline int8_t code_at(const uint8_t *codes, uint64_t i) {
  if constexpr (C == CSWAP_CODEC_INT4) {
    const int nibble = (codes[i / 2] >> (4 * (i % 2))) & 0xF;
    return static_cast<int8_t>((nibble ^ 8) - 8);
  } else {
    return static_cast<int8_t>(codes[i]);
  }
}

template <int C>
__host__ __device__ inline float dequantize(int8_t q, float scale) {
  using Codes = LossyCodes<C>;
  if (q == Codes::kNan) return nanf("");
  if (q == Codes::kPosInf) return INFINITY;
  if (q == Codes::kNegInf) return -INFINITY;
  float v;
  if constexpr (C == CSWAP_CODEC_FP8) {
    const auto bits = static_cast<__nv_fp8_storage_t>(q);
    v = __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, __NV_E4M3)));
  } else {
    v = static_cast<float>(q);
  }
  v = v * scale;
  return isnan(v) ? v : fminf(fmaxf(v, -FLT_MAX), FLT_MAX);
}

__device__ inline float load_float(float x) { return x; }
__device__ inline float load_float(__half x) { return __half2float(x); }
__device__ inline float load_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ inline T store_float(float x);
template <>
__device__ inline float store_float<float>(float x) { return x; }
template <>
__device__ inline __half store_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ inline __nv_bfloat16 store_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Max over the thread block, returned to every thread. `warp_max` is 32 floats of shared
// memory, free again when it returns.
__device__ float block_max(float v, float *warp_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, d));
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  v = lane < nwarps ? warp_max[lane] : 0.f;
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, d));
  __syncthreads();
  return v;
}

template <int C, typename T>
__global__ void lossy_encode(const T *in, uint64_t numel, uint32_t block_size, uint32_t seed,
                             uint8_t *payload) {
  __shared__ float warp_max[32];
  const uint64_t nblocks = cdiv(numel, block_size);
  const uint64_t codes_at = lossy_codes_offset(numel, block_size);
  float *scales = reinterpret_cast<float *>(payload + kLossyPreamble);
  uint8_t *codes = payload + codes_at;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0)
      lossy_preamble<C>(block_size, seed, reinterpret_cast<uint32_t *>(payload));
    for (uint64_t j = kLossyPreamble + 4 * nblocks + threadIdx.x; j < codes_at; j += blockDim.x)
      payload[j] = 0;
  }
  const uint32_t key = lowbias32(seed);
  for (uint64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const uint64_t first = b * block_size;
    const uint32_t len = static_cast<uint32_t>(min(uint64_t{block_size}, numel - first));
    float absmax = 0.f;
    for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
      const float x = load_float(in[first + j]);
      if (isfinite(x)) absmax = fmaxf(absmax, fabsf(x));
    }
    const float scale = lossy_scale<C>(block_max(absmax, warp_max));
    if (threadIdx.x == 0) scales[b] = scale;
    auto code = [&](uint64_t i) {
      const int8_t q = quantize<C>(load_float(in[i]), scale, static_cast<uint32_t>(i), key);
      return static_cast<uint8_t>(q);
    };
    if constexpr (C == CSWAP_CODEC_INT4) {
      // Pairs of elements, one byte each: blocks start at even elements, as block_size is even.
      for (uint32_t j = 2 * threadIdx.x; j < len; j += 2 * blockDim.x) {
        const uint64_t i = first + j;
        const int high = j + 1 < len ? code(i + 1) & 0xF : 0;
        codes[i / 2] = static_cast<uint8_t>((code(i) & 0xF) | high << 4);
      }
    } else {
      for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) codes[first + j] = code(first + j);
    }
  }
}

template <int C, typename T>
__global__ void lossy_decode(const uint8_t *payload, uint64_t payload_nbytes, uint64_t numel,
                             T *out) {
  const uint32_t block_size = *reinterpret_cast<const uint32_t *>(payload);
  const bool valid = block_size >= 2 && block_size % 2 == 0 &&
                     lossy_payload_bytes(C, numel, block_size) == payload_nbytes;
  const float *scales = reinterpret_cast<const float *>(payload + kLossyPreamble);
  const uint8_t *codes = payload + (valid ? lossy_codes_offset(numel, block_size) : 0);
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < numel;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t b = valid ? static_cast<uint32_t>(i) / block_size : 0;  // numel < 2**32
    out[i] = store_float<T>(valid ? dequantize<C>(code_at<C>(codes, i), scales[b]) : nanf(""));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

struct Launch {
  Layout layout;
  uint32_t grid;
  uint32_t block;
};

bool aligned(const void *p, uint64_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

int check_numel_and_launch(uint64_t numel, int grid, int block) {
  if (numel >= (uint64_t{1} << 32))
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "numel must be below 2**32, got %llu",
                static_cast<unsigned long long>(numel));
  if (grid < 1)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "grid must be at least 1, got %d", grid);
  if (block < 32 || block > 1024 || block % 32 != 0)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "block must be a multiple of 32 in [32, 1024], got %d",
                block);
  return CSWAP_OK;
}

int check_common(uint64_t numel, int elem_size, int grid, int block, const void *elems,
                 const void *payload, const void *workspace, uint64_t workspace_bytes,
                 Launch *launch) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "elem_size must be 1, 2, 4 or 8, got %d", elem_size);
  int status = check_numel_and_launch(numel, grid, block);
  if (status != CSWAP_OK) return status;
  if (!payload || (numel && !elems) || !workspace)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "null device pointer");
  if (!aligned(elems, elem_size) || !aligned(payload, 16) || !aligned(workspace, 16))
    return fail(CSWAP_ERR_INVALID_ARGUMENT,
                "misaligned pointer: elements need %d-byte, payload and workspace 16-byte "
                "alignment",
                elem_size);
  uint64_t need = cswap_workspace_bytes(numel, grid);
  if (workspace_bytes < need)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "workspace has %llu bytes, needs %llu",
                static_cast<unsigned long long>(workspace_bytes),
                static_cast<unsigned long long>(need));
  Layout &l = launch->layout;
  l.numel = numel;
  l.nwords = cdiv(numel, 32);
  l.ntiles = cdiv(l.nwords, block);
  uint64_t blocks = l.ntiles < static_cast<uint64_t>(grid) ? l.ntiles : grid;
  launch->grid = static_cast<uint32_t>(blocks > 0 ? blocks : 1);
  l.tpb = cdiv(l.ntiles, launch->grid);
  launch->block = static_cast<uint32_t>(block);
  return CSWAP_OK;
}

int check_launches(const char *what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return fail(CSWAP_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err),
                cudaGetErrorName(err));
  return CSWAP_OK;
}

template <ScanMode mode>
void launch_scan(const Launch &launch, Workspace ws, int elem_size, void *payload,
                 int64_t *payload_nbytes, cudaStream_t stream) {
  ScanArgs args{ws, launch.grid, launch.layout.numel,
                launch.layout.tpb * 32 * launch.block, elem_size,
                static_cast<uint8_t *>(payload), payload_nbytes};
  scan_counts<mode><<<1, kScanThreads, 0, stream>>>(args);
}

template <typename T>
void zvc_compress(const Launch &launch, const T *in, uint8_t *payload, int64_t *nbytes,
                  Workspace ws, cudaStream_t stream) {
  uint32_t *mask = reinterpret_cast<uint32_t *>(payload + 16);
  const Layout &l = launch.layout;
  zvc_encode_count<T><<<launch.grid, launch.block, 0, stream>>>(in, l, mask, ws.a);
  launch_scan<kZvcEncode>(launch, ws, sizeof(T), payload, nbytes, stream);
  size_t smem = (32 + 2 * launch.block) * sizeof(uint32_t);
  zvc_encode_scatter<T><<<launch.grid, launch.block, smem, stream>>>(in, l, payload, mask, ws.a);
}

template <typename T>
void rle_compress(const Launch &launch, const T *in, uint8_t *payload, int64_t *nbytes,
                  Workspace ws, cudaStream_t stream) {
  const Layout &l = launch.layout;
  rle_encode_count<T><<<launch.grid, launch.block, 0, stream>>>(in, l, ws.a, ws.c);
  launch_scan<kRleEncode>(launch, ws, sizeof(T), payload, nbytes, stream);
  size_t smem = (32 + 5 * launch.block) * sizeof(uint32_t);
  rle_encode_scatter<T><<<launch.grid, launch.block, smem, stream>>>(in, l, payload, ws);
  rle_encode_lengths<<<launch.grid, launch.block, 0, stream>>>(payload, ws.totals);
}

template <typename T, bool RLE>
void decompress(const Launch &launch, const uint8_t *payload, uint64_t payload_nbytes, T *out,
                Workspace ws, cudaStream_t stream) {
  const Layout &l = launch.layout;
  const uint32_t *words = reinterpret_cast<const uint32_t *>(payload + 16);
  if (RLE) {
    words = ws.toggles;
    if (cudaMemsetAsync(ws.toggles, 0, 4 * l.nwords, stream) != cudaSuccess) return;
    rle_decode_toggles<<<launch.grid, launch.block, 0, stream>>>(payload, payload_nbytes, l.numel,
                                                                 ws.toggles);
  }
  decode_count<RLE><<<launch.grid, launch.block, 0, stream>>>(words, l, ws);
  launch_scan<RLE ? kRleDecode : kZvcDecode>(launch, ws, sizeof(T), nullptr, nullptr, stream);
  size_t smem = (32 + 2 * launch.block) * sizeof(uint32_t);
  decode_expand<T, RLE><<<launch.grid, launch.block, smem, stream>>>(payload, payload_nbytes,
                                                                     words, l, ws, out);
}

#define CSWAP_DISPATCH(elem_size, ...)      \
  switch (elem_size) {                      \
    case 1: {                               \
      using T = uint8_t;                    \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
    case 2: {                               \
      using T = uint16_t;                   \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
    case 4: {                               \
      using T = uint32_t;                   \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
    default: {                              \
      using T = unsigned long long;         \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
  }

int compress(int codec, const void *input, uint64_t numel, int elem_size, void *payload,
             uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
             uint64_t workspace_bytes, int grid, int block, cudaStream_t stream) {
  Launch launch;
  int status = check_common(numel, elem_size, grid, block, input, payload, workspace,
                            workspace_bytes, &launch);
  if (status != CSWAP_OK) return status;
  uint64_t need = cswap_max_payload_bytes(codec, numel, elem_size);
  if (payload_capacity < need)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "payload buffer has %llu bytes, needs %llu",
                static_cast<unsigned long long>(payload_capacity),
                static_cast<unsigned long long>(need));
  cudaGetLastError();  // report only errors of this call's launches
  Workspace ws(workspace, launch.grid);
  auto *bytes = static_cast<uint8_t *>(payload);
  if (codec == CSWAP_CODEC_ZVC) {
    CSWAP_DISPATCH(elem_size,
                   zvc_compress<T>(launch, static_cast<const T *>(input), bytes, payload_nbytes,
                                   ws, stream));
  } else {
    CSWAP_DISPATCH(elem_size,
                   rle_compress<T>(launch, static_cast<const T *>(input), bytes, payload_nbytes,
                                   ws, stream));
  }
  return check_launches(codec == CSWAP_CODEC_ZVC ? "zvc compress" : "rle compress");
}

int decompress_any(int codec, const void *payload, uint64_t payload_nbytes, void *output,
                   uint64_t numel, int elem_size, void *workspace, uint64_t workspace_bytes,
                   int grid, int block, cudaStream_t stream) {
  Launch launch;
  int status = check_common(numel, elem_size, grid, block, output, payload, workspace,
                            workspace_bytes, &launch);
  if (status != CSWAP_OK) return status;
  uint64_t minimum = codec == CSWAP_CODEC_ZVC ? align16(16 + 4 * cdiv(numel, 32)) : 16;
  if (payload_nbytes < minimum)
    return fail(CSWAP_ERR_INVALID_ARGUMENT,
                "payload has %llu bytes, fewer than the %llu this codec needs for %llu elements",
                static_cast<unsigned long long>(payload_nbytes),
                static_cast<unsigned long long>(minimum), static_cast<unsigned long long>(numel));
  if (numel == 0) return CSWAP_OK;
  cudaGetLastError();
  Workspace ws(workspace, launch.grid);
  auto *bytes = static_cast<const uint8_t *>(payload);
  if (codec == CSWAP_CODEC_ZVC) {
    CSWAP_DISPATCH(elem_size, (decompress<T, false>(launch, bytes, payload_nbytes,
                                                    static_cast<T *>(output), ws, stream)));
  } else {
    CSWAP_DISPATCH(elem_size, (decompress<T, true>(launch, bytes, payload_nbytes,
                                                   static_cast<T *>(output), ws, stream)));
  }
  return check_launches(codec == CSWAP_CODEC_ZVC ? "zvc decompress" : "rle decompress");
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(std::integral_constant<int, codec>, TypeTag<element type>) for checked arguments.
template <typename F>
void dispatch_lossy(int codec, int dtype, F &&f) {
  auto by_dtype = [&](auto c) {
    switch (dtype) {
      case CSWAP_DTYPE_FLOAT32:
        f(c, TypeTag<float>{});
        break;
      case CSWAP_DTYPE_FLOAT16:
        f(c, TypeTag<__half>{});
        break;
      default:
        f(c, TypeTag<__nv_bfloat16>{});
        break;
    }
  };
  switch (codec) {
    case CSWAP_CODEC_INT8:
      by_dtype(std::integral_constant<int, CSWAP_CODEC_INT8>{});
      break;
    case CSWAP_CODEC_FP8:
      by_dtype(std::integral_constant<int, CSWAP_CODEC_FP8>{});
      break;
    default:
      by_dtype(std::integral_constant<int, CSWAP_CODEC_INT4>{});
      break;
  }
}

int check_lossy(int codec, uint64_t numel, int dtype, int grid, int block, const void *elems,
                const void *payload) {
  if (codec != CSWAP_CODEC_INT8 && codec != CSWAP_CODEC_FP8 && codec != CSWAP_CODEC_INT4)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "codec must be int8 (3), fp8 (4) or int4 (5), got %d",
                codec);
  if (dtype != CSWAP_DTYPE_FLOAT32 && dtype != CSWAP_DTYPE_FLOAT16 && dtype != CSWAP_DTYPE_BFLOAT16)
    return fail(CSWAP_ERR_INVALID_ARGUMENT,
                "dtype must be float32 (0), float16 (1) or bfloat16 (2), got %d", dtype);
  int status = check_numel_and_launch(numel, grid, block);
  if (status != CSWAP_OK) return status;
  if (!payload || (numel && !elems)) return fail(CSWAP_ERR_INVALID_ARGUMENT, "null device pointer");
  const int elem_size = dtype == CSWAP_DTYPE_FLOAT32 ? 4 : 2;
  if (!aligned(elems, elem_size) || !aligned(payload, 16))
    return fail(CSWAP_ERR_INVALID_ARGUMENT,
                "misaligned pointer: elements need %d-byte, the payload 16-byte alignment",
                elem_size);
  return CSWAP_OK;
}

uint32_t clamp_grid(uint64_t work, int grid) {
  return static_cast<uint32_t>(work == 0 ? 1 : work < static_cast<uint64_t>(grid) ? work : grid);
}

}  // namespace

extern "C" {

int cswap_abi_version(void) { return CSWAP_CODEC_ABI_VERSION; }

int cswap_format_version(void) { return CSWAP_FORMAT_VERSION; }

const char *cswap_status_string(int status) {
  switch (status) {
    case CSWAP_OK:
      return "ok";
    case CSWAP_ERR_INVALID_ARGUMENT:
      return "invalid argument";
    case CSWAP_ERR_CUDA:
      return "CUDA error";
    default:
      return "unknown status";
  }
}

const char *cswap_last_error(void) { return g_last_error; }

int cswap_check_device(void) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    return fail(CSWAP_ERR_CUDA, "the CUDA runtime cannot see a device: %s (%s)",
                cudaGetErrorString(err), cudaGetErrorName(err));
  if (count == 0) return fail(CSWAP_ERR_CUDA, "no CUDA device");
  return CSWAP_OK;
}

uint64_t cswap_max_payload_bytes(int codec, uint64_t numel, int elem_size) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) return 0;
  if (codec == CSWAP_CODEC_ZVC) return align16(16 + 4 * cdiv(numel, 32)) + numel * elem_size;
  // At most ceil(numel / 2) runs; the values never exceed numel elements.
  if (codec == CSWAP_CODEC_RLE) return 16 + 2 * align16(4 * cdiv(numel, 2)) + numel * elem_size;
  return 0;
}

uint64_t cswap_workspace_bytes(uint64_t numel, int grid) {
  uint64_t blocks = grid > 0 ? static_cast<uint64_t>(grid) : 1;
  return kWorkspaceHeader + align16(12 * blocks) + align16(4 * cdiv(numel, 32));
}

uint64_t cswap_lossy_payload_bytes(int codec, uint64_t numel, uint32_t block_size) {
  if (codec != CSWAP_CODEC_INT8 && codec != CSWAP_CODEC_FP8 && codec != CSWAP_CODEC_INT4) return 0;
  if (block_size < 2 || block_size % 2 != 0) return 0;
  return lossy_payload_bytes(codec, numel, block_size);
}

int cswap_lossy_compress(int codec, const void *input, uint64_t numel, int dtype,
                         uint32_t block_size, uint32_t seed, void *payload,
                         uint64_t payload_capacity, int grid, int block, cudaStream_t stream) {
  int status = check_lossy(codec, numel, dtype, grid, block, input, payload);
  if (status != CSWAP_OK) return status;
  if (block_size < 2 || block_size % 2 != 0)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "block_size must be even and at least 2, got %u",
                block_size);
  const uint64_t need = lossy_payload_bytes(codec, numel, block_size);
  if (payload_capacity < need)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "payload buffer has %llu bytes, needs %llu",
                static_cast<unsigned long long>(payload_capacity),
                static_cast<unsigned long long>(need));
  cudaGetLastError();  // report only errors of this call's launches
  const uint32_t blocks = clamp_grid(cdiv(numel, block_size), grid);
  auto *bytes = static_cast<uint8_t *>(payload);
  dispatch_lossy(codec, dtype, [&](auto c, auto tag) {
    using T = typename decltype(tag)::type;
    lossy_encode<decltype(c)::value, T><<<blocks, block, 0, stream>>>(
        static_cast<const T *>(input), numel, block_size, seed, bytes);
  });
  return check_launches("lossy compress");
}

int cswap_lossy_decompress(int codec, const void *payload, uint64_t payload_nbytes, void *output,
                           uint64_t numel, int dtype, int grid, int block, cudaStream_t stream) {
  int status = check_lossy(codec, numel, dtype, grid, block, output, payload);
  if (status != CSWAP_OK) return status;
  if (payload_nbytes < kLossyPreamble)
    return fail(CSWAP_ERR_INVALID_ARGUMENT,
                "payload has %llu bytes, fewer than the %llu of its preamble",
                static_cast<unsigned long long>(payload_nbytes),
                static_cast<unsigned long long>(kLossyPreamble));
  if (numel == 0) return CSWAP_OK;
  cudaGetLastError();
  const uint32_t blocks = clamp_grid(cdiv(numel, block), grid);
  const auto *bytes = static_cast<const uint8_t *>(payload);
  dispatch_lossy(codec, dtype, [&](auto c, auto tag) {
    using T = typename decltype(tag)::type;
    lossy_decode<decltype(c)::value, T><<<blocks, block, 0, stream>>>(
        bytes, payload_nbytes, numel, static_cast<T *>(output));
  });
  return check_launches("lossy decompress");
}

int cswap_zvc_compress(const void *input, uint64_t numel, int elem_size, void *payload,
                       uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
                       uint64_t workspace_bytes, int grid, int block, cudaStream_t stream) {
  return compress(CSWAP_CODEC_ZVC, input, numel, elem_size, payload, payload_capacity,
                  payload_nbytes, workspace, workspace_bytes, grid, block, stream);
}

int cswap_rle_compress(const void *input, uint64_t numel, int elem_size, void *payload,
                       uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
                       uint64_t workspace_bytes, int grid, int block, cudaStream_t stream) {
  return compress(CSWAP_CODEC_RLE, input, numel, elem_size, payload, payload_capacity,
                  payload_nbytes, workspace, workspace_bytes, grid, block, stream);
}

int cswap_zvc_decompress(const void *payload, uint64_t payload_nbytes, void *output,
                         uint64_t numel, int elem_size, void *workspace, uint64_t workspace_bytes,
                         int grid, int block, cudaStream_t stream) {
  return decompress_any(CSWAP_CODEC_ZVC, payload, payload_nbytes, output, numel, elem_size,
                        workspace, workspace_bytes, grid, block, stream);
}

int cswap_rle_decompress(const void *payload, uint64_t payload_nbytes, void *output,
                         uint64_t numel, int elem_size, void *workspace, uint64_t workspace_bytes,
                         int grid, int block, cudaStream_t stream) {
  return decompress_any(CSWAP_CODEC_RLE, payload, payload_nbytes, output, numel, elem_size,
                        workspace, workspace_bytes, grid, block, stream);
}

}  // extern "C"
