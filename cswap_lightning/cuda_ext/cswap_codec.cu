// The CUDA codec library: the host side of cswap_codec.h's entry points, which check their
// arguments and launch the kernels of compaction.cuh (zvc, rle), exponent.cuh (exponent) and
// lossy.cuh (int8, fp8, int4). One translation unit: the headers are included here, never
// built on their own.

#include "compaction.cuh"
#include "exponent.cuh"
#include "lossy.cuh"

namespace {

thread_local char g_last_error[512] = "";

int fail(int status, const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return status;
}

template <typename T>
struct TypeTag {
  using type = T;
};

struct Launch {
  uint64_t numel;
  uint32_t ntiles;
  uint32_t grid;  // no more blocks than tiles
  uint32_t block;
  size_t stage_bytes;  // dynamic shared memory of the kernels that stage their output
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
  const uint64_t tile_elems = static_cast<uint64_t>(block) * kTileBytesPerThread / elem_size;
  const uint64_t ntiles = numel ? cdiv(numel, tile_elems) : 1;
  launch->numel = numel;
  launch->ntiles = static_cast<uint32_t>(ntiles);
  launch->grid = static_cast<uint32_t>(ntiles < static_cast<uint64_t>(grid) ? ntiles : grid);
  launch->block = static_cast<uint32_t>(block);
  launch->stage_bytes = uint64_t{launch->block} * kTileBytesPerThread;
  return CSWAP_OK;
}

int check_capacity(uint64_t capacity, uint64_t need) {
  if (capacity < need)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "payload buffer has %llu bytes, needs %llu",
                static_cast<unsigned long long>(capacity), static_cast<unsigned long long>(need));
  return CSWAP_OK;
}

int check_exponent(uint64_t numel, int elem_size, int grid, int block, const void *elems,
                   const void *payload, const void *workspace, uint64_t workspace_bytes) {
  if (elem_size != 2)
    return fail(CSWAP_ERR_INVALID_ARGUMENT, "the exponent codec packs bfloat16 (elem_size 2), "
                "got elem_size %d", elem_size);
  Launch unused;  // its launches are sized by its own tiles; the workspace is zvc's
  return check_common(numel, elem_size, grid, block, elems, payload, workspace, workspace_bytes,
                      &unused);
}

int check_launches(const char *what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return fail(CSWAP_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err),
                cudaGetErrorName(err));
  return CSWAP_OK;
}

// The workspace: the tile counter, the tiles' states (`state_words` each), then (rle decode)
// the toggle bitmap; `*zeroed` gets how many bytes from its start must start out zero.
CodecArgs workspace_args(const Launch &l, void *workspace, int state_words, bool with_toggles,
                         uint64_t *zeroed) {
  auto *base = static_cast<uint8_t *>(workspace);
  const uint64_t toggles_at = kWorkspaceHeader + align16(8ull * state_words * l.ntiles);
  CodecArgs args{};
  args.numel = l.numel;
  args.ntiles = l.ntiles;
  args.counter = reinterpret_cast<uint32_t *>(base);
  args.states = reinterpret_cast<uint64_t *>(base + kWorkspaceHeader);
  args.toggles = reinterpret_cast<uint32_t *>(base + toggles_at);
  *zeroed = toggles_at + (with_toggles ? 4 * cdiv(l.numel, 32) : 0);
  return args;
}

// Calls f(TypeTag<unsigned type of elem_size bytes>, std::bool_constant<aligned16>).
template <typename F>
void dispatch_bits(int elem_size, bool aligned16, F &&f) {
  auto by_alignment = [&](auto tag) {
    if (aligned16)
      f(tag, std::true_type{});
    else
      f(tag, std::false_type{});
  };
  switch (elem_size) {
    case 1:
      by_alignment(TypeTag<uint8_t>{});
      break;
    case 2:
      by_alignment(TypeTag<uint16_t>{});
      break;
    case 4:
      by_alignment(TypeTag<uint32_t>{});
      break;
    default:
      by_alignment(TypeTag<unsigned long long>{});
      break;
  }
}

