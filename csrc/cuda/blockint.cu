// CUDA kernels of the int8 / int4 codecs (specification: commpress/spec/blockint.py), with C
// launchers (declared in launchers.h). Plain CUDA: `nvcc -c -I csrc/include` compiles it anywhere.
//
// Encode is three launches, like the CPU kernel's two steps per chunk:
//   1. amax: one warp per chunk of kAmaxChunk elements of a block reduces max |x| (in the
//      compute dtype) with shuffles and, when a block has several chunks, combines them by
//      atomicMax on the magnitude's bits (non-negative IEEE values order like their bit
//      patterns). A maximum has no order, so this is exactly the specification's amax. NaN/Inf
//      sets flags bit 1;
//   2. finalize: s_b = amax_b / q_max in CT, and flags bit 2 when q_max * s_b (the largest
//      decoded magnitude) is not finite in CT or in x's dtype (check_decodable);
//   3. fields: one warp per 32 elements, blockint_field of codec_cores.h per element (the core
//      the CPU kernels use), int4 pairs joined with one shuffle. It reads the flags first and
//      writes nothing when the input was invalid.
// The stochastic encode (blockint_encode_sr) differs only in pass 3: blockint_field_sr with
// element i's uniform rng_u24_paired(key, i) (include/commpress/rng.h), i the global index, so
// any thread layout draws the CPU kernel's numbers.
// Decode: one warp per 32 elements, blockint_value + decode_into per element.
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

// Stochastic: blockint_field_sr with the uniforms of `key` (unused otherwise).
template <class T, int Bits, bool Stochastic>
__global__ void blockint_encode_kernel(const T* __restrict__ x,
                                       const typename Elem<T>::compute* __restrict__ scales,
                                       Layout l, int qmax, uint64_t key,
                                       uint8_t* __restrict__ packed,
                                       const int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  if (*flags != 0) {
    return;  // invalid input: write nothing
  }
  const unsigned lane = lane_id();
  const int64_t nwords = (l.n + kWarp - 1) / kWarp;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < nwords; w += nwarps) {
    const int64_t first = w * kWarp;
    const int64_t i = first + lane;
    const int64_t b = lane_block(first, i < l.n ? i : l.n - 1, l);
    uint32_t f = 0;
    if (i < l.n) {
      const CT s = scales[b];
      const CT safe = s > CT(0) ? s : CT(1);
      if constexpr (Stochastic) {
        f = blockint_field_sr<CT>(Elem<T>::load(x[i]), safe, qmax,
                                  rng_u24_paired(key, static_cast<uint64_t>(i)));
      } else {
        f = blockint_field<CT>(Elem<T>::load(x[i]), safe, qmax);
      }
    }
    if constexpr (Bits == 8) {
      if (i < l.n) {
        packed[i] = static_cast<uint8_t>(f);
      }
    } else {
      // the odd lane's field is the high nibble of the even lane's byte (0 past the end: the
      // padding of the last byte stays zero)
      const uint32_t hi = __shfl_down_sync(kFullMask, f, 1);
      if ((lane & 1) == 0 && i < l.n) {
        packed[i >> 1] = static_cast<uint8_t>(f | (hi << 4));
      }
    }
  }
}

template <class T, int Bits, bool Accumulate>
__global__ void blockint_decode_kernel(const typename Elem<T>::compute* __restrict__ scales,
                                       const uint8_t* __restrict__ packed, Layout l, int qmax,
                                       T* __restrict__ out) {
  using CT = typename Elem<T>::compute;
  const int64_t nwords = (l.n + kWarp - 1) / kWarp;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < nwords; w += nwarps) {
    const int64_t first = w * kWarp;
    const int64_t i = first + lane_id();
    const int64_t b = lane_block(first, i < l.n ? i : l.n - 1, l);
    if (i < l.n) {
      const uint32_t f = Bits == 8 ? packed[i] : (packed[i >> 1] >> ((i & 1) * 4)) & 0xFu;
      out[i] = decode_into<Accumulate, T>(out[i], blockint_value<CT>(f, scales[b], qmax));
    }
  }
}

#ifndef __CUDACC_RTC__  // host code
bool valid_bits(int bits) { return bits == 4 || bits == 8; }
int qmax_of(int bits) { return bits == 8 ? 127 : 7; }

