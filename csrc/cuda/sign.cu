// CUDA kernels of the sign codec (specification: commpress/codecs/sign.py), with C launchers
// (declared in launchers.h). Plain CUDA: `nvcc -c -I csrc/include` compiles it anywhere.
//
// Encode: per-block sums of |w| (block_sums.cuh), scales, then one warp per 32 elements
// writes the bits with __ballot_sync (bit j of the word = lane j: LSB-first packing) and the
// new residual. Pass 2 reads the flags first and writes nothing when the input was invalid.
#include <cuda_runtime.h>

#include <cstdint>

#include "block_sums.cuh"
#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "common.cuh"
#include "launchers.h"

namespace commpress {
namespace cuda {
namespace {

template <class T>
__global__ void sign_finalize_kernel(const double* __restrict__ sums, Layout l,
                                     typename Elem<T>::compute* __restrict__ scales,
                                     int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  for (int64_t b = global_thread(); b < l.nblocks; b += grid_stride()) {
    const int64_t len = l.n - b * l.block < l.block ? l.n - b * l.block : l.block;
    const CT s = static_cast<CT>(sums[b] / static_cast<double>(len));
    scales[b] = s;
    if (!(fabs(static_cast<double>(s)) <= 1.7976931348623157e308)) {
      atomicOr(flags, kFlagOverflow);
    }
  }
}

template <class T, bool HasE>
__global__ void sign_encode_kernel(const T* __restrict__ x, typename Elem<T>::compute* __restrict__ e,
                                   const typename Elem<T>::compute* __restrict__ scales, Layout l,
                                   uint8_t* __restrict__ bits, const int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  if (*flags != 0) {
    return;  // invalid input: write nothing (the residual stays as it was)
  }
  const unsigned lane = lane_id();
  const int64_t nwords = (l.n + kWarp - 1) / kWarp;
  const int64_t nbytes = (l.n + 7) / 8;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < nwords; w += nwarps) {
    const int64_t first = w * kWarp;
    const int64_t i = first + lane;
    const int64_t b = lane_block(first, i < l.n ? i : l.n - 1, l);
    bool negative = false;
    if (i < l.n) {
      const Corrected<T, HasE> v(x[i], e, i);
      negative = v.w < CT(0);
      if constexpr (HasE) {
        e[i] = v.c - decoded_value<T>(sign_value(negative, scales[b]));
      }
    }
    const unsigned word = __ballot_sync(kFullMask, negative);
    if (lane == 0) {
      store_word(bits, first / 8, nbytes, word);
    }
  }
}

template <class T, bool Accumulate>
__global__ void sign_decode_kernel(const typename Elem<T>::compute* __restrict__ scales,
                                   const uint8_t* __restrict__ bits, Layout l,
                                   T* __restrict__ out) {
  const int64_t nwords = (l.n + kWarp - 1) / kWarp;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < nwords; w += nwarps) {
    const int64_t first = w * kWarp;
    const int64_t i = first + lane_id();
    const int64_t b = lane_block(first, i < l.n ? i : l.n - 1, l);
    if (i < l.n) {
      const bool negative = (bits[i >> 3] >> (i & 7)) & 1;
      out[i] = decode_into<Accumulate, T>(out[i], sign_value(negative, scales[b]));
    }
  }
}

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
template <class T>
cudaError_t sign_encode(const void* xv, void* ev, int64_t n, int64_t block, void* scales,
                        uint8_t* bits, double* scratch, int* flags, cudaStream_t stream) {
  using CT = typename Elem<T>::compute;
  const T* x = static_cast<const T*>(xv);
  CT* e = static_cast<CT*>(ev);
  CT* s = static_cast<CT*>(scales);
  const double* sums = nullptr;
  return launch_block_encode(
      n, block, e != nullptr, flags, stream,
      [&](auto has_e, const Layout& l) {
        return launch_block_reduce<kSumAbs, T, decltype(has_e)::value>(x, e, nullptr, l, scratch,
                                                                       flags, stream, &sums);
      },
      [&](const Layout& l, int g) {
        sign_finalize_kernel<T><<<g, kThreads, 0, stream>>>(sums, l, s, flags);
      },
      [&](auto has_e, const Layout& l, int g) {
        sign_encode_kernel<T, decltype(has_e)::value>
            <<<g, kThreads, 0, stream>>>(x, e, s, l, bits, flags);
      });
}
#endif  // __CUDACC_RTC__

}  // namespace
}  // namespace cuda
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code, not for NVRTC
extern "C" {

int64_t commpress_reduce_scratch_cuda(int64_t n, int64_t block) {
  // kReductions reductions (QSGD float64: max, then scaled squares) each need their own levels
  using namespace commpress::cuda;
  const Layout l = make_layout(n, block);
  return encode_scratch(l.nblocks, l.groups_per_block);
}

cudaError_t commpress_sign_encode_cuda(const void* x, int dtype, void* residual, int64_t n,
                                       int64_t block, void* scales, uint8_t* bits,
                                       double* scratch, int* flags, cudaStream_t stream) {
  if (n < 0 || block < 1) {
    return cudaErrorInvalidValue;
  }
  return commpress::cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return commpress::cuda::sign_encode<T>(x, residual, n, block, scales, bits, scratch, flags,
                                           stream);
  });
}

cudaError_t commpress_sign_decode_cuda(const void* scales, const uint8_t* bits, int64_t n,
                                       int64_t block, int dtype, void* out, int accumulate,
                                       cudaStream_t stream) {
  using namespace commpress::cuda;
  return launch_block_decode(n, block, dtype, [&](auto tag, const Layout& l, int g) {
    using T = decltype(tag);
    using CT = typename commpress::Elem<T>::compute;
    const CT* s = static_cast<const CT*>(scales);
    T* o = static_cast<T*>(out);
    if (accumulate) {
      sign_decode_kernel<T, true><<<g, kThreads, 0, stream>>>(s, bits, l, o);
    } else {
      sign_decode_kernel<T, false><<<g, kThreads, 0, stream>>>(s, bits, l, o);
    }
  });
}

}  // extern "C"
#endif  // __CUDACC_RTC__