template <typename T, bool kAligned>
void zvc_compress(const Launch &l, const T *in, const CodecArgs &args, cudaStream_t stream) {
  zvc_encode<T, kAligned><<<l.grid, l.block, l.stage_bytes, stream>>>(in, args);
}

template <typename T, bool kAligned>
void rle_compress(const Launch &l, const T *in, const CodecArgs &args, cudaStream_t stream) {
  rle_encode_scan<T, kAligned><<<l.grid, l.block, 0, stream>>>(in, args);
  rle_encode_scatter<T, kAligned><<<l.grid, l.block, l.stage_bytes, stream>>>(in, args);
}

template <typename T, bool kAligned, bool kRle>
void decompress(const Launch &l, const CodecArgs &args, T *out, cudaStream_t stream) {
  if (kRle) {
    rle_decode_toggles<<<l.grid, l.block, 0, stream>>>(args.payload, args.payload_nbytes, l.numel,
                                                       args.toggles);
  }
  decode<T, kAligned, kRle><<<l.grid, l.block, l.stage_bytes, stream>>>(args, out);
}

int compress(int codec, const void *input, uint64_t numel, int elem_size, void *payload,
             uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
             uint64_t workspace_bytes, int grid, int block, cudaStream_t stream) {
  Launch launch;
  int status = check_common(numel, elem_size, grid, block, input, payload, workspace,
                            workspace_bytes, &launch);
  if (status != CSWAP_OK) return status;
  status = check_capacity(payload_capacity, cswap_max_payload_bytes(codec, numel, elem_size));
  if (status != CSWAP_OK) return status;
  cudaGetLastError();  // report only errors of this call's launches
  const bool zvc = codec == CSWAP_CODEC_ZVC;
  uint64_t zeroed;
  CodecArgs args = workspace_args(launch, workspace, zvc ? NonzeroCount::N : RunCount::N, false,
                                  &zeroed);
  args.payload = static_cast<uint8_t *>(payload);
  args.nbytes_out = payload_nbytes;
  const char *what = zvc ? "zvc compress" : "rle compress";
  if (cudaMemsetAsync(workspace, 0, zeroed, stream) != cudaSuccess) return check_launches(what);
  dispatch_bits(elem_size, aligned(input, 16), [&](auto tag, auto aligned16) {
    using T = typename decltype(tag)::type;
    const T *in = static_cast<const T *>(input);
    if (zvc)
      zvc_compress<T, decltype(aligned16)::value>(launch, in, args, stream);
    else
      rle_compress<T, decltype(aligned16)::value>(launch, in, args, stream);
  });
  return check_launches(what);
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
  const bool zvc = codec == CSWAP_CODEC_ZVC;
  uint64_t zeroed;
  CodecArgs args = workspace_args(launch, workspace, zvc ? NonzeroCount::N : RunState::N, !zvc,
                                  &zeroed);
  args.payload = const_cast<uint8_t *>(static_cast<const uint8_t *>(payload));  // only read
  args.payload_nbytes = payload_nbytes;
  const char *what = zvc ? "zvc decompress" : "rle decompress";
  if (cudaMemsetAsync(workspace, 0, zeroed, stream) != cudaSuccess) return check_launches(what);
  dispatch_bits(elem_size, aligned(output, 16), [&](auto tag, auto aligned16) {
    using T = typename decltype(tag)::type;
    T *out = static_cast<T *>(output);
    if (zvc)
      decompress<T, decltype(aligned16)::value, false>(launch, args, out, stream);
    else
      decompress<T, decltype(aligned16)::value, true>(launch, args, out, stream);
  });
  return check_launches(what);
}

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
  if (codec == CSWAP_CODEC_EXPONENT && elem_size == 2) {
    const ExpLayout l = exp_layout(numel);
    return l.planes_at + 4 * 8 * l.groups;
  }
  return 0;
}

