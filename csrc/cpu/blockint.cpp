// CPU kernels of commpress::blockint_encode (and its stochastic variant blockint_encode_sr) and
// commpress::blockint_decode (schemas in
// registration.cpp; specification: commpress/spec/blockint.py, the int8 / int4 codecs).
//
// Encode is one pass over x: the blocks are cut into cache-sized chunks, and each chunk's
// scales (absmax / q_max) are computed and then its fields, while the chunk is still in cache.
// The outputs are fresh, so writing them before the whole input is validated is harmless: NaN
// or Inf anywhere, or a scale whose q_max multiple overflows x's dtype, raises and drops them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "commpress/bitpack.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.h"

namespace commpress {
namespace {

// Whether q_max * top, the largest decoded magnitude, is finite in the compute dtype and
// after rounding to x's dtype (commpress.spec.blockint.check_decodable).
bool decodable(DType dtype, double top, int qmax) {
  if (dtype == kF64) {
    return std::isfinite(top * static_cast<double>(qmax));
  }
  const float t = static_cast<float>(top) * static_cast<float>(qmax);
  if (!std::isfinite(t)) {
    return false;
  }
  if (dtype == kF16) {
    return std::isfinite(half_to_float(float_to_half(t)));
  }
  if (dtype == kBF16) {
    return std::isfinite(bf16_to_float(float_to_bf16(t)));
  }
  return true;
}

// Blocks per task: about kTaskElems elements, an even count so every task starts on a whole
// packed byte of 4-bit fields.
int64_t chunk_blocks(int64_t block) {
  const int64_t c = std::max<int64_t>(1, cpu::kTaskElems / block);
  return c + (c % 2);
}

// The deterministic encode (stochastic = false) or the stochastically rounded one, whose
// uniforms come from the stream of `seed` (blockint_field_sr).
std::tuple<at::Tensor, at::Tensor> encode_impl(const char* op, const at::Tensor& x, int64_t bits,
                                               int64_t block_size, bool stochastic, int64_t seed) {
  check_vector(op, "x", x, c10::DeviceType::CPU);
  const DType dtype = float_code(op, "x", x);
  check_blockint_params(op, bits, block_size);
  const int64_t n = x.numel();
  const int64_t block = effective_block(n, block_size);
  const int64_t nblocks = n_blocks(n, block);
  const at::ScalarType ct = compute_type(x.scalar_type());
  at::Tensor scales = at::empty({nblocks}, x.options().dtype(ct));
  at::Tensor packed = at::empty({packed_nbytes(n, bits)}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {scales, packed};
  }
  const int qmax = bits == 8 ? 127 : 7;
  const uint64_t key = stochastic ? rng_key(static_cast<uint64_t>(seed), kStreamBlockIntSR) : 0;
  const cpu::BlockIntEncodeArgs args{x.const_data_ptr(), scales.mutable_data_ptr(),
                                     packed.mutable_data_ptr<uint8_t>(), n, block, qmax, key};
  const auto& table = stochastic ? cpu::kernels().blockint_encode_sr : cpu::kernels().blockint_encode;
  const cpu::BlockIntEncodeFn fn = table[dtype][cpu::blockint_bits_index(bits)];
  const int64_t per = chunk_blocks(block);
  const int64_t nchunks = n_blocks(nblocks, per);
  std::vector<double> tops(static_cast<size_t>(nchunks), 0.0);
  std::atomic<bool> bad{false};
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = c * per;
      const int64_t b1 = std::min(b0 + per, nblocks);
      if (!fn(args, b0, b1, &tops[static_cast<size_t>(c)])) {
        bad.store(true, std::memory_order_relaxed);
      }
    }
  });
  check_finite(!bad.load(), op, "x");
  const double top = *std::max_element(tops.begin(), tops.end());
  TORCH_CHECK(decodable(dtype, top, qmax), op, ": values too close to ", x.scalar_type(),
              "'s largest value: the decode of int", bits,
              " would overflow (nothing was written)");
  return {scales, packed};
}

std::tuple<at::Tensor, at::Tensor> blockint_encode_cpu(const at::Tensor& x, int64_t bits,
                                                       int64_t block_size) {
  return encode_impl("blockint_encode", x, bits, block_size, false, 0);
}

std::tuple<at::Tensor, at::Tensor> blockint_encode_sr_cpu(const at::Tensor& x, int64_t bits,
                                                          int64_t block_size, int64_t seed) {
  return encode_impl("blockint_encode_sr", x, bits, block_size, true, seed);
}

void blockint_decode_cpu(const at::Tensor& scales, const at::Tensor& packed, int64_t bits,
                         int64_t block_size, const at::Tensor& out, bool accumulate) {
  const DType dtype =
      check_blockint_decode(scales, packed, bits, block_size, out, c10::DeviceType::CPU);
  const int64_t n = out.numel();
  const int64_t block = effective_block(n, block_size);
  if (n == 0) {
    return;
  }
  const cpu::BlockIntDecodeArgs args{scales.const_data_ptr(), packed.const_data_ptr<uint8_t>(),
                                     out.data_ptr(), n, block, bits == 8 ? 127 : 7, accumulate};
  const cpu::BlockIntDecodeFn fn =
      cpu::kernels().blockint_decode[dtype][cpu::blockint_bits_index(bits)];
  cpu::parallel_elements(n, cpu::kTaskElems, [&](int64_t i0, int64_t i1) { fn(args, i0, i1); });
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("blockint_encode", &blockint_encode_cpu);
  m.impl("blockint_encode_sr", &blockint_encode_sr_cpu);
  m.impl("blockint_decode", &blockint_decode_cpu);
}

}  // namespace commpress
