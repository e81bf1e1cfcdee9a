// CUDA kernels of top-k selection and sparse scatter-add (specification:
// commpress/codecs/topk.py), with C launchers (declared in launchers.h). Plain CUDA.
//
// topk_select is an exact radix select on the magnitude bits followed by a stable compaction:
//   1. key_i = bit pattern of |x_i| (order-preserving for non-negative floats: float32 keys for
//      float32/16/bf16 input, float64 keys for float64);
//   2. MSB-first passes over 11-bit digits: a histogram of the digit among the elements whose
//      higher digits match the prefix found so far, then one block picks the digit holding the
//      k-th largest key; after the last pass the prefix is the k-th largest key T and
//      `remaining` is how many elements equal to T must be kept;
//   3. a count pass (per CTA: how many keys > T and == T in its contiguous range), a scan, and
//      a write pass in index order: an element's output slot is (keys > T before it) +
//      min(keys == T before it, remaining), so indices come out sorted and ties go to the lower
//      index -- the reference's rule, bit for bit.
// No host synchronisation inside: the output size k is known up front.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "common.cuh"
#include "launchers.h"

namespace commpress {
namespace cuda {
namespace {

using ull = unsigned long long;

// kDigitBits, kBins, kHistogramBlocks, kCountBlocks and the scratch layout: launch_params.h.
struct SelectState {
  ull prefix;     // key bits found so far
  ull mask;       // which bits of the key the prefix fixes
  ull remaining;  // rank still to find among keys matching the prefix (1-based)
  ull pad;
};
static_assert(sizeof(SelectState) == 8 * kSelectStateWords, "launch_params.h scratch layout");

// Key of |v|, monotone in |v|: float32 bits for the float32-computed dtypes, float64 bits else.
template <class T>
__device__ __forceinline__ ull key_of(T v) {
  if constexpr (std::is_same<T, double>::value) {
    return double_bits(fabs(v));
  } else {
    return float_bits(fabsf(Elem<T>::load(v)));
  }
}

template <class T>
__host__ __device__ constexpr int key_bits() {
  return std::is_same<T, double>::value ? 64 : 32;
}

template <class T>
__host__ __device__ constexpr ull inf_key() {
  return std::is_same<T, double>::value ? 0x7FF0000000000000ull : 0x7F800000ull;
}

template <class T>
__global__ void histogram_kernel(const T* __restrict__ x, int64_t n,
                                 const SelectState* __restrict__ state, int shift, int width,
                                 ull* __restrict__ hist, int* __restrict__ flags, bool check) {
  __shared__ unsigned counts[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    counts[b] = 0;
  }
  __syncthreads();
  const ull prefix = state->prefix;
  const ull mask = state->mask;
  const ull digit_mask = (ull{1} << width) - 1;
  bool bad = false;
  for (int64_t i = global_thread(); i < n; i += grid_stride()) {
    const ull key = key_of(x[i]);
    bad |= key >= inf_key<T>();
    if ((key & mask) == prefix) {
      atomicAdd(&counts[(key >> shift) & digit_mask], 1u);
    }
  }
  if (check && __any_sync(kFullMask, bad) && lane_id() == 0) {
    atomicOr(flags, kFlagNonFinite);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < (1 << width); b += blockDim.x) {
    if (counts[b] != 0) {
      atomicAdd(&hist[b], static_cast<ull>(counts[b]));
    }
  }
}

// One block of kThreads: finds the digit d whose bin holds the `remaining`-th largest key.
__global__ void select_digit_kernel(const ull* __restrict__ hist, int shift, int width,
                                    SelectState* __restrict__ state) {
  __shared__ ull total;
  const ull remaining = state->remaining;
  __syncthreads();  // everyone has read `remaining` before it is rewritten
  const int nbins = 1 << width;
  const int per = (nbins + blockDim.x - 1) / blockDim.x;
  // thread t owns the digits [hi - per, hi) counted from the top, largest first
  const int hi = nbins - static_cast<int>(threadIdx.x) * per;
  const int lo = hi - per > 0 ? hi - per : 0;
  ull mine = 0;
  for (int d = hi - 1; d >= lo; --d) {
    mine += hist[d];
  }
  const ull above = block_exclusive_scan(mine, &total);
  if (hi > 0 && above < remaining && remaining <= above + mine) {
    ull acc = above;
    for (int d = hi - 1; d >= lo; --d) {
      const ull c = hist[d];
      if (acc + c >= remaining) {
        state->prefix |= static_cast<ull>(d) << shift;
        state->mask |= (((ull{1} << width) - 1) << shift);
        state->remaining = remaining - acc;
        break;
      }
      acc += c;
    }
  }
}

// Contiguous range of count/write block b.
__device__ __forceinline__ void cta_range(int64_t n, int64_t* start, int64_t* end) {
  const int64_t per = ((n + gridDim.x - 1) / gridDim.x + blockDim.x - 1) / blockDim.x * blockDim.x;
  *start = static_cast<int64_t>(blockIdx.x) * per;
  *end = *start + per < n ? *start + per : n;
}

// counts[b] = (keys > T) << 32 | (keys == T) over block b's range.
template <class T>
__global__ void count_kernel(const T* __restrict__ x, int64_t n,
                             const SelectState* __restrict__ state, ull* __restrict__ counts) {
  __shared__ ull total;
  const ull kth = state->prefix;
  int64_t start, end;
  cta_range(n, &start, &end);
  ull mine = 0;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const ull key = key_of(x[i]);
    mine += key > kth ? (ull{1} << 32) : (key == kth ? 1ull : 0ull);
  }
  block_exclusive_scan(mine, &total);
  if (threadIdx.x == 0) {
    counts[blockIdx.x] = total;
  }
}

// One block: exclusive prefix of the > T and == T counts of every count block.
__global__ void scan_counts_kernel(const ull* __restrict__ counts, int nblocks,
                                   ull* __restrict__ off_gt, ull* __restrict__ off_eq) {
  __shared__ ull total;
  const int b = threadIdx.x;
  const ull c = b < nblocks ? counts[b] : 0ull;
  const ull gt = block_exclusive_scan(c >> 32, &total);
  const ull eq = block_exclusive_scan(c & 0xFFFFFFFFull, &total);
  if (b < nblocks) {
    off_gt[b] = gt;
    off_eq[b] = eq;
  }
}

template <class T, class I>
__global__ void write_kernel(const T* __restrict__ x, int64_t n,
                             const SelectState* __restrict__ state, const ull* __restrict__ off_gt,
                             const ull* __restrict__ off_eq, I* __restrict__ indices,
                             T* __restrict__ values) {
  __shared__ ull total;
  const ull kth = state->prefix;
  const ull need_eq = state->remaining;
  int64_t start, end;
  cta_range(n, &start, &end);
  ull run_gt = off_gt[blockIdx.x];
  ull run_eq = off_eq[blockIdx.x];
  for (int64_t base = start; base < end; base += blockDim.x) {  // tiles, in index order
    const int64_t i = base + threadIdx.x;
    ull key = 0;
    bool gt = false;
    bool eq = false;
    if (i < end) {
      key = key_of(x[i]);
      gt = key > kth;
      eq = key == kth;
    }
    const ull before = block_exclusive_scan(gt ? (ull{1} << 32) : (eq ? 1ull : 0ull), &total);
    const ull g = run_gt + (before >> 32);
    const ull e = run_eq + (before & 0xFFFFFFFFull);
    if (gt || (eq && e < need_eq)) {
      const ull pos = g + (e < need_eq ? e : need_eq);
      indices[pos] = static_cast<I>(i);
      values[pos] = x[i];
    }
    run_gt += total >> 32;
    run_eq += total & 0xFFFFFFFFull;
  }
}

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
template <class T>
cudaError_t topk_select(const void* xv, int64_t n, int64_t k, void* indices, int index64,
                        void* values, void* scratch, int* flags, cudaStream_t stream) {
  const T* x = static_cast<const T*>(xv);
  auto* state = static_cast<SelectState*>(scratch);
  ull* hist = reinterpret_cast<ull*>(state + 1);
  ull* counts = hist + kBins;
  ull* off_gt = counts + kCountBlocks;
  ull* off_eq = off_gt + kCountBlocks;
  cudaError_t err = cudaMemsetAsync(flags, 0, sizeof(int), stream);
  if (err != cudaSuccess || n == 0) {
    return err;
  }
  if (k == 0) {  // nothing to select, but x must still be finite
    check_finite_kernel<T><<<grid(grid_items(n)), kThreads, 0, stream>>>(x, n, flags);
    return cudaGetLastError();
  }
  const SelectState init{0, 0, static_cast<ull>(k), 0};
  if ((err = cudaMemcpyAsync(state, &init, sizeof(init), cudaMemcpyHostToDevice, stream)) !=
      cudaSuccess) {
    return err;
  }
  // The top key bit is the sign, always 0 after fabs: digits cover bits [0, key_bits - 1).
  int shift = key_bits<T>() - 1;
  bool first = true;
  while (shift > 0) {
    const int width = shift < kDigitBits ? shift : kDigitBits;
    shift -= width;
    if ((err = cudaMemsetAsync(hist, 0, sizeof(ull) * kBins, stream)) != cudaSuccess) {
      return err;
    }
    histogram_kernel<T><<<grid(grid_histogram(n)), kThreads, 0, stream>>>(x, n, state, shift, width,
                                                                         hist, flags, first);
    if ((err = cudaGetLastError()) != cudaSuccess) {
      return err;
    }
    select_digit_kernel<<<1, kThreads, 0, stream>>>(hist, shift, width, state);
    if ((err = cudaGetLastError()) != cudaSuccess) {
      return err;
    }
    first = false;
  }
  const int cblocks = grid(grid_count(n));
  count_kernel<T><<<cblocks, kThreads, 0, stream>>>(x, n, state, counts);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  scan_counts_kernel<<<1, kCountBlocks, 0, stream>>>(counts, cblocks, off_gt, off_eq);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    return err;
  }
  if (index64) {
    write_kernel<T, int64_t><<<cblocks, kThreads, 0, stream>>>(
        x, n, state, off_gt, off_eq, static_cast<int64_t*>(indices), static_cast<T*>(values));
  } else {
    write_kernel<T, int32_t><<<cblocks, kThreads, 0, stream>>>(
        x, n, state, off_gt, off_eq, static_cast<int32_t*>(indices), static_cast<T*>(values));
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

// ----- sparse scatter-add ----------------------------------------------------------------------

template <class I>
__global__ void scatter_validate_kernel(const I* __restrict__ idx, int64_t k, int64_t n,
                                        int64_t payload, ull* __restrict__ first_bad) {
  for (int64_t j = global_thread(); j < k; j += grid_stride()) {
    const auto v = static_cast<int64_t>(idx[j]);
    const ull code = (static_cast<ull>(payload) << 40) | (static_cast<ull>(j) << 1);
    if (v < 0 || v >= n) {
      atomicMin(first_bad, code);
    } else if (j > 0 && v <= static_cast<int64_t>(idx[j - 1])) {
      atomicMin(first_bad, code | 1ull);
    }
  }
}

template <class I, class T>
__global__ void scatter_add_kernel(const I* __restrict__ idx, const T* __restrict__ values,
                                   int64_t k, T* __restrict__ out,
                                   const ull* __restrict__ first_bad) {
  if (*first_bad != ~0ull) {
    return;  // some payload is invalid: write nothing
  }
  // indices of one payload are strictly increasing, so no two threads touch one element
  scatter_accumulate(values, k, out, [&](int64_t j) { return static_cast<int64_t>(idx[j]); });
}

}  // namespace
}  // namespace cuda
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code, not for NVRTC
extern "C" {

int64_t commpress_topk_scratch_cuda(int64_t n) {
  (void)n;
  using namespace commpress::cuda;
  return static_cast<int64_t>(sizeof(ull)) * kTopkScratchWords;
}

cudaError_t commpress_topk_select_cuda(const void* x, int dtype, int64_t n, int64_t k,
                                       void* indices, int index64, void* values, void* scratch,
                                       int* flags, cudaStream_t stream) {
  if (n < 0 || k < 0 || k > n) {
    return cudaErrorInvalidValue;
  }
  return commpress::cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return commpress::cuda::topk_select<T>(x, n, k, indices, index64, values, scratch, flags,
                                           stream);
  });
}