uint64_t cswap_workspace_bytes(uint64_t numel, int grid) {
  (void)grid;  // tiles are claimed by however many blocks run: the grid sizes nothing here
  const uint64_t max_tiles = numel ? cdiv(numel, kMinTileElems) : 1;
  return kWorkspaceHeader + align16(8 * kMaxSummaryWords * max_tiles) +
         align16(4 * cdiv(numel, 32));
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
  status = check_capacity(payload_capacity, lossy_payload_bytes(codec, numel, block_size));
  if (status != CSWAP_OK) return status;
  cudaGetLastError();  // report only errors of this call's launches
  const uint32_t blocks = clamp_grid(cdiv(cdiv(numel, block_size), block / 32), grid);
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
  const uint32_t blocks = clamp_grid(cdiv(cdiv(numel, 2), block), grid);  // 2+ elements a thread
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

int cswap_exponent_compress(const void *input, uint64_t numel, int elem_size, void *payload,
                            uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
                            uint64_t workspace_bytes, int grid, int block, cudaStream_t stream) {
  int status = check_exponent(numel, elem_size, grid, block, input, payload, workspace,
                              workspace_bytes);
  if (status != CSWAP_OK) return status;
  status = check_capacity(payload_capacity,
                          cswap_max_payload_bytes(CSWAP_CODEC_EXPONENT, numel, elem_size));
  if (status != CSWAP_OK) return status;
  cudaGetLastError();  // report only errors of this call's launches
  const ExpLayout l = exp_layout(numel);
  auto *out = static_cast<uint8_t *>(payload);
  auto *tiles = static_cast<uint32_t *>(workspace);
  const auto *in = static_cast<const uint16_t *>(input);
  const unsigned blocks = static_cast<unsigned>(l.ntiles < uint64_t(grid) ? l.ntiles : grid);
  // the padding after the elements' bytes, and the base and width sections, start out zero
  if (cudaMemsetAsync(out + 16 + numel, 0, l.planes_at - 16 - numel, stream) != cudaSuccess)
    return check_launches("exponent compress");
  exp_encode_groups<<<blocks, block, 0, stream>>>(in, out, l);
  exp_tile_planes<<<blocks, block, 0, stream>>>(out, tiles, l);
  exp_scan_tiles<<<1, 32, 0, stream>>>(tiles, l.ntiles, out, payload_nbytes, l.planes_at);
  exp_encode_planes<<<blocks, block, 0, stream>>>(in, out, tiles, l);
  return check_launches("exponent compress");
}

int cswap_exponent_decompress(const void *payload, uint64_t payload_nbytes, void *output,
                              uint64_t numel, int elem_size, void *workspace,
                              uint64_t workspace_bytes, int grid, int block, cudaStream_t stream) {
  int status = check_exponent(numel, elem_size, grid, block, output, payload, workspace,
                              workspace_bytes);
  if (status != CSWAP_OK) return status;
  const ExpLayout l = exp_layout(numel);
  if (payload_nbytes < l.planes_at || (payload_nbytes - l.planes_at) % 4 != 0)
    return fail(CSWAP_ERR_INVALID_ARGUMENT,
                "an exponent payload of %llu elements has %llu + 4 * (its planes) bytes, got %llu",
                static_cast<unsigned long long>(numel),
                static_cast<unsigned long long>(l.planes_at),
                static_cast<unsigned long long>(payload_nbytes));
  cudaGetLastError();
  const auto *in = static_cast<const uint8_t *>(payload);
  auto *tiles = static_cast<uint32_t *>(workspace);
  const unsigned blocks = static_cast<unsigned>(l.ntiles < uint64_t(grid) ? l.ntiles : grid);
  exp_tile_planes<<<blocks, block, 0, stream>>>(in, tiles, l);
  exp_scan_tiles<<<1, 32, 0, stream>>>(tiles, l.ntiles, nullptr, nullptr, 0);
  exp_decode<<<blocks, block, 0, stream>>>(in, (payload_nbytes - l.planes_at) / 4, tiles,
                                           static_cast<uint16_t *>(output), l);
  return check_launches("exponent decompress");
}

}  // extern "C"
