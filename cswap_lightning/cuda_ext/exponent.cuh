// The exponent codec's kernels (lossless, bfloat16): part of cswap_codec.cu's one translation
// unit. Format: cswap_lightning/codecs/format.py. A warp takes a group of 32 elements, lane i
// element i: the warp's min and max give the group's base and width, and each of the group's
// bit planes is one __ballot_sync. Groups are placed through a prefix over tiles of
// kExpTileGroups groups: each tile's planes are summed, one warp scans the sums, and each tile
// scans its own groups' widths again in shared memory.
#pragma once

#include "codec_common.cuh"

namespace {

constexpr uint32_t kExpGroup = 32;         // elements per group
constexpr uint32_t kExpTileGroups = 256;  // groups per tile

struct ExpLayout {
  uint64_t numel, groups, ntiles;
  uint64_t base_at, width_at, planes_at;  // payload offsets of the sections
};

__host__ __device__ inline ExpLayout exp_layout(uint64_t numel) {
  ExpLayout l;
  l.numel = numel;
  l.groups = cdiv(numel, kExpGroup);
  l.ntiles = l.groups ? cdiv(l.groups, kExpTileGroups) : 1;
  l.base_at = 16 + align16(numel);
  l.width_at = l.base_at + align16(l.groups);
  l.planes_at = l.width_at + align16(l.groups);
  return l;
}

// The workspace (zvc's, cswap_workspace_bytes: 4 bytes per group, more than enough) holds one
// u32 per tile: its planes, then, scanned, the planes before it.

__device__ inline uint32_t exp_bit_width(uint32_t x) { return x ? 32 - __clz(x) : 0; }

__device__ inline uint32_t warp_min(uint32_t v) {
  for (int d = 16; d; d >>= 1) v = min(v, __shfl_xor_sync(kFull, v, d));
  return v;
}

__device__ inline uint32_t warp_max(uint32_t v) {
  for (int d = 16; d; d >>= 1) v = max(v, __shfl_xor_sync(kFull, v, d));
  return v;
}

// Each group's base and width, each element's sign and mantissa byte.
__global__ void exp_encode_groups(const uint16_t *in, uint8_t *payload, ExpLayout l) {
  const uint32_t lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (uint64_t g = uint64_t{blockIdx.x} * warps + threadIdx.x / 32; g < l.groups;
       g += uint64_t{gridDim.x} * warps) {
    const uint64_t i = g * kExpGroup + lane;
    const bool valid = i < l.numel;
    const uint32_t u = valid ? in[i] : 0;
    const uint32_t e = (u >> 7) & 0xFF;
    if (valid) payload[16 + i] = static_cast<uint8_t>(((u >> 8) & 0x80) | (u & 0x7F));
    const uint32_t lo = warp_min(valid ? e : 0xFF), hi = warp_max(valid ? e : 0);
    if (lane == 0) {
      payload[l.base_at + g] = static_cast<uint8_t>(lo);
      payload[l.width_at + g] = static_cast<uint8_t>(exp_bit_width(hi - lo));
    }
  }
}

// A tile's groups' widths (at most 8 each: a malformed payload's are cut there).
__device__ inline uint32_t exp_width(const uint8_t *payload, const ExpLayout &l, uint64_t g) {
  return min(uint32_t{payload[l.width_at + g]}, 8u);
}

// tiles[t] = the planes of tile t.
__global__ void exp_tile_planes(const uint8_t *payload, uint32_t *tiles, ExpLayout l) {
  const uint32_t lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (uint64_t t = uint64_t{blockIdx.x} * warps + threadIdx.x / 32; t < l.ntiles;
       t += uint64_t{gridDim.x} * warps) {
    uint32_t sum = 0;
    for (uint64_t g = t * kExpTileGroups + lane; g < l.groups && g < (t + 1) * kExpTileGroups;
         g += 32)
      sum += exp_width(payload, l, g);
    for (int d = 16; d; d >>= 1) sum += __shfl_xor_sync(kFull, sum, d);
    if (lane == 0) tiles[t] = sum;
  }
}

// One warp: tiles[] scanned in place (exclusive); with `preamble`, the total and a zero word
// written there (nplanes, reserved) and the payload's length to `*nbytes` (if not null).
__global__ void exp_scan_tiles(uint32_t *tiles, uint64_t ntiles, uint8_t *preamble,
                               int64_t *nbytes, uint64_t planes_at) {
  const uint32_t lane = threadIdx.x;
  if (lane >= 32) return;
  const uint64_t per = cdiv(ntiles, 32), from = lane * per;
  const uint64_t to = from + per < ntiles ? from + per : ntiles;
  uint32_t sum = 0;
  for (uint64_t t = from; t < to; ++t) sum += tiles[t];
  uint32_t before = sum;
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t other = __shfl_up_sync(kFull, before, d);
    if (lane >= static_cast<uint32_t>(d)) before += other;
  }
  const uint32_t total = __shfl_sync(kFull, before, 31);
  before -= sum;
  for (uint64_t t = from; t < to; ++t) {
    const uint32_t own = tiles[t];
    tiles[t] = before;
    before += own;
  }
  if (preamble && lane == 0) {
    reinterpret_cast<uint64_t *>(preamble)[0] = total;
    reinterpret_cast<uint64_t *>(preamble)[1] = 0;
    if (nbytes) *nbytes = static_cast<int64_t>(planes_at + 4 * uint64_t{total});
  }
}

