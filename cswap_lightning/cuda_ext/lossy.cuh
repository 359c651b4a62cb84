// The lossy kernels (int8, fp8, int4): part of cswap_codec.cu's one translation unit.
//
// The lossy codecs need no compaction: a warp quantizes one quantization block at a time (a
// warp-wide max of |x| gives its scale, then each lane codes its elements), and a thread
// decodes a group of elements. Both move 16 bytes of elements per load or store where the
// elements are 16-byte aligned and the block size a multiple of the 16-byte group, so that
// they run at the memory's speed; element by element otherwise.
//
// The element math is __host__ __device__ so that a host build can check it
// against the reference. It matches the reference bit for bit because every float operation is
// a single IEEE operation rounded to nearest: the build uses neither --use_fast_math nor
// operations that --fmad could contract (no product feeds an addition).
#pragma once

#include "codec_common.cuh"

namespace {

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
  // A zero (ReLU outputs are half zeros) skips the division, whose range check sends a zero
  // dividend down its slow path; it divides to itself, sign included.
  const float y = x == 0.f ? x : x / (scale > 0.f ? scale : 1.f);
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

// A group of N elements of `in` from element i, as floats: one 16-byte load where `vector`
// and all N lie before `end`, else element by element (those at or past `end` read as 0).
template <int N, typename T>
__device__ inline void load_group(const T *in, uint64_t i, uint64_t end, bool vector,
                                  float (&x)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    if (vector && i + N <= end) {
      const uint4 raw = *reinterpret_cast<const uint4 *>(in + i);
      T v[N];
      memcpy(v, &raw, 16);
      for (int k = 0; k < N; ++k) x[k] = load_float(v[k]);
      return;
    }
  }
  for (int k = 0; k < N; ++k) x[k] = i + k < end ? load_float(in[i + k]) : 0.f;
}

// N bytes as one word (2, 4 or 8 bytes: one load or store instruction).
template <int N>
using Word = std::conditional_t<N == 8, uint2, std::conditional_t<N == 4, uint32_t, uint16_t>>;
template <int N>
constexpr bool kWord = N == 8 || N == 4 || N == 2;

// `n` bytes to `dst`, one store where `whole` (dst is then N-byte aligned), else byte by byte.
template <int N>
__device__ inline void store_bytes(uint8_t *dst, const uint8_t (&src)[N], int n, bool whole) {
  if constexpr (kWord<N>) {
    if (whole) {
      Word<N> w;
      memcpy(&w, src, N);
      *reinterpret_cast<Word<N> *>(dst) = w;
      return;
    }
  }
  for (int k = 0; k < n; ++k) dst[k] = src[k];
}

// `n` bytes from `src` (the rest 0), one load where `whole` (src is then N-byte aligned).
template <int N>
__device__ inline void load_bytes(const uint8_t *src, uint8_t (&dst)[N], int n, bool whole) {
  if constexpr (kWord<N>) {
    if (whole) {
      const Word<N> w = *reinterpret_cast<const Word<N> *>(src);
      memcpy(dst, &w, N);
      return;
    }
  }
  for (int k = 0; k < N; ++k) dst[k] = k < n ? src[k] : 0;
}

// The codes of a group of N elements (the first `n` of them real) at element i: a byte each,
// or for int4 a nibble each, low nibble first, a lone last nibble with 0 above it.
template <int C, int N>
__device__ inline void store_codes(uint8_t *codes, uint64_t i, int n, bool vector,
                                   const int8_t (&q)[N]) {
  if constexpr (C == CSWAP_CODEC_INT4) {
    uint8_t bytes[N / 2];
    for (int m = 0; m < N / 2; ++m)
      bytes[m] = static_cast<uint8_t>((q[2 * m] & 0xF) |
                                      (2 * m + 1 < n ? (q[2 * m + 1] & 0xF) << 4 : 0));
    store_bytes<N / 2>(codes + i / 2, bytes, (n + 1) / 2, vector && n == N);
  } else {
    uint8_t bytes[N];
    for (int k = 0; k < N; ++k) bytes[k] = static_cast<uint8_t>(q[k]);
    store_bytes<N>(codes + i, bytes, n, vector && n == N);
  }
}

// The codes of a group of N elements (the first `n` of them real) at element i (even: a
// group's int4 codes start on a byte).
template <int C, int N>
__device__ inline void load_codes(const uint8_t *codes, uint64_t i, int n, bool vector,
                                  int8_t (&q)[N]) {
  constexpr bool kInt4 = C == CSWAP_CODEC_INT4;
  uint8_t bytes[kInt4 ? N / 2 : N];
  load_bytes(codes + (kInt4 ? i / 2 : i), bytes, kInt4 ? (n + 1) / 2 : n, vector && n == N);
  for (int k = 0; k < N; ++k) q[k] = code_at<C>(bytes, k);
}

// Max over the warp, returned to every lane.
__device__ inline float warp_max(float v) {
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, d));
  return v;
}

