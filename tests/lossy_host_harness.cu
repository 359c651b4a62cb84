// Runs the lossy codecs' element math of lossy.cuh (hash, scale, rounding, codes) on the
// host, so that a machine without a GPU can check it bit for bit against the pure-torch
// reference. The loops below visit the elements as the kernels do, one block at a time; the
// kernels themselves are checked by the gpu-marked tests.
//
// Usage: harness CODEC BLOCK_SIZE SEED IN OUT_PAYLOAD OUT_DECODED
//   IN: float32 elements; OUT_PAYLOAD: the payload; OUT_DECODED: its float32 decoding.

#include "cswap_codec.cu"

#include <cstdlib>
#include <vector>

#include "harness_io.h"

namespace {

using harness_io::read_all;
using harness_io::write_all;

template <int C>
std::vector<uint8_t> encode(const std::vector<float> &x, uint32_t block_size, uint32_t seed) {
  const uint64_t numel = x.size(), nblocks = cdiv(numel, block_size);
  std::vector<uint8_t> payload(lossy_payload_bytes(C, numel, block_size), 0);
  uint32_t preamble[4];
  lossy_preamble<C>(block_size, seed, preamble);
  memcpy(payload.data(), preamble, sizeof(preamble));
  uint8_t *codes = payload.data() + lossy_codes_offset(numel, block_size);
  const uint32_t key = lowbias32(seed);
  for (uint64_t b = 0; b < nblocks; ++b) {
    const uint64_t first = b * block_size, end = std::min(first + block_size, numel);
    float absmax = 0.f;
    for (uint64_t i = first; i < end; ++i)
      if (std::isfinite(x[i])) absmax = fmaxf(absmax, fabsf(x[i]));
    const float scale = lossy_scale<C>(absmax);
    memcpy(payload.data() + kLossyPreamble + 4 * b, &scale, 4);
    for (uint64_t i = first; i < end; ++i) {
      const int8_t q = quantize<C>(x[i], scale, static_cast<uint32_t>(i), key);
      if (C == CSWAP_CODEC_INT4)
        codes[i / 2] |= static_cast<uint8_t>((q & 0xF) << (4 * (i % 2)));
      else
        codes[i] = static_cast<uint8_t>(q);
    }
  }
  return payload;
}

template <int C>
std::vector<float> decode(const std::vector<uint8_t> &payload, uint64_t numel) {
  uint32_t block_size;
  memcpy(&block_size, payload.data(), 4);
  const uint8_t *codes = payload.data() + lossy_codes_offset(numel, block_size);
  std::vector<float> out(numel);
  for (uint64_t i = 0; i < numel; ++i) {
    float scale;
    memcpy(&scale, payload.data() + kLossyPreamble + 4 * (i / block_size), 4);
    out[i] = dequantize<C>(code_at<C>(codes, i), scale);
  }
  return out;
}

template <int C>
int run(const std::vector<float> &x, uint32_t block_size, uint32_t seed, const char *payload_path,
        const char *decoded_path) {
  const std::vector<uint8_t> payload = encode<C>(x, block_size, seed);
  const std::vector<float> decoded = decode<C>(payload, x.size());
  bool ok = write_all(payload_path, payload.data(), payload.size()) &&
            write_all(decoded_path, decoded.data(), 4 * decoded.size());
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s CODEC BLOCK_SIZE SEED IN OUT_PAYLOAD OUT_DECODED\n", argv[0]);
    return 2;
  }
  const int codec = atoi(argv[1]);
  const auto block_size = static_cast<uint32_t>(strtoul(argv[2], nullptr, 10));
  const auto seed = static_cast<uint32_t>(strtoul(argv[3], nullptr, 10));
  const std::vector<uint8_t> raw = read_all(argv[4]);
  std::vector<float> x(raw.size() / 4);
  memcpy(x.data(), raw.data(), 4 * x.size());
  switch (codec) {
    case CSWAP_CODEC_INT8:
      return run<CSWAP_CODEC_INT8>(x, block_size, seed, argv[5], argv[6]);
    case CSWAP_CODEC_FP8:
      return run<CSWAP_CODEC_FP8>(x, block_size, seed, argv[5], argv[6]);
    case CSWAP_CODEC_INT4:
      return run<CSWAP_CODEC_INT4>(x, block_size, seed, argv[5], argv[6]);
    default:
      fprintf(stderr, "unknown codec %d\n", codec);
      return 2;
  }
}
