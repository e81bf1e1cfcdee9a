// CPU kernels of commpress::ternary_encode_sr and commpress::ternary_decode (schemas in
// registration.cpp; specification: commpress/spec/ternary.py, the FSDP store's ternary kind).
//
// Encode is one pass over x, like blockint_encode_sr's: the blocks are cut into cache-sized
// chunks whose boundaries are whole blocks and whole bytes (multiples of 5 elements), and each
// chunk's scales and then its levels are computed while it is still in cache (kernels_impl.h:
// the stochastic rounding of blockint_encode_sr with q_max = 1 into a small tile, then five
// fields per byte). The outputs are fresh, so writing them before the whole input is validated
// is harmless: NaN or Inf anywhere raises and drops them. float32 only: the store keeps
// float32 tensors, and the specification computes in float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <tuple>

#include "../checks.h"
#include "commpress/codec_cores.h"
#include "commpress/rng.h"
#include "common.h"

namespace commpress {
namespace {

// Blocks per task: about kTaskElems elements and a whole number of bytes (a multiple of 5
// blocks unless the block is a multiple of 5 elements).
int64_t ternary_chunk_blocks(int64_t block) {
  const int64_t unit = block % kTernaryPerByte == 0 ? 1 : kTernaryPerByte;
  const int64_t c = std::max<int64_t>(1, cpu::kTaskElems / block);
  return (c + unit - 1) / unit * unit;
}

std::tuple<at::Tensor, at::Tensor> ternary_encode_sr_cpu(const at::Tensor& x, int64_t block_size,
                                                         int64_t seed) {
  static constexpr const char* op = "ternary_encode_sr";
  check_vector(op, "x", x, c10::DeviceType::CPU);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op,
              ": x must have dtype float32 (the ternary kind stores float32), got ",
              x.scalar_type());
  const int64_t n = x.numel();
  const int64_t nbytes = check_ternary_sizes(op, n, block_size);
  const int64_t block = block_size;
  const int64_t nblocks = n_blocks(n, block);
  at::Tensor scales = at::empty({nblocks}, x.options());
  at::Tensor packed = at::empty({nbytes}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {scales, packed};
  }
  const cpu::TernaryEncodeArgs args{x.const_data_ptr<float>(), scales.mutable_data_ptr<float>(),
                                    packed.mutable_data_ptr<uint8_t>(), n, block,
                                    rng_key(seed_bits(seed), kStreamBlockIntSR)};
  const cpu::TernaryEncodeFn fn = cpu::kernels().ternary_encode_sr;
  const int64_t per = ternary_chunk_blocks(block);
  const int64_t nchunks = n_blocks(nblocks, per);
  std::atomic<bool> bad{false};
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = c * per;
      const int64_t b1 = std::min(b0 + per, nblocks);
      if (!fn(args, b0, b1)) {
        bad.store(true, std::memory_order_relaxed);
      }
    }
  });
  check_finite(!bad.load(), op, "x");
  return {scales, packed};
}

void ternary_decode_cpu(const at::Tensor& scales, const at::Tensor& packed, int64_t block_size,
                        const at::Tensor& out) {
  check_ternary_decode(scales, packed, block_size, out, c10::DeviceType::CPU);
  const int64_t n = out.numel();
  if (n == 0) {
    return;
  }
  const cpu::TernaryDecodeArgs args{scales.const_data_ptr<float>(),
                                    packed.const_data_ptr<uint8_t>(),
                                    out.mutable_data_ptr<float>(), n, block_size};
  const cpu::TernaryDecodeFn fn = cpu::kernels().ternary_decode;
  // tasks of whole bytes: units of 320 elements (64 bytes)
  constexpr int64_t kUnit = 64 * kTernaryPerByte;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, std::max<int64_t>(1, cpu::kTaskElems / kUnit),
                   [&](int64_t u0, int64_t u1) { fn(args, u0 * kUnit, std::min(u1 * kUnit, n)); });
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("ternary_encode_sr", &ternary_encode_sr_cpu);
  m.impl("ternary_decode", &ternary_decode_cpu);
}

}  // namespace commpress