// first[k] = the planes before group k of tile `t` (its prefix in tiles[] included), by warp 0.
__device__ inline void exp_tile_offsets(const uint8_t *payload, const uint32_t *tiles,
                                        const ExpLayout &l, uint64_t t, uint32_t *first) {
  if (threadIdx.x >= 32) return;
  const uint32_t lane = threadIdx.x, per = kExpTileGroups / 32;
  const uint64_t g0 = t * kExpTileGroups + lane * per;
  uint32_t sum = 0;
  for (uint32_t k = 0; k < per; ++k)
    if (g0 + k < l.groups) sum += exp_width(payload, l, g0 + k);
  uint32_t before = sum;
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t other = __shfl_up_sync(kFull, before, d);
    if (lane >= static_cast<uint32_t>(d)) before += other;
  }
  before += tiles[t] - sum;
  for (uint32_t k = 0; k < per; ++k) {
    first[lane * per + k] = before;
    if (g0 + k < l.groups) before += exp_width(payload, l, g0 + k);
  }
}

// Calls f(g, first) in a warp for each group g, `first` the planes before it: a block per tile.
template <typename F>
__device__ inline void exp_each_group(const uint8_t *payload, const uint32_t *tiles,
                                      const ExpLayout &l, F &&f) {
  __shared__ uint32_t first[kExpTileGroups];
  const uint32_t warps = blockDim.x / 32;
  for (uint64_t t = blockIdx.x; t < l.ntiles; t += gridDim.x) {
    exp_tile_offsets(payload, tiles, l, t, first);
    __syncthreads();
    for (uint32_t k = threadIdx.x / 32; k < kExpTileGroups; k += warps) {
      const uint64_t g = t * kExpTileGroups + k;
      if (g >= l.groups) break;
      f(g, first[k]);
    }
    __syncthreads();  // `first` is the next tile's
  }
}

// Each group's bit planes.
__global__ void exp_encode_planes(const uint16_t *in, uint8_t *payload, const uint32_t *tiles,
                                  ExpLayout l) {
  const uint32_t lane = threadIdx.x % 32;
  auto *planes = reinterpret_cast<uint32_t *>(payload + l.planes_at);
  exp_each_group(payload, tiles, l, [&](uint64_t g, uint32_t first) {
    const uint64_t i = g * kExpGroup + lane;
    const uint32_t base = payload[l.base_at + g], width = exp_width(payload, l, g);
    const uint32_t offset = (i < l.numel ? (in[i] >> 7) & 0xFF : base) - base;
    for (uint32_t j = 0; j < width; ++j) {
      const uint32_t word = __ballot_sync(kFull, (offset >> j) & 1);
      if (lane == j) planes[first + j] = word;
    }
  });
}

// The elements back; planes past the payload's `nplanes` read as zero.
__global__ void exp_decode(const uint8_t *payload, uint64_t nplanes, const uint32_t *tiles,
                           uint16_t *out, ExpLayout l) {
  const uint32_t lane = threadIdx.x % 32;
  const auto *planes = reinterpret_cast<const uint32_t *>(payload + l.planes_at);
  exp_each_group(payload, tiles, l, [&](uint64_t g, uint32_t first) {
    const uint32_t width = exp_width(payload, l, g);
    uint32_t offset = 0;
    for (uint32_t j = 0; j < width; ++j) {
      const uint64_t at = uint64_t{first} + j;
      offset |= (((at < nplanes ? planes[at] : 0) >> lane) & 1) << j;
    }
    const uint64_t i = g * kExpGroup + lane;
    if (i < l.numel) {
      const uint32_t r = payload[16 + i], e = (payload[l.base_at + g] + offset) & 0xFF;
      out[i] = static_cast<uint16_t>(((r & 0x80) << 8) | (e << 7) | (r & 0x7F));
    }
  });
}

}  // namespace