cudaError_t commpress_scatter_validate_cuda(const void* indices, int index64, int64_t k,
                                            int64_t n, int64_t payload,
                                            unsigned long long* first_bad, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (k < 0 || n < 0 || payload < 0) {
    return cudaErrorInvalidValue;
  }
  if (k == 0) {
    return cudaSuccess;
  }
  if (index64) {
    scatter_validate_kernel<int64_t><<<grid(grid_items(k)), kThreads, 0, stream>>>(
        static_cast<const int64_t*>(indices), k, n, payload, first_bad);
  } else {
    scatter_validate_kernel<int32_t><<<grid(grid_items(k)), kThreads, 0, stream>>>(
        static_cast<const int32_t*>(indices), k, n, payload, first_bad);
  }
  return cudaGetLastError();
}

cudaError_t commpress_scatter_add_cuda(const void* indices, int index64, const void* values,
                                       int64_t k, int dtype, void* out,
                                       const unsigned long long* first_bad, cudaStream_t stream) {
  using namespace commpress::cuda;
  if (k < 0) {
    return cudaErrorInvalidValue;
  }
  if (k == 0) {
    return cudaSuccess;
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* v = static_cast<const T*>(values);
    T* o = static_cast<T*>(out);
    if (index64) {
      scatter_add_kernel<int64_t, T><<<grid(grid_items(k)), kThreads, 0, stream>>>(
          static_cast<const int64_t*>(indices), v, k, o, first_bad);
    } else {
      scatter_add_kernel<int32_t, T><<<grid(grid_items(k)), kThreads, 0, stream>>>(
          static_cast<const int32_t*>(indices), v, k, o, first_bad);
    }
    return cudaGetLastError();
  });
}

}  // extern "C"
#endif  // __CUDACC_RTC__
