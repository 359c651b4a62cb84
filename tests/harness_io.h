// Whole-file reads and writes for the codec test harnesses (lossy_host_harness.cu,
// emulated_codec_harness.cpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <vector>

namespace harness_io {

inline std::vector<uint8_t> read_all(const char *path) {
  std::vector<uint8_t> data;
  FILE *f = fopen(path, "rb");
  if (!f) return data;
  for (int c; (c = fgetc(f)) != EOF;) data.push_back(static_cast<uint8_t>(c));
  fclose(f);
  return data;
}

inline bool write_all(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return false;
  bool ok = fwrite(data, 1, n, f) == n;
  return fclose(f) == 0 && ok;
}

}  // namespace harness_io
