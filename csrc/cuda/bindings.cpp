// CUDA kernels of every commpress op: argument checks (csrc/checks.h), output and scratch
// allocation through torch's caching allocator, and the launch on torch's current stream.
// The kernels themselves are plain CUDA in csrc/cuda/*.cu behind the C launchers of
// launchers.h.
//
// Ops that can fail on the data (NaN/Inf, an overflowing scale, a bad index) read a small
// device word back after the launch, which synchronises the stream: the price of raising a
// clear error. The kernels that write outputs check that word first, so on failure nothing
// was written (an error-feedback residual keeps its value).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "commpress/bitpack.h"
#include "launch_params.h"
#include "launchers.h"

namespace commpress {
namespace {

constexpr auto kCUDA = c10::DeviceType::CUDA;

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// The flags word of a launch, copied back (synchronises the stream).
int read_flags(const at::Tensor& flags) { return flags.item<int>(); }

// ----- bit packing ---------------------------------------------------------------------------

at::Tensor pack_bits_cuda(const at::Tensor& fields, int64_t bits) {
  check_bits("pack_bits", bits);
  check_byte_vector("pack_bits", "fields", fields, kCUDA);
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
      reinterpret_cast<unsigned long long*>(first_bad.mutable_data_ptr<int64_t>()), stream()));
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
  check_byte_vector("unpack_bits", "packed", packed, kCUDA);
  TORCH_CHECK(n >= 0, "unpack_bits: n must be >= 0, got ", n);
  const int64_t expected = packed_nbytes(n, bits);
  TORCH_CHECK(packed.numel() == expected, "unpack_bits: packed holds ", packed.numel(),
              " bytes, but n=", n, " fields of bits=", bits, " need ", expected);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor fields = at::empty({n}, packed.options());
  C10_CUDA_CHECK(commpress_unpack_bits_cuda(packed.const_data_ptr<uint8_t>(), n,
                                            static_cast<int>(bits),
                                            fields.mutable_data_ptr<uint8_t>(), stream()));
  return fields;
}

// ----- sign ----------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> sign_encode_cuda(const at::Tensor& x,
                                                    const std::optional<at::Tensor>& residual,
                                                    int64_t block_size) {
  static constexpr const char* op = "sign_encode";
  const auto [dtype, e] = check_encode_input(op, x, residual, kCUDA);
  check_block(op, "block_size", block_size, 0);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t block = effective_block(n, block_size);
  const at::ScalarType ct = compute_type(x.scalar_type());
  at::Tensor scales = at::empty({n_blocks(n, block)}, x.options().dtype(ct));
  at::Tensor bits = at::empty({packed_nbytes(n, 1)}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {scales, bits};
  }
  at::Tensor scratch =
      at::empty({commpress_reduce_scratch_cuda(n, block)}, x.options().dtype(at::kDouble));
  at::Tensor flags = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(commpress_sign_encode_cuda(
      x.const_data_ptr(), dtype, e != nullptr ? e->data_ptr() : nullptr, n, block,
      scales.data_ptr(), bits.mutable_data_ptr<uint8_t>(), scratch.mutable_data_ptr<double>(),
      flags.mutable_data_ptr<int>(), stream()));
  const int f = read_flags(flags);
  check_finite(!(f & cuda::kFlagNonFinite), op, e != nullptr ? "x + residual" : "x");
  TORCH_CHECK(!(f & cuda::kFlagOverflow), op, ": a block's mean magnitude overflows ", ct,
              " (NaN or Inf scale; nothing was written)");
  return {scales, bits};
}

void sign_decode_cuda(const at::Tensor& scales, const at::Tensor& bits, int64_t block_size,
                      const at::Tensor& out, bool accumulate) {
  const DType dtype = check_sign_decode(scales, bits, block_size, out, kCUDA);
  const int64_t n = out.numel();
  const int64_t block = effective_block(n, block_size);
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(commpress_sign_decode_cuda(scales.const_data_ptr(),
                                            bits.const_data_ptr<uint8_t>(), n, block, dtype,
                                            out.data_ptr(), accumulate ? 1 : 0, stream()));
}

