// The native ops' own checks, shared by the CPU ops (csrc/cpu/*.cpp) and the CUDA bindings
// (csrc/cuda/bindings.cpp).
//
// The argument contract of every op is validated once, in Python, before any backend runs
// (commpress/kernels/checks.py); these checks only keep a direct call of torch.ops.commpress.*
// from touching memory it must not: devices, layouts, element types, sizes and the arithmetic
// that sizes outputs. Their messages name the op and the argument but need not match Python's.
//
// Failure kinds, told apart by type rather than by message (commpress/kernels/ops.py):
//  * NaN/Inf in the values an op was given: c10::ValueError (Python ValueError), raised by
//    check_finite() before anything was written;
//  * everything else: c10::Error (Python RuntimeError).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "commpress/bitpack.h"
#include "commpress/hd.h"

namespace commpress {

inline const char* device_name(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? "CUDA" : "CPU";
}

// A 1-D contiguous tensor on `device`.
inline void check_vector(const char* op, const char* name, const at::Tensor& t,
                         c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, op, ": ", name, " must be a ", device_name(device),
              " tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must have dtype ", want, ", got ",
              t.scalar_type());
}

// A 1-D contiguous uint8 tensor on `device` (bit packing).
inline void check_byte_vector(const char* op, const char* name, const at::Tensor& t,
                              c10::DeviceType device) {
  check_vector(op, name, t, device);
  check_dtype(op, name, t, at::kByte);
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device());
}

// The launcher/table code of a float dtype the codecs accept.
inline DType float_code(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kDouble: return kF64;
    default:
      TORCH_CHECK(false, op, ": ", name, " must be a float tensor, got ", t.scalar_type());
  }
}

// Arithmetic, residual and scale dtype of the codecs: float64 for float64, float32 otherwise
// (commpress.dtypes.accumulate_dtype).
inline at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Largest finite value of a codec dtype (QSGD norms must fit the input's dtype).
inline double dtype_max(DType dtype) {
  switch (dtype) {
    case kF16: return 65504.0;
    case kBF16: return 3.3895313892515355e38;
    case kF32: return 3.4028234663852886e38;
    default: return 1.7976931348623157e308;
  }
}

// An optional error-feedback residual: 1-D, contiguous, as long as x, in x's compute dtype.
inline void check_residual(const char* op, const at::Tensor& e, const at::Tensor& x) {
  check_vector(op, "residual", e, x.device().type());
  check_same_device(op, "residual", e, x, "x");
  check_dtype(op, "residual", e, compute_type(x.scalar_type()));
  TORCH_CHECK(e.numel() == x.numel(), op, ": residual has ", e.numel(), " elements, x has ",
              x.numel());
}

// Blocks of `block` (>= 1) elements covering n >= 0, without overflow for any int64 block.
inline int64_t n_blocks(int64_t n, int64_t block) {
  return n == 0 ? 0 : n / block + (n % block != 0 ? 1 : 0);
}

// The block length the kernels use: `block` itself, or n (at least 1) for block 0 or a block
// longer than the tensor -- the same single block, and no arithmetic near INT64_MAX after it.
inline int64_t effective_block(int64_t n, int64_t block) {
  const int64_t whole = std::max<int64_t>(n, 1);
  return block == 0 || block > whole ? whole : block;
}

inline void check_block(const char* op, const char* name, int64_t block, int64_t min) {
  TORCH_CHECK(block >= min, op, ": ", name, " must be >= ", min, ", got ", block);
}

// A bit-packing field width (the kernel tables have these four).
inline void check_bits(const char* op, int64_t bits) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, op,
              ": bits must be one of 1, 2, 4, 8, got ", bits);
}

// QSGD's width (sizes the packed output, picks the kernel), level count (fields index
// 256-entry tables) and bucket length.
inline void check_qsgd_params(const char* op, int64_t bits, int64_t levels, int64_t bucket) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, op, ": bits must be one of 2, 4, 8, got ",
              bits);
  const int64_t top = (int64_t{1} << (bits - 1)) - 1;
  TORCH_CHECK(levels >= 1 && levels <= top, op, ": levels must be in [1, ", top,
              "] for bits=", bits, ", got ", levels);
  check_block(op, "bucket_size", bucket, 1);
}

// Random-k's k for n elements: k <= n (one element per stratum) and strata shorter than 2**32
// (the RNG draws 32-bit offsets).
inline void check_strata(const char* op, int64_t n, int64_t k) {
  TORCH_CHECK(k >= 0 && k <= n, op, ": k must be in [0, numel=", n, "], got ", k);
  TORCH_CHECK(n == 0 || k >= 1, op, ": k must be >= 1 for a non-empty tensor");
  TORCH_CHECK(k == 0 || n_blocks(n, k) < (int64_t{1} << 32), op, ": k=", k,
              " is too small for numel=", n, " (strata longer than 2**32)");
  TORCH_CHECK(k < (int64_t{1} << 32), op, ": k=", k, " must be < 2**32");
}

