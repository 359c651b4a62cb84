// Runs the kernels of cswap_codec.cu (compaction.cuh's and lossy.cuh's) on the CPU through
// kernel_emulator.h, behind a command line, so that tests/test_cuda_ext.py can compare their
// payloads with the reference codecs without a GPU (and, built with -fsanitize=address, catch
// accesses outside the buffers).
//
// The test writes `cswap_codec_emulated.cpp`, the .cu with its headers in place and its
// launches rewritten, into a folder on the include path, and builds this file with
// kernel_emulator.h force-included.
//
// Usage:
//   harness encode CODEC TYPE NUMEL GRID BLOCK SHIFT BLOCK_SIZE SEED IN OUT
//   harness decode CODEC TYPE NUMEL GRID BLOCK SHIFT IN OUT
//   harness lookback NTILES
//   harness < COMMANDS      (one of the above per line, without the program name)
// CODEC is the wire id; TYPE is the element size for zvc, rle and exponent (2), the dtype id
// for the lossy codecs. IN and OUT are raw bytes: elements or payload. The elements start SHIFT elements
// past a 16-byte boundary. Buffers are exactly as large as the API needs and start out as
// garbage, as device memory does. `lookback` checks the tiles' look-back alone (see
// check_look_back).

#include "cswap_codec_emulated.cpp"

#include <barrier>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "harness_io.h"

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#else
#define ASAN_POISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#define ASAN_UNPOISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#endif

namespace {

using harness_io::read_all;
using harness_io::write_all;

// `n` bytes of garbage at `shift` bytes past a 16-byte boundary; the address sanitizer sees
// any access past them.
struct Buffer {
  uint8_t *base, *p;
  uint64_t size, slack;
  explicit Buffer(uint64_t n, uint64_t shift = 0)
      : size(shift + n), slack((shift + n + 16) / 16 * 16 - shift - n) {
    base = static_cast<uint8_t *>(aligned_alloc(16, size + slack));
    p = base + shift;
    memset(base, 0xA5, size);
    ASAN_POISON_MEMORY_REGION(base + size, slack);
  }
  ~Buffer() {
    ASAN_UNPOISON_MEMORY_REGION(base + size, slack);
    free(base);
  }
};

bool lossy(int codec) {
  return codec == CSWAP_CODEC_INT8 || codec == CSWAP_CODEC_FP8 || codec == CSWAP_CODEC_INT4;
}

int elem_size(int codec, int type) {
  return lossy(codec) ? (type == CSWAP_DTYPE_FLOAT32 ? 4 : 2) : type;
}

int check(int status) {
  if (status != CSWAP_OK)
    fprintf(stderr, "%s: %s\n", cswap_status_string(status), cswap_last_error());
  return status;
}

int encode(int codec, int type, uint64_t numel, int grid, int block, int shift,
           uint32_t block_size, uint32_t seed, const char *in_path, const char *out_path) {
  const std::vector<uint8_t> data = read_all(in_path);
  if (data.size() != numel * elem_size(codec, type)) return 2;
  Buffer in(data.size(), shift * elem_size(codec, type));
  if (!data.empty()) memcpy(in.p, data.data(), data.size());
  const void *input = numel ? in.p : nullptr;
  if (lossy(codec)) {
    const uint64_t nbytes = cswap_lossy_payload_bytes(codec, numel, block_size);
    Buffer payload(nbytes);
    if (check(cswap_lossy_compress(codec, input, numel, type, block_size, seed, payload.p, nbytes,
                                   grid, block, nullptr)))
      return 1;
    return write_all(out_path, payload.p, nbytes) ? 0 : 1;
  }
  const uint64_t capacity = cswap_max_payload_bytes(codec, numel, type);
  const uint64_t ws_bytes = cswap_workspace_bytes(numel, grid);
  Buffer payload(capacity), workspace(ws_bytes), nbytes(8);
  auto compress = codec == CSWAP_CODEC_ZVC   ? cswap_zvc_compress
                  : codec == CSWAP_CODEC_RLE ? cswap_rle_compress
                                             : cswap_exponent_compress;
  if (check(compress(input, numel, type, payload.p, capacity, reinterpret_cast<int64_t *>(nbytes.p),
                     workspace.p, ws_bytes, grid, block, nullptr)))
    return 1;
  int64_t n;
  memcpy(&n, nbytes.p, 8);
  if (n < 0 || static_cast<uint64_t>(n) > capacity) return 3;
  return write_all(out_path, payload.p, n) ? 0 : 1;
}

int decode(int codec, int type, uint64_t numel, int grid, int block, int shift,
           const char *in_path, const char *out_path) {
  const std::vector<uint8_t> data = read_all(in_path);
  Buffer payload(data.size()), out(numel * elem_size(codec, type), shift * elem_size(codec, type));
  if (!data.empty()) memcpy(payload.p, data.data(), data.size());
  void *output = numel ? out.p : nullptr;
  if (lossy(codec)) {
    if (check(cswap_lossy_decompress(codec, payload.p, data.size(), output, numel, type, grid,
                                     block, nullptr)))
      return 1;
  } else {
    const uint64_t ws_bytes = cswap_workspace_bytes(numel, grid);
    Buffer workspace(ws_bytes);
    auto decompress = codec == CSWAP_CODEC_ZVC   ? cswap_zvc_decompress
                      : codec == CSWAP_CODEC_RLE ? cswap_rle_decompress
                                                 : cswap_exponent_decompress;
    if (check(decompress(payload.p, data.size(), output, numel, type, workspace.p, ws_bytes, grid,
                         block, nullptr)))
      return 1;
  }
  return write_all(out_path, out.p, numel * elem_size(codec, type)) ? 0 : 1;
}

// A made-up summary of each tile, the same on every call.
template <typename S>
S made_up(uint32_t tile) {
  S s;
  for (int i = 0; i < S::N; ++i) s.v[i] = lowbias32(tile * S::N + i) % 1000;
  if constexpr (std::is_same_v<S, RunState>) s.v[RunState::kParity] &= 1;
  return s;
}

// Tiles 0..ntiles-1, one block of one warp each, all running at once: each publishes its
// summary, waits until every other tile has started, then looks back. Every third tile holds
// its aggregate back a while, so that others wait on it; the look-backs see aggregates, not
// prefixes, and walk back over several windows of 32 tiles. True if every tile's exclusive
// prefix is the in-order combination of the summaries before it (combine is not commutative
// for RunState).
template <typename S>
bool check_look_back(uint32_t ntiles) {
  std::vector<uint64_t> words(uint64_t{ntiles} * S::N, 0);
  const TileStates<S> states{words.data()};
  std::vector<S> found(ntiles);
  std::barrier started(ntiles);
  emu::launch(emu::Config(ntiles, 32), [&] {
    const uint32_t tile = blockIdx.x;
    const bool late = tile % 3 == 1;
    if (threadIdx.x == 0) {
      if (!late && tile > 0) states.publish(tile, kAggregate, made_up<S>(tile));
      started.arrive_and_wait();
      if (late) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        states.publish(tile, kAggregate, made_up<S>(tile));
      }
    }
    __syncthreads();
    const S before = scan_tile(states, tile, made_up<S>(tile));
    if (threadIdx.x == 0) found[tile] = before;
  });
  S expected = {};
  for (uint32_t tile = 0; tile < ntiles; ++tile) {
    if (memcmp(&found[tile], &expected, sizeof(S)) != 0) {
      fprintf(stderr, "look-back: tile %u of %u has a wrong exclusive prefix\n", tile, ntiles);
      return false;
    }
    expected = S::combine(expected, made_up<S>(tile));
  }
  return true;
}

