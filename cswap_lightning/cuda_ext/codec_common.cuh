// What the codecs' kernels and host code share: part of cswap_codec.cu's one translation unit.
#pragma once

#include "cswap_codec.h"

#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

namespace {

constexpr unsigned kFull = 0xffffffffu;

__host__ __device__ inline uint64_t cdiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline uint64_t align16(uint64_t n) { return (n + 15) & ~uint64_t{15}; }

}  // namespace
