// CUDA kernels of the QSGD codec (specification: commpress/codecs/qsgd.py), with C launchers
// (declared in launchers.h). Plain CUDA: `nvcc -c -I csrc/include` compiles it anywhere.
//
// Encode: bucket norms (block_sums.cuh; float64 input: a max pass, then sums of (w / max)^2),
// then one thread per element draws its 24-bit uniform from the counter-based RNG
// (include/commpress/rng.h: same seed, same bits as the CPU), quantises, and the fields of 32
// lanes are OR-ed into 32-bit words with shuffles (LSB-first, like commpress/bitpack.py).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "block_sums.cuh"
#include "commpress/bitpack.h"
#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.cuh"
#include "launchers.h"

namespace commpress {
namespace cuda {
namespace {

template <class T>
__global__ void qsgd_finalize_kernel(const double* __restrict__ sums,
                                     const double* __restrict__ amax, Layout l, double limit,
                                     typename Elem<T>::compute* __restrict__ norms,
                                     int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  for (int64_t b = global_thread(); b < l.nblocks; b += grid_stride()) {
    double v = sqrt(sums[b]);  // IEEE correctly rounded, like std::sqrt and numpy
    if (amax != nullptr) {
      v = __dmul_rn(v, amax[b]);
    }
    const CT norm = static_cast<CT>(v);
    norms[b] = norm;
    const double d = static_cast<double>(norm);
    if (!(fabs(d) <= 1.7976931348623157e308)) {
      atomicOr(flags, kFlagOverflow);
    } else if (d > limit) {
      atomicOr(flags, kFlagTooBig);
    }
  }
}

template <class T, bool HasE, int Bits>
__global__ void qsgd_encode_kernel(const T* __restrict__ x, typename Elem<T>::compute* __restrict__ e,
                                   const typename Elem<T>::compute* __restrict__ norms, Layout l,
                                   int levels, uint64_t key, uint8_t* __restrict__ packed,
                                   const int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  if (*flags != 0) {
    return;  // invalid input: write nothing (the residual stays as it was)
  }
  constexpr int kPerWord = 32 / Bits;  // fields per 32-bit output word
  const unsigned lane = lane_id();
  const int64_t nwords = (l.n + kWarp - 1) / kWarp;
  const int64_t nbytes = (l.n * Bits + 7) / 8;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < nwords; w += nwarps) {
    const int64_t first = w * kWarp;
    const int64_t i = first + lane;
    const int64_t b = lane_block(first, i < l.n ? i : l.n - 1, l);
    uint32_t field = 0;  // padding fields are zero
    if (i < l.n) {
      const Corrected<T, HasE> v(x[i], e, i);
      const CT norm = norms[b];
      const uint32_t u = rng_u24_paired(key, static_cast<uint64_t>(i));
      field = qsgd_fixed_field(v.w, QsgdScale<CT>(norm, levels), u, levels);
      if constexpr (HasE) {
        e[i] = v.c - decoded_value<T>(qsgd_value(norm, qsgd_ratio<CT>(field, levels)));
      }
    }
    uint32_t word = field << (Bits * (lane % kPerWord));
    for (int o = kPerWord / 2; o >= 1; o /= 2) {
      word |= __shfl_down_sync(kFullMask, word, o);
    }
    if (lane % kPerWord == 0) {
      store_word(packed, i * Bits / 8, nbytes, word);
    }
  }
}

template <class T, int Bits, bool Accumulate>
__global__ void qsgd_decode_kernel(const typename Elem<T>::compute* __restrict__ norms,
                                   const uint8_t* __restrict__ packed, Layout l, int levels,
                                   T* __restrict__ out) {
  using CT = typename Elem<T>::compute;
  __shared__ CT ratio[256];  // (f - s) / s for every byte value, as the reference computes it
  for (int f = threadIdx.x; f < 256; f += blockDim.x) {
    ratio[f] = qsgd_ratio<CT>(static_cast<uint32_t>(f), levels);
  }
  __syncthreads();
  const int64_t nwords = (l.n + kWarp - 1) / kWarp;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t w = global_thread() / kWarp; w < nwords; w += nwarps) {
    const int64_t first = w * kWarp;
    const int64_t i = first + lane_id();
    const int64_t b = lane_block(first, i < l.n ? i : l.n - 1, l);
    if (i < l.n) {
      const uint8_t f = unpack_field<Bits>(packed, i);
      out[i] = decode_into<Accumulate, T>(out[i], qsgd_value(norms[b], ratio[f]));
    }
  }
}

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
template <class T, bool HasE>
cudaError_t reduce_norms(const T* x, typename Elem<T>::compute* e, const Layout& l,
                         double* scratch, int* flags, cudaStream_t stream, const double** sums,
                         const double** amax) {
  *amax = nullptr;
  if constexpr (std::is_same<T, double>::value) {
    // squares of float64 can overflow: divide by the bucket's max magnitude first
    const cudaError_t err = launch_block_reduce<kMaxAbs, T, HasE>(x, e, nullptr, l, scratch,
                                                                  flags, stream, amax);
    if (err != cudaSuccess) {
      return err;
    }
    double* second = scratch + second_reduction(l.nblocks, l.groups_per_block);
    return launch_block_reduce<kSumScaledSquare, T, HasE>(x, e, *amax, l, second, flags, stream,
                                                          sums);
  } else {
    return launch_block_reduce<kSumSquare, T, HasE>(x, e, nullptr, l, scratch, flags, stream,
                                                    sums);
  }
}

template <class T, int Bits>
cudaError_t qsgd_encode(const void* xv, void* ev, int64_t n, int levels, int64_t bucket,
                        uint64_t seed, double limit, void* normsv, uint8_t* packed,
                        double* scratch, int* flags, cudaStream_t stream) {
  using CT = typename Elem<T>::compute;
  const T* x = static_cast<const T*>(xv);
  CT* e = static_cast<CT*>(ev);
  CT* norms = static_cast<CT*>(normsv);
  const uint64_t key = rng_key(seed, kStreamQSGD);
  const double* sums = nullptr;
  const double* amax = nullptr;
  return launch_block_encode(
      n, bucket, e != nullptr, flags, stream,
      [&](auto has_e, const Layout& l) {
        return reduce_norms<T, decltype(has_e)::value>(x, e, l, scratch, flags, stream, &sums,
                                                       &amax);
      },
      [&](const Layout& l, int g) {
        qsgd_finalize_kernel<T><<<g, kThreads, 0, stream>>>(sums, amax, l, limit, norms, flags);
      },
      [&](auto has_e, const Layout& l, int g) {
        qsgd_encode_kernel<T, decltype(has_e)::value, Bits>
            <<<g, kThreads, 0, stream>>>(x, e, norms, l, levels, key, packed, flags);
      });
}
#endif  // __CUDACC_RTC__

}  // namespace
}  // namespace cuda
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code, not for NVRTC
extern "C" {

cudaError_t commpress_qsgd_encode_cuda(const void* x, int dtype, void* residual, int64_t n,
                                       int bits, int levels, int64_t bucket, uint64_t seed,
                                       double limit, void* norms, uint8_t* packed,
                                       double* scratch, int* flags, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (n < 0 || bucket < 1 || levels < 1) {
    return cudaErrorInvalidValue;
  }
  return dispatch_width<kQsgdWidths>(bits, [&](auto width) {
    constexpr int kBits = decltype(width)::value;
    if (levels > (1 << (kBits - 1)) - 1) {
      return cudaErrorInvalidValue;
    }
    return dispatch_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      return qsgd_encode<T, kBits>(x, residual, n, levels, bucket, seed, limit, norms, packed,
                                   scratch, flags, stream);
    });
  });
}

cudaError_t commpress_qsgd_decode_cuda(const void* norms, const uint8_t* packed, int64_t n,
                                       int bits, int levels, int64_t bucket, int dtype,
                                       void* out, int accumulate, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (levels < 1) {
    return cudaErrorInvalidValue;
  }
  return dispatch_width<kQsgdWidths>(bits, [&](auto width) {
    constexpr int kBits = decltype(width)::value;
    return launch_block_decode(n, bucket, dtype, [&](auto tag, const Layout& l, int g) {
      using T = decltype(tag);
      using CT = typename commpress::Elem<T>::compute;
      const CT* nm = static_cast<const CT*>(norms);
      T* o = static_cast<T*>(out);
      if (accumulate) {
        qsgd_decode_kernel<T, kBits, true><<<g, kThreads, 0, stream>>>(nm, packed, l, levels, o);
      } else {
        qsgd_decode_kernel<T, kBits, false><<<g, kThreads, 0, stream>>>(nm, packed, l, levels, o);
      }
    });
  });
}

}  // extern "C"
#endif  // __CUDACC_RTC__
