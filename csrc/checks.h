// Argument checks shared by the CPU ops (csrc/cpu/*.cpp) and the CUDA bindings
// (csrc/cuda/bindings.cpp). Every failure is a TORCH_CHECK (RuntimeError in Python) whose
// message starts with "<op>: <argument>", so commpress/ops.py can re-raise it as CodecError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

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
      TORCH_CHECK(false, op, ": ", name,
                  " must have dtype float32, float16, bfloat16 or float64, got ",
                  t.scalar_type());
  }
}

// Arithmetic, residual and scale dtype of the codecs: float64 for float64, float32 otherwise.
inline at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// An optional error-feedback residual: 1-D, contiguous, as long as x, in x's compute dtype.
inline void check_residual(const char* op, const at::Tensor& e, const at::Tensor& x) {
  check_vector(op, "residual", e, x.device().type());
  check_same_device(op, "residual", e, x, "x");
  check_dtype(op, "residual", e, compute_type(x.scalar_type()));
  TORCH_CHECK(e.numel() == x.numel(), op, ": residual has ", e.numel(), " elements, x has ",
              x.numel());
}

inline int64_t n_blocks(int64_t n, int64_t block) { return n == 0 ? 0 : (n + block - 1) / block; }

inline void check_qsgd_params(const char* op, int64_t bits, int64_t levels, int64_t bucket) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, op, ": bits must be one of 2, 4, 8, got ",
              bits);
  const int64_t top = (int64_t{1} << (bits - 1)) - 1;
  TORCH_CHECK(levels >= 1 && levels <= top, op, ": levels must be in [1, ", top,
              "] for bits=", bits, ", got ", levels);
  TORCH_CHECK(bucket >= 1, op, ": bucket_size must be >= 1, got ", bucket);
}

// Seeds are uint64 in Python; the schema's int is int64, so they travel as their bit pattern.
inline uint64_t seed_bits(int64_t seed) { return static_cast<uint64_t>(seed); }

}  // namespace commpress