// One command: its words after the program name in the usage above.
int command(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[0], "lookback") == 0) {
    const auto ntiles = static_cast<uint32_t>(strtoul(argv[1], nullptr, 10));
    const bool ok = check_look_back<NonzeroCount>(ntiles) && check_look_back<RunCount>(ntiles) &&
                    check_look_back<RunState>(ntiles);
    return ok ? 0 : 1;
  }
  const bool enc = argc == 11 && strcmp(argv[0], "encode") == 0;
  const bool dec = argc == 9 && strcmp(argv[0], "decode") == 0;
  if (!enc && !dec) return 2;
  const int codec = atoi(argv[1]), type = atoi(argv[2]);
  const uint64_t numel = strtoull(argv[3], nullptr, 10);
  const int grid = atoi(argv[4]), block = atoi(argv[5]), shift = atoi(argv[6]);
  if (dec) return decode(codec, type, numel, grid, block, shift, argv[7], argv[8]);
  const auto block_size = static_cast<uint32_t>(strtoul(argv[7], nullptr, 10));
  const auto seed = static_cast<uint32_t>(strtoul(argv[8], nullptr, 10));
  return encode(codec, type, numel, grid, block, shift, block_size, seed, argv[9], argv[10]);
}

}  // namespace

// With arguments: runs that command. Without: runs the commands of stdin's lines, one by one,
// and stops at the first that fails (one process saves starting a thread per CUDA thread anew).
int main(int argc, char **argv) {
  if (argc > 1) {
    const int status = command(argc - 1, argv + 1);
    if (status == 2)
      fprintf(stderr,
              "usage: %s encode CODEC TYPE NUMEL GRID BLOCK SHIFT BLOCK_SIZE SEED IN OUT\n"
              "       %s decode CODEC TYPE NUMEL GRID BLOCK SHIFT IN OUT\n"
              "       %s lookback NTILES\n"
              "       %s < COMMANDS\n",
              argv[0], argv[0], argv[0], argv[0]);
    return status;
  }
  char line[8192];
  while (fgets(line, sizeof(line), stdin)) {
    std::vector<char *> words;
    for (char *w = strtok(line, " \t\n"); w; w = strtok(nullptr, " \t\n")) words.push_back(w);
    if (words.empty()) continue;
    const int status = command(static_cast<int>(words.size()), words.data());
    if (status != 0) {
      fprintf(stderr, "command %s failed with status %d\n", words[0], status);
      return status;
    }
  }
  return 0;
}
