/* cswap_codec: CUDA kernels for the payloads of cswap_lightning's packed format: the lossless
 * zvc, rle and exponent codecs, and the lossy int8, fp8 and int4 codecs.
 *
 * The payload bytes are exactly those of the pure-torch reference codecs; the format is
 * specified in cswap_lightning/codecs/format.py. zvc and rle handle elements as bit patterns
 * of 1, 2, 4 or 8 bytes: an element is zero when all its bits are zero.
 *
 * Conventions for every entry point:
 *   - All pointers are device pointers on the current device. Input/output element buffers are
 *     aligned to elem_size; payload and workspace buffers are 16-byte aligned.
 *   - numel < 2**32. grid >= 1 blocks; block is a multiple of 32 in [32, 1024]. zvc and rle
 *     launch at most `grid` blocks, which take tiles of 32 * block bytes until none is left.
 *   - Work is enqueued on `stream`; no call synchronises the host with the device. Arguments are
 *     validated before anything is enqueued.
 *   - Return CSWAP_OK, CSWAP_ERR_INVALID_ARGUMENT or CSWAP_ERR_CUDA; after a failure,
 *     cswap_last_error() describes it (per host thread).
 */
#ifndef CSWAP_CODEC_H
#define CSWAP_CODEC_H

#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CSWAP_CODEC_ABI_VERSION 3 /* bumped on any change to these declarations */
#define CSWAP_FORMAT_VERSION 1    /* the packed-format version the kernels produce */

enum {
  CSWAP_OK = 0,
  CSWAP_ERR_INVALID_ARGUMENT = 1,
  CSWAP_ERR_CUDA = 2,
};

/* Codec ids as in the format's wire ids. */
enum {
  CSWAP_CODEC_ZVC = 1,
  CSWAP_CODEC_RLE = 2,
  CSWAP_CODEC_INT8 = 3,
  CSWAP_CODEC_FP8 = 4,
  CSWAP_CODEC_INT4 = 5,
  CSWAP_CODEC_EXPONENT = 6,
};

/* Element types of the lossy codecs, as in the format's dtype ids. */
enum { CSWAP_DTYPE_FLOAT32 = 0, CSWAP_DTYPE_FLOAT16 = 1, CSWAP_DTYPE_BFLOAT16 = 2 };

int cswap_abi_version(void);
int cswap_format_version(void);
/* A static description of a status code. */
const char *cswap_status_string(int status);
/* What went wrong in this host thread's last failed call ("" if none failed yet). */
const char *cswap_last_error(void);
/* CSWAP_OK if the CUDA runtime works and sees at least one device. */
int cswap_check_device(void);

/* Capacity the payload buffer of a compress call must have (an upper bound on the payload
 * size); 0 for an unknown codec or element size. */
uint64_t cswap_max_payload_bytes(int codec, uint64_t numel, int elem_size);
/* Scratch device memory every zvc and rle call needs for `numel` elements, whatever the grid
 * and block (`grid` is kept for the ABI; the size no longer depends on it). */
uint64_t cswap_workspace_bytes(uint64_t numel, int grid);

/* Compress `numel` elements at `input` into `payload` (capacity `payload_capacity` bytes).
 * The payload's exact byte length is written to the device int64 `*payload_nbytes` (may be
 * NULL); its counts are in the payload's 16-byte preamble. */
int cswap_zvc_compress(const void *input, uint64_t numel, int elem_size, void *payload,
                       uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
                       uint64_t workspace_bytes, int grid, int block, cudaStream_t stream);
int cswap_rle_compress(const void *input, uint64_t numel, int elem_size, void *payload,
                       uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
                       uint64_t workspace_bytes, int grid, int block, cudaStream_t stream);

/* Decompress a payload of `payload_nbytes` bytes into `numel` elements at `output`.
 * The counts are read on the device. A malformed payload yields unspecified element values
 * but never an access outside the payload, output or workspace buffers. */
int cswap_zvc_decompress(const void *payload, uint64_t payload_nbytes, void *output,
                         uint64_t numel, int elem_size, void *workspace, uint64_t workspace_bytes,
                         int grid, int block, cudaStream_t stream);
int cswap_rle_decompress(const void *payload, uint64_t payload_nbytes, void *output,
                         uint64_t numel, int elem_size, void *workspace, uint64_t workspace_bytes,
                         int grid, int block, cudaStream_t stream);

/* The exponent codec (CSWAP_CODEC_EXPONENT): lossless, bfloat16 only (elem_size 2), with the
 * signatures, payload length and workspace (cswap_workspace_bytes) of zvc's. */
int cswap_exponent_compress(const void *input, uint64_t numel, int elem_size, void *payload,
                            uint64_t payload_capacity, int64_t *payload_nbytes, void *workspace,
                            uint64_t workspace_bytes, int grid, int block, cudaStream_t stream);
int cswap_exponent_decompress(const void *payload, uint64_t payload_nbytes, void *output,
                              uint64_t numel, int elem_size, void *workspace,
                              uint64_t workspace_bytes, int grid, int block, cudaStream_t stream);

/* Lossy codecs (CSWAP_CODEC_INT8, _FP8, _INT4) on float32, float16 or bfloat16 elements.
 * Their payload size is a function of the codec, numel and the block size alone, so the host
 * allocates it up front; they need no workspace. */

/* The payload size; 0 for an unknown codec or a block size that is odd or below 2. */
uint64_t cswap_lossy_payload_bytes(int codec, uint64_t numel, uint32_t block_size);

/* Quantize `numel` elements of type `dtype` at `input` in blocks of `block_size` elements (even,
 * >= 2) into `payload` (capacity `payload_capacity` bytes, at least the size above). int8 and
 * int4 round stochastically with the noise of `seed`; fp8 rounds to nearest and records 0. */
int cswap_lossy_compress(int codec, const void *input, uint64_t numel, int dtype,
                         uint32_t block_size, uint32_t seed, void *payload,
                         uint64_t payload_capacity, int grid, int block, cudaStream_t stream);

/* Dequantize a payload of `payload_nbytes` bytes into `numel` elements of type `dtype` at
 * `output`. The block size is read on the device; a payload whose size does not match it
 * decodes to NaNs, with no access outside the payload and output buffers. */
int cswap_lossy_decompress(int codec, const void *payload, uint64_t payload_nbytes, void *output,
                           uint64_t numel, int dtype, int grid, int block, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* CSWAP_CODEC_H */