// A tensor that goes with `out`: 1-D, contiguous, on out's device, of dtype `want`.
inline void check_companion(const char* op, const char* name, const at::Tensor& t,
                            const at::Tensor& out, at::ScalarType want) {
  check_vector(op, name, t, out.device().type());
  check_same_device(op, name, t, out, "out");
  check_dtype(op, name, t, want);
}

// sign_decode's arguments (one scale per block, one bit per output); returns out's dtype code.
inline DType check_sign_decode(const at::Tensor& scales, const at::Tensor& bits,
                               int64_t block_size, const at::Tensor& out,
                               c10::DeviceType device) {
  static constexpr const char* op = "sign_decode";
  check_vector(op, "out", out, device);
  const DType dtype = float_code(op, "out", out);
  check_companion(op, "scales", scales, out, compute_type(out.scalar_type()));
  check_companion(op, "bits", bits, out, at::kByte);
  check_block(op, "block_size", block_size, 0);
  const int64_t n = out.numel();
  const int64_t block = effective_block(n, block_size);
  TORCH_CHECK(scales.numel() == n_blocks(n, block), op, ": scales has ", scales.numel(),
              " elements, ", n, " outputs in blocks of ", block, " need ", n_blocks(n, block));
  TORCH_CHECK(bits.numel() == packed_nbytes(n, 1), op, ": bits has ", bits.numel(),
              " bytes, ", n, " outputs need ", packed_nbytes(n, 1));
  return dtype;
}

// The int8 / int4 codecs' width and block length.
inline void check_blockint_params(const char* op, int64_t bits, int64_t block_size) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be one of 4, 8, got ", bits);
  check_block(op, "block_size", block_size, 1);
}

// blockint_decode's arguments (one scale per block, `bits` bits per output); returns out's code.
inline DType check_blockint_decode(const at::Tensor& scales, const at::Tensor& packed,
                                   int64_t bits, int64_t block_size, const at::Tensor& out,
                                   c10::DeviceType device) {
  static constexpr const char* op = "blockint_decode";
  check_vector(op, "out", out, device);
  const DType dtype = float_code(op, "out", out);
  check_blockint_params(op, bits, block_size);
  check_companion(op, "scales", scales, out, compute_type(out.scalar_type()));
  check_companion(op, "packed", packed, out, at::kByte);
  const int64_t n = out.numel();
  const int64_t block = effective_block(n, block_size);
  TORCH_CHECK(scales.numel() == n_blocks(n, block), op, ": scales has ", scales.numel(),
              " elements, ", n, " outputs in blocks of ", block_size, " need ",
              n_blocks(n, block));
  TORCH_CHECK(packed.numel() == packed_nbytes(n, bits), op, ": packed has ", packed.numel(),
              " bytes, ", n, " fields of bits=", bits, " need ", packed_nbytes(n, bits));
  return dtype;
}

// The ternary kind's packed bytes (commpress/spec/ternary.py): n elements in blocks of
// block_size (>= 1; the last block padded to a whole one, even a block longer than the
// tensor), five levels per byte. Raises when the padded length passes INT64_MAX.
inline int64_t check_ternary_sizes(const char* op, int64_t n, int64_t block_size) {
  check_block(op, "block_size", block_size, 1);
  const int64_t nblocks = n_blocks(n, block_size);
  TORCH_CHECK(nblocks == 0 || block_size <= (INT64_MAX - 4) / nblocks, op, ": ", n,
              " elements padded to whole blocks of block_size=", block_size, " pass 2**63");
  return (nblocks * block_size + 4) / 5;
}

// ternary_decode's arguments: float32 out, one float32 scale per block, the packed bytes.
inline void check_ternary_decode(const at::Tensor& scales, const at::Tensor& packed,
                                 int64_t block_size, const at::Tensor& out,
                                 c10::DeviceType device) {
  static constexpr const char* op = "ternary_decode";
  check_vector(op, "out", out, device);
  check_dtype(op, "out", out, at::kFloat);
  check_companion(op, "scales", scales, out, at::kFloat);
  check_companion(op, "packed", packed, out, at::kByte);
  const int64_t n = out.numel();
  const int64_t nbytes = check_ternary_sizes(op, n, block_size);
  TORCH_CHECK(scales.numel() == n_blocks(n, block_size), op, ": scales has ", scales.numel(),
              " elements, ", n, " outputs in blocks of ", block_size, " need ",
              n_blocks(n, block_size));
  TORCH_CHECK(packed.numel() == nbytes, op, ": packed has ", packed.numel(), " bytes, ", n,
              " outputs in blocks of ", block_size, " need ", nbytes);
}

