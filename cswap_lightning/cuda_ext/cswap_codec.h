/* cswap_codec: CUDA kernels for the zvc and rle payloads of cswap_lightning's packed format.
 *
 * The payload bytes are exactly those of the pure-torch reference codecs; the format is
 * specified in cswap_lightning/codecs/format.py. Elements are handled as bit patterns of
 * 1, 2, 4 or 8 bytes: an element is zero when all its bits are zero.
 *
 * Conventions for every entry point:
 *   - All pointers are device pointers on the current device. Input/output element buffers are
 *     aligned to elem_size; payload and workspace buffers are 16-byte aligned.
 *   - numel < 2**32. grid >= 1 blocks; block is a multiple of 32 in [32, 1024].
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

#define CSWAP_CODEC_ABI_VERSION 1 /* bumped on any change to these declarations */
#define CSWAP_FORMAT_VERSION 1    /* the packed-format version the kernels produce */

enum {
  CSWAP_OK = 0,
  CSWAP_ERR_INVALID_ARGUMENT = 1,
  CSWAP_ERR_CUDA = 2,
};

/* Codec ids as in the format's wire ids. */
enum { CSWAP_CODEC_ZVC = 1, CSWAP_CODEC_RLE = 2 };

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
/* Scratch device memory every call needs, for `numel` elements and `grid` blocks. */
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

#ifdef __cplusplus
}
#endif

#endif /* CSWAP_CODEC_H */