template <class T, int Bits, bool Stochastic>
cudaError_t blockint_encode(const void* xv, int64_t n, int64_t block, uint64_t key, void* scales,
                            uint8_t* packed, unsigned long long* amax, int* flags,
                            cudaStream_t stream) {
  using CT = typename Elem<T>::compute;
  const T* x = static_cast<const T*>(xv);
  CT* s = static_cast<CT*>(scales);
  const Layout l = make_layout(n, block);
  const int64_t chunks = amax_chunks(l.block);
  cudaError_t err = cudaMemsetAsync(flags, 0, sizeof(int), stream);
  if (err == cudaSuccess && chunks > 1) {  // atomicMax starts from +0
    err = cudaMemsetAsync(amax, 0, sizeof(unsigned long long) * l.nblocks, stream);
  }
  if (err != cudaSuccess) {
    return err;
  }
  blockint_amax_kernel<T><<<grid(grid_warps(l.nblocks * chunks)), kThreads, 0, stream>>>(
      x, l, chunks, amax, flags);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  blockint_finalize_kernel<T><<<grid(grid_items(l.nblocks)), kThreads, 0, stream>>>(
      amax, l, qmax_of(Bits), s, flags);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  blockint_encode_kernel<T, Bits, Stochastic><<<grid(grid_words(n)), kThreads, 0, stream>>>(
      x, s, l, qmax_of(Bits), key, packed, flags);
  return cudaGetLastError();
}

// Both launchers: the argument checks, n == 0, and the dispatch on dtype and width.
template <bool Stochastic>
cudaError_t blockint_encode_launch(const void* x, int dtype, int64_t n, int bits, int64_t block,
                                   uint64_t key, void* scales, uint8_t* packed,
                                   unsigned long long* amax, int* flags, cudaStream_t stream) {
  if (n < 0 || block < 1 || !valid_bits(bits)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) {
    return cudaMemsetAsync(flags, 0, sizeof(int), stream);
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return bits == 8
               ? blockint_encode<T, 8, Stochastic>(x, n, block, key, scales, packed, amax, flags,
                                                   stream)
               : blockint_encode<T, 4, Stochastic>(x, n, block, key, scales, packed, amax, flags,
                                                   stream);
  });
}
#endif  // __CUDACC_RTC__

}  // namespace
}  // namespace cuda
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code
extern "C" {

int64_t commpress_blockint_scratch_cuda(int64_t n, int64_t block) {
  return commpress::cuda::make_layout(n, block).nblocks;
}

cudaError_t commpress_blockint_encode_cuda(const void* x, int dtype, int64_t n, int bits,
                                           int64_t block, void* scales, uint8_t* packed,
                                           unsigned long long* amax, int* flags,
                                           cudaStream_t stream) {
  return commpress::cuda::blockint_encode_launch<false>(x, dtype, n, bits, block, 0, scales,
                                                        packed, amax, flags, stream);
}

cudaError_t commpress_blockint_encode_sr_cuda(const void* x, int dtype, int64_t n, int bits,
                                              int64_t block, uint64_t seed, void* scales,
                                              uint8_t* packed, unsigned long long* amax,
                                              int* flags, cudaStream_t stream) {
  const uint64_t key = commpress::rng_key(seed, commpress::kStreamBlockIntSR);
  return commpress::cuda::blockint_encode_launch<true>(x, dtype, n, bits, block, key, scales,
                                                       packed, amax, flags, stream);
}

cudaError_t commpress_blockint_decode_cuda(const void* scales, const uint8_t* packed, int64_t n,
                                           int bits, int64_t block, int dtype, void* out,
                                           int accumulate, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (!valid_bits(bits)) {
    return cudaErrorInvalidValue;
  }
  const int qmax = qmax_of(bits);
  return launch_block_decode(n, block, dtype, [&](auto tag, const Layout& l, int g) {
    using T = decltype(tag);
    using CT = typename commpress::Elem<T>::compute;
    const CT* s = static_cast<const CT*>(scales);
    T* o = static_cast<T*>(out);
    if (bits == 8) {
      if (accumulate) {
        blockint_decode_kernel<T, 8, true><<<g, kThreads, 0, stream>>>(s, packed, l, qmax, o);
      } else {
        blockint_decode_kernel<T, 8, false><<<g, kThreads, 0, stream>>>(s, packed, l, qmax, o);
      }
    } else if (accumulate) {
      blockint_decode_kernel<T, 4, true><<<g, kThreads, 0, stream>>>(s, packed, l, qmax, o);
    } else {
      blockint_decode_kernel<T, 4, false><<<g, kThreads, 0, stream>>>(s, packed, l, qmax, o);
    }
  });
}

}  // extern "C"
#endif  // __CUDACC_RTC__
