// Device helpers shared by the CUDA kernels (plain CUDA, no torch headers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "commpress/tree.h"
#include "launch_params.h"

#ifndef __CUDACC_RTC__
#include <cstddef>
#include <type_traits>
#include <utility>
#endif

namespace commpress {
namespace cuda {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
// Grids come from the functions of launch_params.h (grid_items, grid_warps, ...), which the
// CuPy backend evaluates too; <<<>>> takes an int.
inline int grid(int64_t blocks) { return static_cast<int>(blocks); }

// Calls f(T{}) with T the storage type of `dtype` (launch_params.h COMMPRESS_STORAGE_TYPES);
// returns cudaErrorInvalidValue if unknown.
template <class F>
cudaError_t dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
#define COMMPRESS_DTYPE_CASE(code, type) \
  case code: return f(type{});
    COMMPRESS_STORAGE_TYPES(COMMPRESS_DTYPE_CASE)
#undef COMMPRESS_DTYPE_CASE
    default: return cudaErrorInvalidValue;
  }
}

// Calls f(std::integral_constant<int, W>{}) for the W of `Widths` (a width list of
// launch_params.h: kPackWidths, kQsgdWidths) equal to `width`; cudaErrorInvalidValue if none.
template <const auto& Widths, class F, std::size_t... I>
cudaError_t dispatch_width_in(int width, F& f, std::index_sequence<I...>) {
  cudaError_t err = cudaErrorInvalidValue;
  (void)((width == Widths[I] && (err = f(std::integral_constant<int, Widths[I]>{}), true)) || ...);
  return err;
}
template <const auto& Widths, class F>
cudaError_t dispatch_width(int width, F&& f) {
  constexpr std::size_t kCount = sizeof(Widths) / sizeof(Widths[0]);
  return dispatch_width_in<Widths>(width, f, std::make_index_sequence<kCount>{});
}
#endif  // __CUDACC_RTC__

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ unsigned lane_id() { return threadIdx.x & (kWarp - 1); }

// The halves tree of include/commpress/tree.h over the 32 lanes' values: after the five
// steps lane 0 holds (v0 + v16) + ... exactly like chunk_tree_sum (other lanes: garbage).
__device__ __forceinline__ double warp_halves_sum(double v) {
  for (int h = kWarp / 2; h >= 1; h /= 2) {
    v = v + __shfl_down_sync(kFullMask, v, h);
  }
  return v;
}

// The adjacent-pairs tree over the 32 lanes' values (lane i = subtree i): lane 0 ends with
// ((v0 + v1) + (v2 + v3)) + ..., the order of PairwiseStack for 32 equal subtrees.
__device__ __forceinline__ double warp_pairs_sum(double v) {
  for (int h = 1; h < kWarp; h *= 2) {
    v = v + __shfl_down_sync(kFullMask, v, h);
  }
  return v;
}

__device__ __forceinline__ double warp_max(double v) {
  for (int h = kWarp / 2; h >= 1; h /= 2) {
    const double o = __shfl_down_sync(kFullMask, v, h);
    v = o > v ? o : v;
  }
  return v;
}

// Exclusive prefix sum over the threads of a block (blockDim.x a multiple of 32, at most
// 1024), in thread order; *total receives the block's sum. Every thread must call it.
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long v,
                                                                   unsigned long long* total) {
  __shared__ unsigned long long warp_sums[kWarp];
  const unsigned lane = lane_id();
  const unsigned wid = threadIdx.x / kWarp;
  const unsigned nwarps = blockDim.x / kWarp;
  unsigned long long incl = v;
  for (int o = 1; o < kWarp; o *= 2) {
    const unsigned long long y = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= static_cast<unsigned>(o)) {
      incl += y;
    }
  }
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == kWarp - 1) {
    warp_sums[wid] = incl;
  }
  __syncthreads();
  if (wid == 0) {
    const unsigned long long mine = lane < nwarps ? warp_sums[lane] : 0ull;
    unsigned long long w = mine;
    for (int o = 1; o < kWarp; o *= 2) {
      const unsigned long long y = __shfl_up_sync(kFullMask, w, o);
      if (lane >= static_cast<unsigned>(o)) {
        w += y;
      }
    }
    if (lane < nwarps) {
      warp_sums[lane] = w - mine;  // exclusive prefix of the warp totals
    }
    if (lane == nwarps - 1) {
      *total = w;  // total is a shared or per-thread location read after the next barrier
    }
  }
  __syncthreads();
  return warp_sums[wid] + incl - v;
}

// Sets flags |= 1 when some x_i is NaN or Inf.
template <class T>
__global__ void check_finite_kernel(const T* __restrict__ x, int64_t n, int* __restrict__ flags) {
  bool bad = false;
  for (int64_t i = global_thread(); i < n; i += grid_stride()) {
    const double v = static_cast<double>(Elem<T>::load(x[i]));
    bad |= !(fabs(v) <= 1.7976931348623157e308);
  }
  if (__any_sync(kFullMask, bad) && lane_id() == 0) {
    atomicOr(flags, kFlagNonFinite);
  }
}

// out[index(j)] += values[j] for every j < k (grid-stride). The callers' indices are distinct
// (random-k: one per stratum; top-k: strictly increasing), so no two threads touch one element.
template <class T, class Index>
__device__ __forceinline__ void scatter_accumulate(const T* __restrict__ values, int64_t k,
                                                   T* __restrict__ out, Index index) {
  for (int64_t j = global_thread(); j < k; j += grid_stride()) {
    const int64_t i = index(j);
    out[i] = accumulate<T>(out[i], Elem<T>::load(values[j]));
  }
}

}  // namespace cuda
}  // namespace commpress
