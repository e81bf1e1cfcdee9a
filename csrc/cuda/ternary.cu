// CUDA kernels of the ternary kind (specification: commpress/spec/ternary.py; float32 only),
// with C launchers (declared in launchers.h). Plain CUDA: `nvcc -c -I csrc/include` compiles it.
//
// Encode is three launches, the first two those of the int8 / int4 encode (blockint_amax.cuh)
// with q_max = 1, so the scales are the amax itself:
//   1. amax: one warp per chunk of a block, combined by atomicMax; NaN/Inf sets flags bit 1;
//   2. finalize: s_b = amax_b / 1 (flags bit 2 never fires for float32 at q_max = 1);
//   3. levels: one thread per output byte, the fields of its five elements by
//      blockint_field_sr (codec_cores.h, the core of the CPU kernels) with element i's uniform
//      rng_u24_paired(key, i), i the global index, so any thread layout draws the CPU kernel's
//      numbers; field 1 (level 0) past the last element, up to the padded end of the last
//      block. It reads the flags first and writes nothing when the input was invalid.
// Decode: one thread per element, (digit - 1) * s_b, the product as it is (no -0 to +0).
#include <cuda_runtime.h>

#include <cstdint>

#include "block_sums.cuh"
#include "blockint_amax.cuh"
#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.cuh"
#include "launchers.h"

namespace commpress {
namespace cuda {
namespace {

// block: the layout's (a block longer than the tensor is its length: the same block index for
// every element). nbytes: the packed bytes of the padded blocks.
__global__ void ternary_encode_kernel(const float* __restrict__ x,
                                      const float* __restrict__ scales, int64_t n,
                                      int64_t block, int64_t nbytes, uint64_t key,
                                      uint8_t* __restrict__ packed,
                                      const int* __restrict__ flags) {
  if (*flags != 0) {
    return;  // invalid input: write nothing
  }
  for (int64_t q = global_thread(); q < nbytes; q += grid_stride()) {
    uint32_t f[kTernaryPerByte];
#pragma unroll
    for (int k = 0; k < kTernaryPerByte; ++k) {
      const int64_t i = q * kTernaryPerByte + k;
      f[k] = 1u;  // level 0 past the last element
      if (i < n) {
        const float s = scales[i / block];
        const float safe = s > 0.0f ? s : 1.0f;
        f[k] = blockint_field_sr<float>(x[i], safe, 1,
                                        rng_u24_paired(key, static_cast<uint64_t>(i)));
      }
    }
    packed[q] = ternary_byte(f[0], f[1], f[2], f[3], f[4]);
  }
}

__global__ void ternary_decode_kernel(const float* __restrict__ scales,
                                      const uint8_t* __restrict__ packed, int64_t n,
                                      int64_t block, float* __restrict__ out) {
  for (int64_t i = global_thread(); i < n; i += grid_stride()) {
    const uint32_t digit = ternary_digit(packed[i / kTernaryPerByte],
                                         static_cast<int>(i % kTernaryPerByte));
    out[i] = blockint_value<float>(digit, scales[i / block], 1);  // (digit - 1) * s
  }
}

}  // namespace
}  // namespace cuda
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code
extern "C" {

cudaError_t commpress_ternary_encode_sr_cuda(const float* x, int64_t n, int64_t block,
                                             int64_t nbytes, uint64_t seed, float* scales,
                                             uint8_t* packed, unsigned long long* amax,
                                             int* flags, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (n < 0 || block < 1 || nbytes < 0) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaMemsetAsync(flags, 0, sizeof(int), stream);
  if (err != cudaSuccess || n == 0) {
    return err;
  }
  const uint64_t key = commpress::rng_key(seed, commpress::kStreamBlockIntSR);
  const Layout l = make_layout(n, block);
  const int64_t chunks = amax_chunks(l.block);
  if (chunks > 1) {  // atomicMax starts from +0
    err = cudaMemsetAsync(amax, 0, sizeof(unsigned long long) * l.nblocks, stream);
    if (err != cudaSuccess) {
      return err;
    }
  }
  blockint_amax_kernel<float><<<grid(grid_warps(l.nblocks * chunks)), kThreads, 0, stream>>>(
      x, l, chunks, amax, flags);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  blockint_finalize_kernel<float><<<grid(grid_items(l.nblocks)), kThreads, 0, stream>>>(
      amax, l, 1, scales, flags);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  ternary_encode_kernel<<<grid(grid_items(nbytes)), kThreads, 0, stream>>>(
      x, scales, n, l.block, nbytes, key, packed, flags);
  return cudaGetLastError();
}

cudaError_t commpress_ternary_decode_cuda(const float* scales, const uint8_t* packed, int64_t n,
                                          int64_t block, float* out, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (n < 0 || block < 1) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) {
    return cudaSuccess;
  }
  const Layout l = make_layout(n, block);
  ternary_decode_kernel<<<grid(grid_items(n)), kThreads, 0, stream>>>(scales, packed, n, l.block,
                                                                      out);
  return cudaGetLastError();
}

}  // extern "C"
#endif  // __CUDACC_RTC__