// ----- qsgd ----------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> qsgd_encode_cuda(const at::Tensor& x,
                                                    const std::optional<at::Tensor>& residual,
                                                    int64_t bits, int64_t levels,
                                                    int64_t bucket_size, int64_t seed) {
  static constexpr const char* op = "qsgd_encode";
  const auto [dtype, e] = check_encode_input(op, x, residual, kCUDA);
  check_qsgd_params(op, bits, levels, bucket_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const at::ScalarType ct = compute_type(x.scalar_type());
  at::Tensor norms = at::empty({n_blocks(n, bucket_size)}, x.options().dtype(ct));
  at::Tensor packed = at::empty({packed_nbytes(n, bits)}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {norms, packed};
  }
  at::Tensor scratch =
      at::empty({commpress_reduce_scratch_cuda(n, bucket_size)}, x.options().dtype(at::kDouble));
  at::Tensor flags = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(commpress_qsgd_encode_cuda(
      x.const_data_ptr(), dtype, e != nullptr ? e->data_ptr() : nullptr, n,
      static_cast<int>(bits), static_cast<int>(levels), bucket_size, seed_bits(seed),
      dtype_max(dtype), norms.data_ptr(), packed.mutable_data_ptr<uint8_t>(),
      scratch.mutable_data_ptr<double>(), flags.mutable_data_ptr<int>(), stream()));
  const int f = read_flags(flags);
  check_finite(!(f & cuda::kFlagNonFinite), op, e != nullptr ? "x + residual" : "x");
  TORCH_CHECK(!(f & cuda::kFlagOverflow), op, ": a bucket norm overflows ", ct,
              " (NaN or Inf norm; nothing was written)");
  if (f & cuda::kFlagTooBig) {
    const double limit = dtype_max(dtype);
    const double big = norms.masked_select(norms.gt(limit))[0].item<double>();
    TORCH_CHECK(false, op, ": a bucket norm ", big, " exceeds ", x.scalar_type(),
                "'s range; use a smaller bucket_size (nothing was written)");
  }
  return {norms, packed};
}

void qsgd_decode_cuda(const at::Tensor& norms, const at::Tensor& packed, int64_t bits,
                      int64_t levels, int64_t bucket_size, const at::Tensor& out,
                      bool accumulate) {
  const DType dtype = check_qsgd_decode(norms, packed, bits, levels, bucket_size, out, kCUDA);
  const int64_t n = out.numel();
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(commpress_qsgd_decode_cuda(
      norms.const_data_ptr(), packed.const_data_ptr<uint8_t>(), n, static_cast<int>(bits),
      static_cast<int>(levels), bucket_size, dtype, out.data_ptr(), accumulate ? 1 : 0,
      stream()));
}

// ----- int8 / int4 ---------------------------------------------------------------------------

// The deterministic encode (no seed) or the stochastically rounded one, whose uniforms come
// from the stream of `seed` (the schema's int64 carrying the uint64's bits).
std::tuple<at::Tensor, at::Tensor> blockint_encode_impl(const char* op, const at::Tensor& x,
                                                        int64_t bits, int64_t block_size,
                                                        std::optional<int64_t> seed) {
  check_vector(op, "x", x, kCUDA);
  const DType dtype = float_code(op, "x", x);
  check_blockint_params(op, bits, block_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t block = effective_block(n, block_size);
  const at::ScalarType ct = compute_type(x.scalar_type());
  at::Tensor scales = at::empty({n_blocks(n, block)}, x.options().dtype(ct));
  at::Tensor packed = at::empty({packed_nbytes(n, bits)}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {scales, packed};
  }
  // per-block max |x| as the magnitude's bits (uint64 words)
  at::Tensor amax =
      at::empty({commpress_blockint_scratch_cuda(n, block)}, x.options().dtype(at::kLong));
  at::Tensor flags = at::empty({1}, x.options().dtype(at::kInt));
  auto* amax_words = reinterpret_cast<unsigned long long*>(amax.mutable_data_ptr<int64_t>());
  C10_CUDA_CHECK(
      seed.has_value()
          ? commpress_blockint_encode_sr_cuda(x.const_data_ptr(), dtype, n, static_cast<int>(bits),
                                              block, seed_bits(*seed), scales.data_ptr(),
                                              packed.mutable_data_ptr<uint8_t>(), amax_words,
                                              flags.mutable_data_ptr<int>(), stream())
          : commpress_blockint_encode_cuda(x.const_data_ptr(), dtype, n, static_cast<int>(bits),
                                           block, scales.data_ptr(),
                                           packed.mutable_data_ptr<uint8_t>(), amax_words,
                                           flags.mutable_data_ptr<int>(), stream()));
  const int f = read_flags(flags);
  check_finite(!(f & cuda::kFlagNonFinite), op, "x");
  TORCH_CHECK(!(f & cuda::kFlagOverflow), op, ": values too close to ", x.scalar_type(),
              "'s largest value: the decode of int", bits, " would overflow (nothing was written)");
  return {scales, packed};
}

std::tuple<at::Tensor, at::Tensor> blockint_encode_cuda(const at::Tensor& x, int64_t bits,
                                                        int64_t block_size) {
  return blockint_encode_impl("blockint_encode", x, bits, block_size, std::nullopt);
}

std::tuple<at::Tensor, at::Tensor> blockint_encode_sr_cuda(const at::Tensor& x, int64_t bits,
                                                           int64_t block_size, int64_t seed) {
  return blockint_encode_impl("blockint_encode_sr", x, bits, block_size, seed);
}

void blockint_decode_cuda(const at::Tensor& scales, const at::Tensor& packed, int64_t bits,
                          int64_t block_size, const at::Tensor& out, bool accumulate) {
  const DType dtype = check_blockint_decode(scales, packed, bits, block_size, out, kCUDA);
  const int64_t n = out.numel();
  const int64_t block = effective_block(n, block_size);
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(commpress_blockint_decode_cuda(
      scales.const_data_ptr(), packed.const_data_ptr<uint8_t>(), n, static_cast<int>(bits),
      block, dtype, out.data_ptr(), accumulate ? 1 : 0, stream()));
}

// ----- ternary -------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> ternary_encode_sr_cuda(const at::Tensor& x, int64_t block_size,
                                                          int64_t seed) {
  static constexpr const char* op = "ternary_encode_sr";
  check_vector(op, "x", x, kCUDA);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op,
              ": x must have dtype float32 (the ternary kind stores float32), got ",
              x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t nbytes = check_ternary_sizes(op, n, block_size);
  at::Tensor scales = at::empty({n_blocks(n, block_size)}, x.options());
  at::Tensor packed = at::empty({nbytes}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {scales, packed};
  }
  at::Tensor amax =
      at::empty({commpress_blockint_scratch_cuda(n, block_size)}, x.options().dtype(at::kLong));
  at::Tensor flags = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(commpress_ternary_encode_sr_cuda(
      x.const_data_ptr<float>(), n, block_size, nbytes, seed_bits(seed),
      scales.mutable_data_ptr<float>(), packed.mutable_data_ptr<uint8_t>(),
      reinterpret_cast<unsigned long long*>(amax.mutable_data_ptr<int64_t>()),
      flags.mutable_data_ptr<int>(), stream()));
  check_finite(!(read_flags(flags) & cuda::kFlagNonFinite), op, "x");
  return {scales, packed};
}

void ternary_decode_cuda(const at::Tensor& scales, const at::Tensor& packed, int64_t block_size,
                         const at::Tensor& out) {
  check_ternary_decode(scales, packed, block_size, out, kCUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(commpress_ternary_decode_cuda(scales.const_data_ptr<float>(),
                                               packed.const_data_ptr<uint8_t>(), out.numel(),
                                               block_size, out.mutable_data_ptr<float>(), stream()));
}

// ----- top-k and sparse scatter-add ----------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> topk_select_cuda(const at::Tensor& x, int64_t k) {
  static constexpr const char* op = "topk_select";
  check_vector(op, "x", x, kCUDA);
  const DType dtype = float_code(op, "x", x);
  const int64_t n = x.numel();
  TORCH_CHECK(k >= 0 && k <= n, op, ": k must be in [0, numel=", n, "], got ", k);
  const c10::cuda::CUDAGuard guard(x.device());
  const bool index64 = n > INT32_MAX;
  at::Tensor indices = at::empty({k}, x.options().dtype(index64 ? at::kLong : at::kInt));
  at::Tensor values = at::empty({k}, x.options());
  if (n == 0) {
    return {indices, values};
  }
  at::Tensor scratch = at::empty({commpress_topk_scratch_cuda(n)}, x.options().dtype(at::kByte));
  at::Tensor flags = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(commpress_topk_select_cuda(x.const_data_ptr(), dtype, n, k, indices.data_ptr(),
                                            index64 ? 1 : 0, values.data_ptr(),
                                            scratch.data_ptr(), flags.mutable_data_ptr<int>(),
                                            stream()));
  check_finite(!(read_flags(flags) & cuda::kFlagNonFinite), op, "x");
  return {indices, values};
}

void sparse_scatter_add_cuda(at::TensorList indices, at::TensorList values,
                             const at::Tensor& out) {
  static constexpr const char* op = "sparse_scatter_add";
  const DType dtype = check_sparse_scatter_add(indices, values, out, kCUDA);
  const int64_t n = out.numel();
  if (indices.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(out.device());
  // All payloads are validated before any is added: the add kernels skip once first_bad is set.
  at::Tensor first_bad = at::full({1}, -1, out.options().dtype(at::kLong));  // UINT64_MAX
  auto* bad = reinterpret_cast<unsigned long long*>(first_bad.mutable_data_ptr<int64_t>());
  for (size_t p = 0; p < indices.size(); ++p) {
    C10_CUDA_CHECK(commpress_scatter_validate_cuda(
        indices[p].const_data_ptr(), indices[p].scalar_type() == at::kLong ? 1 : 0,
        indices[p].numel(), n, static_cast<int64_t>(p), bad, stream()));
  }
  for (size_t p = 0; p < indices.size(); ++p) {
    C10_CUDA_CHECK(commpress_scatter_add_cuda(
        indices[p].const_data_ptr(), indices[p].scalar_type() == at::kLong ? 1 : 0,
        values[p].const_data_ptr(), indices[p].numel(), dtype, out.data_ptr(), bad, stream()));
  }
  const auto code = static_cast<unsigned long long>(first_bad.item<int64_t>());
  if (code != ~0ull) {
    const auto p = static_cast<int64_t>(code >> 40);
    const auto j = static_cast<int64_t>((code >> 1) & ((1ull << 39) - 1));
    const int64_t v = indices[p][j].item<int64_t>();
    TORCH_CHECK(code & 1, op, ": indices[", p, "][", j, "] = ", v, " is out of range [0, ", n,
                ")");
    TORCH_CHECK(false, op, ": indices[", p, "] must be strictly increasing (no duplicates): indices[",
                p, "][", j, "] = ", v, " follows ", indices[p][j - 1].item<int64_t>());
  }
}

// ----- random-k ------------------------------------------------------------------------------

at::Tensor randomk_gather_cuda(const at::Tensor& x, int64_t k, int64_t seed, bool scaled) {
  static constexpr const char* op = "randomk_gather";
  check_vector(op, "x", x, kCUDA);
  const DType dtype = float_code(op, "x", x);
  const int64_t n = x.numel();
  check_strata(op, n, k);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor values = at::empty({k}, x.options());
  if (n == 0) {
    return values;
  }
  at::Tensor flags = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(commpress_randomk_gather_cuda(x.const_data_ptr(), dtype, n, k, seed_bits(seed),
                                               scaled ? 1 : 0, values.data_ptr(),
                                               flags.mutable_data_ptr<int>(), stream()));
  const int f = read_flags(flags);
  check_finite(!(f & cuda::kFlagNonFinite), op, "x");
  TORCH_CHECK(!(f & cuda::kFlagOverflow), op, ": x scaled by its block length overflows ", x.scalar_type(),
              "; use scaled=False");
  return values;
}

void randomk_scatter_add_cuda(const at::Tensor& values, int64_t seed, const at::Tensor& out) {
  const DType dtype = check_randomk_scatter_add(values, out, kCUDA);
  const int64_t n = out.numel();
  const int64_t k = values.numel();
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(commpress_randomk_scatter_add_cuda(values.const_data_ptr(), dtype, k, n,
                                                    seed_bits(seed), out.data_ptr(), stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CUDA, m) {
  m.impl("pack_bits", &pack_bits_cuda);
  m.impl("unpack_bits", &unpack_bits_cuda);
  m.impl("sign_encode", &sign_encode_cuda);
  m.impl("sign_decode", &sign_decode_cuda);
  m.impl("qsgd_encode", &qsgd_encode_cuda);
  m.impl("qsgd_decode", &qsgd_decode_cuda);
  m.impl("topk_select", &topk_select_cuda);
  m.impl("sparse_scatter_add", &sparse_scatter_add_cuda);
  m.impl("randomk_gather", &randomk_gather_cuda);
  m.impl("randomk_scatter_add", &randomk_scatter_add_cuda);
  m.impl("blockint_encode", &blockint_encode_cuda);
  m.impl("blockint_encode_sr", &blockint_encode_sr_cuda);
  m.impl("blockint_decode", &blockint_decode_cuda);
  m.impl("ternary_encode_sr", &ternary_encode_sr_cuda);
  m.impl("ternary_decode", &ternary_decode_cuda);
}

}  // namespace commpress