// Quantization blocks b = warp, warp + nwarps, ... of `in`, each by one warp, a lane reading
// groups of N elements (one 16-byte load each where `vector`): a pass for the block's
// max |x|, then one that codes the elements (reading them again, from the cache).
template <int C, int N, typename T>
__device__ void encode_blocks(const T *in, uint64_t numel, uint32_t block_size, uint32_t key,
                              float *scales, uint8_t *codes, bool vector) {
  const uint32_t lane = threadIdx.x & 31;
  const uint64_t nblocks = cdiv(numel, block_size);
  const uint64_t nwarps = uint64_t{gridDim.x} * (blockDim.x >> 5);
  for (uint64_t b = blockIdx.x * uint64_t{blockDim.x >> 5} + (threadIdx.x >> 5); b < nblocks;
       b += nwarps) {
    const uint64_t first = b * block_size, end = min(first + block_size, numel);
    float absmax = 0.f;
    for (uint64_t i = first + N * lane; i < end; i += 32 * N) {
      float x[N];
      load_group<N>(in, i, end, vector, x);
      for (int k = 0; k < N; ++k)
        if (isfinite(x[k])) absmax = fmaxf(absmax, fabsf(x[k]));
    }
    const float scale = lossy_scale<C>(warp_max(absmax));
    if (lane == 0) scales[b] = scale;
    for (uint64_t i = first + N * lane; i < end; i += 32 * N) {
      float x[N];
      load_group<N>(in, i, end, vector, x);
      int8_t q[N];
      for (int k = 0; k < N; ++k) q[k] = quantize<C>(x[k], scale, static_cast<uint32_t>(i + k), key);
      store_codes<C, N>(codes, i, static_cast<int>(min(uint64_t{N}, end - i)), vector, q);
    }
  }
}

template <int C, typename T>
__global__ void lossy_encode(const T *in, uint64_t numel, uint32_t block_size, uint32_t seed,
                             uint8_t *payload) {
  constexpr int kVector = 16 / sizeof(T);  // elements a 16-byte load holds
  const uint64_t nblocks = cdiv(numel, block_size);
  const uint64_t codes_at = lossy_codes_offset(numel, block_size);
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0)
      lossy_preamble<C>(block_size, seed, reinterpret_cast<uint32_t *>(payload));
    for (uint64_t j = kLossyPreamble + 4 * nblocks + threadIdx.x; j < codes_at; j += blockDim.x)
      payload[j] = 0;
  }
  float *scales = reinterpret_cast<float *>(payload + kLossyPreamble);
  // The payload is 16-byte aligned and so are its codes: groups of kVector elements that start
  // a block's group (block sizes a multiple of kVector) are aligned too where the input is.
  const uint32_t key = lowbias32(seed);
  if (block_size % kVector == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0)
    encode_blocks<C, kVector>(in, numel, block_size, key, scales, payload + codes_at, true);
  else  // pairs, element by element: blocks hold an even number of elements
    encode_blocks<C, 2>(in, numel, block_size, key, scales, payload + codes_at, false);
}

// Groups of N elements, one a thread (N elements in one quantization block: block sizes are
// even and, where `vector`, a multiple of N).
template <int C, int N, typename T>
__device__ void decode_groups(const uint8_t *codes, const float *scales, uint64_t numel,
                              uint32_t block_size, T *out, bool vector) {
  for (uint64_t i = N * (blockIdx.x * uint64_t{blockDim.x} + threadIdx.x); i < numel;
       i += N * uint64_t{gridDim.x} * blockDim.x) {
    const int n = static_cast<int>(min(uint64_t{N}, numel - i));
    int8_t q[N];
    load_codes<C, N>(codes, i, n, vector, q);
    const float scale = scales[static_cast<uint32_t>(i) / block_size];  // numel < 2**32
    T y[N];
    for (int k = 0; k < N; ++k) y[k] = store_float<T>(dequantize<C>(q[k], scale));
    if constexpr (N * sizeof(T) == 16) {
      if (vector && n == N) {
        uint4 raw;
        memcpy(&raw, y, 16);
        *reinterpret_cast<uint4 *>(out + i) = raw;
        continue;
      }
    }
    for (int k = 0; k < n; ++k) out[i + k] = y[k];
  }
}

template <int C, typename T>
__global__ void lossy_decode(const uint8_t *payload, uint64_t payload_nbytes, uint64_t numel,
                             T *out) {
  constexpr int kVector = 16 / sizeof(T);
  const uint32_t block_size = *reinterpret_cast<const uint32_t *>(payload);
  const bool valid = block_size >= 2 && block_size % 2 == 0 &&
                     lossy_payload_bytes(C, numel, block_size) == payload_nbytes;
  if (!valid) {  // a damaged payload: NaNs, nothing read past its preamble
    for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < numel;
         i += uint64_t{gridDim.x} * blockDim.x)
      out[i] = store_float<T>(nanf(""));
    return;
  }
  const float *scales = reinterpret_cast<const float *>(payload + kLossyPreamble);
  const uint8_t *codes = payload + lossy_codes_offset(numel, block_size);
  if (block_size % kVector == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0)
    decode_groups<C, kVector>(codes, scales, numel, block_size, out, true);
  else
    decode_groups<C, 2>(codes, scales, numel, block_size, out, false);
}

}  // namespace
