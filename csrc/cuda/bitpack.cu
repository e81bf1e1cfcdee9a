// CUDA kernels for bit-field packing, with C launchers on raw pointers and a cudaStream_t.
//
// No torch headers: `nvcc -c -I csrc/include` compiles this file anywhere, and CuPy can load
// the same source. The torch binding (bindings.cpp) owns validation of shapes and dtypes.
//
// Field-range validation (every field < 2**bits) is fused into the pack kernel: a thread that
// reads an out-of-range field atomicMin-s its index into a device word, so valid input costs
// no extra pass over memory. Raising still needs that word on the host, i.e. one 8-byte
// device-to-host copy that synchronises the stream; the binding does it after the launch.
#include <cuda_runtime.h>

#include <cstdint>

#include "commpress/bitpack.h"
#include "common.cuh"  // grid() and dispatch_width()
#include "launch_params.h"

namespace commpress {
namespace {

using cuda::kThreads;  // grid geometry: launch_params.h

// One thread per packed byte.
template <int Bits>
__global__ void pack_kernel(const uint8_t* __restrict__ fields, int64_t n,
                            uint8_t* __restrict__ packed, int64_t nbytes,
                            unsigned long long* __restrict__ first_bad) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nbytes;
       b += stride) {
    const int64_t first = b * kPer;
    const int count = n - first < kPer ? static_cast<int>(n - first) : kPer;
    uint8_t seen = 0;
    // Only the last byte can be partial; the constant count lets the full case unroll.
    packed[b] = count == kPer ? pack_fields<Bits>(fields + first, kPer, seen)
                              : pack_fields<Bits>(fields + first, count, seen);
    if (seen >> Bits) {  // rare: find which field of this byte, keep the lowest index overall
      for (int j = 0; j < count; ++j) {
        if (fields[first + j] >> Bits) {
          atomicMin(first_bad, static_cast<unsigned long long>(first + j));
          break;
        }
      }
    }
  }
}

// One thread per field: neighbouring threads write neighbouring bytes (coalesced stores) and
// share the packed byte they read.
template <int Bits>
__global__ void unpack_kernel(const uint8_t* __restrict__ packed, int64_t n,
                              uint8_t* __restrict__ fields) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    fields[i] = unpack_field<Bits>(packed, i);
  }
}

#ifndef __CUDACC_RTC__  // host code: not for NVRTC (the CuPy backend launches the kernels)
template <int Bits>
cudaError_t launch_pack(const uint8_t* fields, int64_t n, uint8_t* packed,
                        unsigned long long* first_bad, cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(first_bad, 0xFF, sizeof(*first_bad), stream);
  if (err != cudaSuccess) {
    return err;
  }
  const int64_t nbytes = packed_nbytes(n, Bits);
  if (nbytes == 0) {
    return cudaSuccess;
  }
  pack_kernel<Bits><<<cuda::grid(cuda::grid_items(nbytes)), kThreads, 0, stream>>>(
      fields, n, packed, nbytes, first_bad);
  return cudaGetLastError();
}

template <int Bits>
cudaError_t launch_unpack(const uint8_t* packed, int64_t n, uint8_t* fields,
                          cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  unpack_kernel<Bits><<<cuda::grid(cuda::grid_items(n)), kThreads, 0, stream>>>(packed, n,
                                                                                fields);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace
}  // namespace commpress

#ifndef __CUDACC_RTC__  // the C launchers: host code, not for NVRTC
extern "C" {

// Packs n fields (device pointer, each < 2**bits) into ceil(n * bits / 8) bytes at `packed`.
// `first_bad` is a device word: the launcher sets it to UINT64_MAX, and the kernel lowers it
// to the index of the first field >= 2**bits, if any (then `packed` is meaningless).
// Returns cudaErrorInvalidValue for bits outside kPackWidths (launch_params.h) or n < 0.
cudaError_t commpress_pack_bits_cuda(const uint8_t* fields, int64_t n, int bits,
                                     uint8_t* packed, unsigned long long* first_bad,
                                     cudaStream_t stream) {
  if (n < 0) {
    return cudaErrorInvalidValue;
  }
  return commpress::cuda::dispatch_width<commpress::cuda::kPackWidths>(bits, [&](auto width) {
    return commpress::launch_pack<decltype(width)::value>(fields, n, packed, first_bad, stream);
  });
}

// Unpacks n fields of `bits` bits from ceil(n * bits / 8) bytes at `packed` into `fields`.
// Returns cudaErrorInvalidValue for bits outside kPackWidths (launch_params.h) or n < 0.
cudaError_t commpress_unpack_bits_cuda(const uint8_t* packed, int64_t n, int bits,
                                       uint8_t* fields, cudaStream_t stream) {
  if (n < 0) {
    return cudaErrorInvalidValue;
  }
  return commpress::cuda::dispatch_width<commpress::cuda::kPackWidths>(bits, [&](auto width) {
    return commpress::launch_unpack<decltype(width)::value>(packed, n, fields, stream);
  });
}

}  // extern "C"
#endif  // __CUDACC_RTC__