// qsgd_decode's arguments (one norm per bucket, `bits` bits per output); returns out's code.
inline DType check_qsgd_decode(const at::Tensor& norms, const at::Tensor& packed, int64_t bits,
                               int64_t levels, int64_t bucket_size, const at::Tensor& out,
                               c10::DeviceType device) {
  static constexpr const char* op = "qsgd_decode";
  check_vector(op, "out", out, device);
  const DType dtype = float_code(op, "out", out);
  check_qsgd_params(op, bits, levels, bucket_size);
  check_companion(op, "norms", norms, out, compute_type(out.scalar_type()));
  check_companion(op, "packed", packed, out, at::kByte);
  const int64_t n = out.numel();
  TORCH_CHECK(norms.numel() == n_blocks(n, bucket_size), op, ": norms has ", norms.numel(),
              " elements, ", n, " outputs in buckets of ", bucket_size, " need ",
              n_blocks(n, bucket_size));
  TORCH_CHECK(packed.numel() == packed_nbytes(n, bits), op, ": packed has ", packed.numel(),
              " bytes, ", n, " fields of bits=", bits, " need ", packed_nbytes(n, bits));
  return dtype;
}

// sparse_scatter_add's tensors (the index values are checked by the kernels, before any
// write); returns out's dtype code.
inline DType check_sparse_scatter_add(at::TensorList indices, at::TensorList values,
                                      const at::Tensor& out, c10::DeviceType device) {
  static constexpr const char* op = "sparse_scatter_add";
  check_vector(op, "out", out, device);
  const DType dtype = float_code(op, "out", out);
  TORCH_CHECK(indices.size() == values.size(), op, ": got ", indices.size(),
              " index tensors but ", values.size(), " value tensors");
  for (size_t p = 0; p < indices.size(); ++p) {
    const at::Tensor& idx = indices[p];
    const at::Tensor& val = values[p];
    check_vector(op, "indices[p]", idx, device);
    check_vector(op, "values[p]", val, device);
    check_same_device(op, "indices[p]", idx, out, "out");
    check_same_device(op, "values[p]", val, out, "out");
    TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, op,
                ": indices[", p, "] must have dtype int32 or int64, got ", idx.scalar_type());
    TORCH_CHECK(val.scalar_type() == out.scalar_type(), op, ": values[", p, "] has dtype ",
                val.scalar_type(), ", out has ", out.scalar_type());
    TORCH_CHECK(idx.numel() == val.numel(), op, ": indices[", p, "] has ", idx.numel(),
                " elements, values[", p, "] has ", val.numel());
  }
  return dtype;
}

// randomk_scatter_add's tensors (k = values.numel() strata of out); returns out's dtype code.
inline DType check_randomk_scatter_add(const at::Tensor& values, const at::Tensor& out,
                                       c10::DeviceType device) {
  static constexpr const char* op = "randomk_scatter_add";
  check_vector(op, "out", out, device);
  const DType dtype = float_code(op, "out", out);
  check_vector(op, "values", values, device);
  check_same_device(op, "values", values, out, "out");
  TORCH_CHECK(values.scalar_type() == out.scalar_type(), op, ": values has dtype ",
              values.scalar_type(), ", out has ", out.scalar_type());
  check_strata(op, out.numel(), values.numel());
  return dtype;
}

// An encode's input: x a 1-D contiguous float tensor on `device`, and its optional residual.
struct EncodeInput {
  DType dtype;
  const at::Tensor* residual;  // nullptr when absent
};

inline EncodeInput check_encode_input(const char* op, const at::Tensor& x,
                                      const std::optional<at::Tensor>& residual,
                                      c10::DeviceType device) {
  check_vector(op, "x", x, device);
  const DType dtype = float_code(op, "x", x);
  const at::Tensor* e = residual.has_value() ? &*residual : nullptr;
  if (e != nullptr) {
    check_residual(op, *e, x);
  }
  return {dtype, e};
}

// Raises the non-finite kind (c10::ValueError) unless `finite`: NaN or Inf in what the op was
// asked to encode (`what`: "x" or "x + residual"); nothing has been written.
inline void check_finite(bool finite, const char* op, const char* what) {
  TORCH_CHECK_VALUE(finite, op, ": ", what, " contains NaN or Inf; nothing was written");
}

// Seeds are uint64 in Python; the schema's int is int64, so they travel as their bit pattern.
inline uint64_t seed_bits(int64_t seed) { return static_cast<uint64_t>(seed); }

}  // namespace commpress
