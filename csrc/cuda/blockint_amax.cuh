// Passes 1 and 2 of the block-scaled encodes (int8 / int4 in blockint.cu, ternary in
// ternary.cu): the per-block amax, and the scales amax / q_max with the overflow check. Plain
// CUDA, included by those units (anonymous namespace: each has its own instantiations).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "block_sums.cuh"
#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "common.cuh"

namespace commpress {
namespace cuda {
namespace {

// Elements of a block one warp reduces in the amax pass (32 per lane).
constexpr int64_t kAmaxChunk = 1024;

__device__ __forceinline__ float magnitude(float v) { return fabsf(v); }
__device__ __forceinline__ double magnitude(double v) { return fabs(v); }

// The bits of a non-negative value, widened to 64: ordered like the values (atomicMax works).
__device__ __forceinline__ unsigned long long magnitude_bits(float v) {
  return static_cast<unsigned long long>(__float_as_uint(v));
}
__device__ __forceinline__ unsigned long long magnitude_bits(double v) {
  return static_cast<unsigned long long>(__double_as_longlong(v));
}
template <class CT>
__device__ __forceinline__ CT from_magnitude_bits(unsigned long long b);
template <>
__device__ __forceinline__ float from_magnitude_bits<float>(unsigned long long b) {
  return __uint_as_float(static_cast<unsigned>(b));
}
template <>
__device__ __forceinline__ double from_magnitude_bits<double>(unsigned long long b) {
  return __longlong_as_double(static_cast<long long>(b));
}

template <class T>
__global__ void blockint_amax_kernel(const T* __restrict__ x, Layout l, int64_t chunks,
                                     unsigned long long* __restrict__ amax,
                                     int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  const int64_t items = l.nblocks * chunks;
  const int64_t nwarps = grid_stride() / kWarp;
  bool bad = false;
  for (int64_t item = global_thread() / kWarp; item < items; item += nwarps) {  // warp-uniform
    const int64_t b = item / chunks;
    const int64_t bstart = b * l.block;
    const int64_t bend = l.n - bstart < l.block ? l.n : bstart + l.block;
    const int64_t s = bstart + (item - b * chunks) * kAmaxChunk;
    const int64_t t = bend - s < kAmaxChunk ? bend : s + kAmaxChunk;
    CT m = CT(0);
    for (int64_t i = s + lane_id(); i < t; i += kWarp) {
      const CT v = magnitude(Elem<T>::load(x[i]));
      bad |= !(v <= Elem<CT>::kMax);
      m = v > m ? v : m;  // NaN never wins (it is flagged instead)
    }
    for (int h = kWarp / 2; h >= 1; h /= 2) {
      const CT o = __shfl_down_sync(kFullMask, m, h);
      m = o > m ? o : m;
    }
    if (lane_id() == 0) {
      if (chunks == 1) {
        amax[b] = magnitude_bits(m);
      } else {
        atomicMax(amax + b, magnitude_bits(m));
      }
    }
  }
  if (__any_sync(kFullMask, bad) && lane_id() == 0) {
    atomicOr(flags, kFlagNonFinite);
  }
}

template <class T>
__global__ void blockint_finalize_kernel(const unsigned long long* __restrict__ amax, Layout l,
                                         int qmax, typename Elem<T>::compute* __restrict__ scales,
                                         int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  const CT qm = static_cast<CT>(qmax);
  for (int64_t b = global_thread(); b < l.nblocks; b += grid_stride()) {
    const CT s = from_magnitude_bits<CT>(amax[b]) / qm;  // IEEE division (nvcc -prec-div=true)
    scales[b] = s;
    const CT top = mul_rn(s, qm);  // the largest decoded magnitude, in CT and in T
    if (!(top <= Elem<CT>::kMax) || !(round_trip<T>(top) <= Elem<CT>::kMax)) {
      atomicOr(flags, kFlagOverflow);
    }
  }
}

#ifndef __CUDACC_RTC__  // host code
int64_t amax_chunks(int64_t block) { return ceil_div(block, kAmaxChunk); }
#endif  // __CUDACC_RTC__

}  // namespace
}  // namespace cuda
}  // namespace commpress
