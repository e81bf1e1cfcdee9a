// CUDA kernels of commpress::pack_bits / commpress::unpack_bits: argument checks, output
// allocation and the launch on torch's current stream. The kernels live in bitpack.cu.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>

#include "commpress/bitpack.h"

// Launchers defined in bitpack.cu (C linkage, raw pointers; see the comments there).
extern "C" {
cudaError_t commpress_pack_bits_cuda(const uint8_t* fields, int64_t n, int bits,
                                     uint8_t* packed, unsigned long long* first_bad,
                                     cudaStream_t stream);
cudaError_t commpress_unpack_bits_cuda(const uint8_t* packed, int64_t n, int bits,
                                       uint8_t* fields, cudaStream_t stream);
}

namespace commpress {
namespace {

void check_bits(const char* op, int64_t bits) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8,
              op, ": bits must be one of 1, 2, 4, 8, got ", bits);
}

void check_byte_vector(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kByte, op, ": ", name, " must have dtype uint8, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

at::Tensor pack_bits_cuda(const at::Tensor& fields, int64_t bits) {
  check_bits("pack_bits", bits);
  check_byte_vector("pack_bits", "fields", fields);
  const c10::cuda::CUDAGuard guard(fields.device());
  const int64_t n = fields.numel();
  at::Tensor packed = at::empty({packed_nbytes(n, bits)}, fields.options());
  if (n == 0) {
    return packed;
  }
  // Index of the first out-of-range field, written by the kernel (UINT64_MAX = none).
  at::Tensor first_bad = at::empty({1}, fields.options().dtype(at::kLong));
  C10_CUDA_CHECK(commpress_pack_bits_cuda(
      fields.const_data_ptr<uint8_t>(), n, static_cast<int>(bits),
      packed.mutable_data_ptr<uint8_t>(),
      reinterpret_cast<unsigned long long*>(first_bad.mutable_data_ptr<int64_t>()),
      c10::cuda::getCurrentCUDAStream()));
  // Reading the word synchronises the stream: the price of raising on bad input (validation
  // itself is fused into the kernel; see bitpack.cu). UINT64_MAX reads back as -1.
  const int64_t bad = first_bad.item<int64_t>();
  if (bad >= 0) {
    TORCH_CHECK(false, "pack_bits: fields[", bad, "] = ",
                static_cast<int>(fields[bad].item<uint8_t>()), " does not fit in bits=", bits,
                " (every field must be < ", 1 << bits, ")");
  }
  return packed;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, int64_t bits, int64_t n) {
  check_bits("unpack_bits", bits);
  check_byte_vector("unpack_bits", "packed", packed);
  TORCH_CHECK(n >= 0, "unpack_bits: n must be >= 0, got ", n);
  const int64_t expected = packed_nbytes(n, bits);
  TORCH_CHECK(packed.numel() == expected, "unpack_bits: packed holds ", packed.numel(),
              " bytes, but n=", n, " fields of bits=", bits, " need ", expected);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor fields = at::empty({n}, packed.options());
  C10_CUDA_CHECK(commpress_unpack_bits_cuda(packed.const_data_ptr<uint8_t>(), n,
                                            static_cast<int>(bits),
                                            fields.mutable_data_ptr<uint8_t>(),
                                            c10::cuda::getCurrentCUDAStream()));
  return fields;
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CUDA, m) {
  m.impl("pack_bits", &pack_bits_cuda);
  m.impl("unpack_bits", &unpack_bits_cuda);
}

}  // namespace commpress
