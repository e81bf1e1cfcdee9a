// Per-block reductions of the encoded values (sign scales, QSGD norms) on the GPU, in the
// summation order of include/commpress/tree.h, so they equal the CPU kernels and the
// reference bit for bit.
//
// One warp sums one group of 32 chunks (1024 elements): each chunk by the halves tree (a
// shfl_down butterfly), then the 32 chunk sums by the adjacent-pairs tree. Groups are aligned
// subtrees of a block's order, so level kernels combine 32 group sums at a time by the same
// adjacent-pairs tree until one value per block is left.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "common.cuh"

namespace commpress {
namespace cuda {

// SumKind, Flag, kGroupElems and kReductions: launch_params.h (shared with the CuPy backend).
static_assert(kGroupElems == kWarp * kSumChunk, "a group is one warp's kWarp chunks");

struct Layout {
  int64_t n;
  int64_t block;
  int64_t nblocks;
  int64_t groups_per_block;
};

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
// A block of 0 (whole tensor) or longer than the tensor is one block of n (>= 1) elements:
// the same block, and no later arithmetic comes near INT64_MAX.
inline Layout make_layout(int64_t n, int64_t block) {
  const int64_t whole = n > 0 ? n : 1;
  Layout l;
  l.n = n;
  l.block = block <= 0 || block > whole ? whole : block;
  block = l.block;
  l.nblocks = n == 0 ? 0 : n / block + (n % block != 0 ? 1 : 0);
  l.groups_per_block = groups_per_block(block);
  return l;
}
#endif  // __CUDACC_RTC__

template <int Kind, class T, bool HasE>
__global__ void group_sums_kernel(const T* __restrict__ x,
                                  const typename Elem<T>::compute* __restrict__ e,
                                  const double* __restrict__ amax, Layout l,
                                  double* __restrict__ out, int* __restrict__ flags) {
  using CT = typename Elem<T>::compute;
  const unsigned lane = lane_id();
  const int64_t ngroups = l.nblocks * l.groups_per_block;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t g = global_thread() / kWarp; g < ngroups; g += nwarps) {
    const int64_t b = g / l.groups_per_block;
    const int64_t bstart = b * l.block;
    const int64_t bend = bstart + l.block < l.n ? bstart + l.block : l.n;
    const int64_t s = bstart + (g - b * l.groups_per_block) * kGroupElems;
    const int64_t t = s + kGroupElems < bend ? s + kGroupElems : bend;
    double safe = 1.0;
    if constexpr (Kind == kSumScaledSquare) {
      safe = amax[b] > 0.0 ? amax[b] : 1.0;
    }
    double mine = 0.0;
    bool bad = false;
    for (int c = 0; c < kWarp; ++c) {
      const int64_t base = s + static_cast<int64_t>(c) * kSumChunk;
      if (base >= t) {
        break;  // warp-uniform: the remaining chunks are padding (zeros)
      }
      const int64_t i = base + lane;
      double v = 0.0;
      if (i < t) {
        const double w = static_cast<double>(Corrected<T, HasE>(x[i], e, i).w);
        bad |= !(fabs(w) <= 1.7976931348623157e308);
        if constexpr (Kind == kSumAbs || Kind == kMaxAbs) {
          v = fabs(w);
        } else if constexpr (Kind == kSumSquare) {
          v = __dmul_rn(w, w);
        } else {
          const double y = w / safe;
          v = __dmul_rn(y, y);
        }
      }
      v = Kind == kMaxAbs ? warp_max(v) : warp_halves_sum(v);
      v = __shfl_sync(kFullMask, v, 0);
      if (lane == static_cast<unsigned>(c)) {
        mine = v;
      }
    }
    mine = Kind == kMaxAbs ? warp_max(mine) : warp_pairs_sum(mine);
    if (lane == 0) {
      out[g] = mine;
    }
    if (__any_sync(kFullMask, bad) && lane == 0) {
      atomicOr(flags, kFlagNonFinite);
    }
  }
}

// out[b * per_out + j] = tree (or max) of in[b * per_in + 32 j ..][0, 32), missing = 0.
template <bool IsMax>
__global__ void tree_level_kernel(const double* __restrict__ in, int64_t per_in, int64_t nblocks,
                                  int64_t per_out, double* __restrict__ out) {
  const unsigned lane = lane_id();
  const int64_t total = nblocks * per_out;
  const int64_t nwarps = grid_stride() / kWarp;
  for (int64_t o = global_thread() / kWarp; o < total; o += nwarps) {
    const int64_t b = o / per_out;
    const int64_t j = (o - b * per_out) * kWarp + lane;
    double v = j < per_in ? in[b * per_in + j] : 0.0;
    v = IsMax ? warp_max(v) : warp_pairs_sum(v);
    if (lane == 0) {
      out[o] = v;
    }
  }
}

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
// Runs the reduction; returns (through *result) the pointer to nblocks per-block values.
template <int Kind, class T, bool HasE>
cudaError_t launch_block_reduce(const T* x, const typename Elem<T>::compute* e,
                                const double* amax, const Layout& l, double* scratch,
                                int* flags, cudaStream_t stream, const double** result) {
  const int64_t ngroups = l.nblocks * l.groups_per_block;
  group_sums_kernel<Kind, T, HasE>
      <<<grid(grid_warps(ngroups)), kThreads, 0, stream>>>(x, e, amax, l, scratch, flags);
  cudaError_t err = cudaGetLastError();
  double* in = scratch;
  int64_t per = l.groups_per_block;
  while (err == cudaSuccess && per > 1) {
    const int64_t per_out = (per + kWarp - 1) / kWarp;
    double* out = in + l.nblocks * per;
    tree_level_kernel<Kind == kMaxAbs><<<grid(grid_warps(l.nblocks * per_out)), kThreads, 0,
                                         stream>>>(in, per, l.nblocks, per_out, out);
    err = cudaGetLastError();
    in = out;
    per = per_out;
  }
  *result = in;
  return err;
}

// The launch of a block codec's encode (sign, QSGD): clears the flag word, then for n > 0 runs
// reduce(has_e, layout) -> cudaError_t (the per-block sums, into the launcher's scratch),
// finalize(layout, grid) (one thread per block: its scale) and encode(has_e, layout, grid)
// (whole warps per 32 elements: the fields), has_e a std::bool_constant of the residual's
// presence. The CuPy backend's _BlockEncode follows the same steps.
template <class Reduce, class Finalize, class Encode>
cudaError_t launch_block_encode(int64_t n, int64_t block, bool has_e, int* flags,
                                cudaStream_t stream, Reduce&& reduce, Finalize&& finalize,
                                Encode&& encode) {
  const Layout l = make_layout(n, block);
  cudaError_t err = cudaMemsetAsync(flags, 0, sizeof(int), stream);
  if (err != cudaSuccess || n == 0) {
    return err;
  }
  err = has_e ? reduce(std::true_type{}, l) : reduce(std::false_type{}, l);
  if (err != cudaSuccess) {
    return err;
  }
  finalize(l, grid(grid_items(l.nblocks)));
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  const int g = grid(grid_words(n));
  if (has_e) {
    encode(std::true_type{}, l, g);
  } else {
    encode(std::false_type{}, l, g);
  }
  return cudaGetLastError();
}

// The launch of a block codec's decode (one thread per output, whole warps per 32 outputs):
// checks n and block, then calls launch(T{}, layout, grid) with T the storage type of `dtype`.
template <class F>
cudaError_t launch_block_decode(int64_t n, int64_t block, int dtype, F&& launch) {
  if (n < 0 || block < 1) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) {
    return cudaSuccess;
  }
  const Layout l = make_layout(n, block);
  return dispatch_dtype(dtype, [&](auto tag) {
    launch(tag, l, grid(grid_words(n)));
    return cudaGetLastError();
  });
}
#endif  // __CUDACC_RTC__

// Index of the block holding element `first` of this warp's 32 (one division per warp), then
// advanced per lane to element i (i - first < 32, so a few steps only for tiny blocks).
__device__ __forceinline__ int64_t lane_block(int64_t first, int64_t i, const Layout& l) {
  if (l.nblocks == 1) {
    return 0;
  }
  int64_t b = 0;
  if (lane_id() == 0) {
    b = first / l.block;
  }
  b = __shfl_sync(kFullMask, b, 0);
  while (b + 1 < l.nblocks && i >= (b + 1) * l.block) {
    ++b;
  }
  return b;
}

// Writes a 32-bit word of packed output starting at byte `byte0` of an nbytes-long buffer
// (4-byte aligned); near the end only the bytes that exist.
__device__ __forceinline__ void store_word(uint8_t* out, int64_t byte0, int64_t nbytes,
                                           uint32_t word) {
  if (byte0 + 4 <= nbytes) {
    *reinterpret_cast<uint32_t*>(out + byte0) = word;
  } else {
    for (int k = 0; byte0 + k < nbytes; ++k) {
      out[byte0 + k] = static_cast<uint8_t>(word >> (8 * k));
    }
  }
}

}  // namespace cuda
}  // namespace commpress
