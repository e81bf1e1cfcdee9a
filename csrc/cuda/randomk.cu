// CUDA kernels of random-k (specification: commpress/codecs/randomk.py), with C launchers
// (declared in launchers.h). Plain CUDA.
//
// Thread j regenerates index j from the seed -- start of stratum j plus
// below(seed, j, length) of the counter-based RNG (include/commpress/rng.h) -- so the
// indices are never stored and every rank and backend draws the same ones.
#include <cuda_runtime.h>

#include <cstdint>

#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.cuh"
#include "launchers.h"

namespace commpress {
namespace cuda {
namespace {

__device__ __forceinline__ int64_t stratum_index(uint64_t key, int64_t j, int64_t n, int64_t k,
                                                 int64_t* length) {
  const int64_t start = stratum_start(j, n, k);
  *length = stratum_start(j + 1, n, k) - start;
  return start + static_cast<int64_t>(
                     rng_below(key, static_cast<uint64_t>(j), static_cast<uint64_t>(*length)));
}

template <class T>
__global__ void gather_kernel(const T* __restrict__ x, int64_t n, int64_t k, uint64_t key,
                              bool scaled, T* __restrict__ values, int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  bool overflow = false;
  for (int64_t j = global_thread(); j < k; j += grid_stride()) {
    int64_t length;
    T v = x[stratum_index(key, j, n, k, &length)];
    if (scaled) {
      // values * length.to(dtype) in torch: the length is rounded to x's dtype first (via
      // float32 for the 16-bit formats), then multiplied in the compute dtype
      const T lt = Elem<T>::store(static_cast<CT>(length));
      v = Elem<T>::store(mul_rn(Elem<T>::load(v), Elem<T>::load(lt)));
      overflow |= !(fabs(static_cast<double>(Elem<T>::load(v))) <= 1.7976931348623157e308);
    }
    values[j] = v;
  }
  if (__any_sync(kFullMask, overflow) && lane_id() == 0) {
    atomicOr(flags, kFlagOverflow);
  }
}

template <class T>
__global__ void scatter_kernel(const T* __restrict__ values, int64_t k, int64_t n, uint64_t key,
                               T* __restrict__ out) {
  scatter_accumulate(values, k, out, [&](int64_t j) {
    int64_t length;
    return stratum_index(key, j, n, k, &length);
  });
}

}  // namespace
}  // namespace cuda
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code, not for NVRTC
extern "C" {

cudaError_t commpress_randomk_gather_cuda(const void* x, int dtype, int64_t n, int64_t k,
                                          uint64_t seed, int scaled, void* values, int* flags,
                                          cudaStream_t stream) {
  using namespace commpress::cuda;
  if (n < 0 || k < 0 || k > n || (n > 0 && k == 0)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaMemsetAsync(flags, 0, sizeof(int), stream);
  if (err != cudaSuccess || n == 0) {
    return err;
  }
  const uint64_t key = commpress::rng_key(seed, commpress::kStreamRandomK);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(x);
    check_finite_kernel<T><<<grid(grid_items(n)), kThreads, 0, stream>>>(xs, n, flags);
    gather_kernel<T><<<grid(grid_items(k)), kThreads, 0, stream>>>(xs, n, k, key, scaled != 0,
                                                             static_cast<T*>(values), flags);
    return cudaGetLastError();
  });
}

cudaError_t commpress_randomk_scatter_add_cuda(const void* values, int dtype, int64_t k,
                                               int64_t n, uint64_t seed, void* out,
                                               cudaStream_t stream) {
  using namespace commpress::cuda;
  if (n < 0 || k < 0 || k > n) {
    return cudaErrorInvalidValue;
  }
  if (k == 0) {
    return cudaSuccess;
  }
  const uint64_t key = commpress::rng_key(seed, commpress::kStreamRandomK);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    scatter_kernel<T><<<grid(grid_items(k)), kThreads, 0, stream>>>(
        static_cast<const T*>(values), k, n, key, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // extern "C"
#endif  // __CUDACC_RTC__
