// CPU kernels of commpress::sign_encode and commpress::sign_decode (schemas in
// registration.cpp; specification: commpress/codecs/sign.py).
//
// Encode with a residual is two passes over the input, because a block's scale depends on all
// of it:
//   1. per-block sums of |w| (w = x + residual rounded to x's dtype) in the fixed summation
//      order of include/commpress/tree.h, and a NaN/Inf check of every w;
//   2. the sign bits and e = c - decode(w) in place.
// Nothing is written to the residual before pass 1 has validated the whole input, so a
// non-finite gradient leaves it untouched (the error-feedback skip policy). Without a residual
// the bits (which do not depend on the scale) are written by pass 1 itself, span by span while
// it is in L1, so the encode reads x once; the fresh outputs are dropped if it then raises.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "commpress/bitpack.h"
#include "common.h"

namespace commpress {
namespace {

template <class S>
bool write_scales(const std::vector<double>& sums, const cpu::BlockLayout& layout, S* scales) {
  std::atomic<bool> overflow{false};
  at::parallel_for(0, layout.nblocks, 4096, [&](int64_t b0, int64_t b1) {
    bool bad = false;
    for (int64_t b = b0; b < b1; ++b) {
      const S v = static_cast<S>(sums[static_cast<size_t>(b)] /
                                 static_cast<double>(layout.block_len(b)));
      bad |= !std::isfinite(v);
      scales[b] = v;
    }
    if (bad) {
      overflow.store(true, std::memory_order_relaxed);
    }
  });
  return !overflow.load();
}

std::tuple<at::Tensor, at::Tensor> sign_encode_cpu(const at::Tensor& x,
                                                   const std::optional<at::Tensor>& residual,
                                                   int64_t block_size) {
  static constexpr const char* op = "sign_encode";
  const auto [dtype, e] = check_encode_input(op, x, residual, c10::DeviceType::CPU);
  check_block(op, "block_size", block_size, 0);
  const int64_t n = x.numel();
  const at::ScalarType ct = compute_type(x.scalar_type());
  const cpu::BlockLayout layout(n, block_size);
  at::Tensor scales = at::empty({layout.nblocks}, x.options().dtype(ct));
  at::Tensor bits = at::empty({packed_nbytes(n, 1)}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {scales, bits};
  }
  const void* xp = x.const_data_ptr();
  void* ep = e != nullptr ? e->data_ptr() : nullptr;

  // Without a residual the bits do not depend on the scales: pass 1 writes them too and the
  // encode reads x once (4 B/element instead of 8), when every group starts on a whole byte.
  uint8_t* const fused_bits = e == nullptr && (layout.nblocks == 1 || layout.block % 8 == 0)
                                  ? bits.mutable_data_ptr<uint8_t>()
                                  : nullptr;
  std::atomic<bool> bad{false};
  const std::vector<double> sums =
      cpu::block_reduce(cpu::kSumAbs, dtype, xp, ep, nullptr, layout, &bad, fused_bits);
  check_finite(!bad.load(), op, e != nullptr ? "x + residual" : "x");
  const bool finite = ct == at::kDouble
                          ? write_scales(sums, layout, scales.mutable_data_ptr<double>())
                          : write_scales(sums, layout, scales.mutable_data_ptr<float>());
  TORCH_CHECK(finite, op, ": a block's mean magnitude overflows ", ct,
              " (NaN or Inf scale; nothing was written)");

  if (fused_bits != nullptr) {
    return {scales, bits};
  }
  const cpu::SignArgs args{xp, ep, scales.const_data_ptr(), bits.mutable_data_ptr<uint8_t>(), n,
                           layout.block};
  const cpu::SignEncodeFn fn = cpu::kernels().sign_encode[dtype][e != nullptr ? 1 : 0];
  cpu::parallel_elements(n, cpu::kTaskElems, [&](int64_t i0, int64_t i1) { fn(args, i0, i1); });
  return {scales, bits};
}

void sign_decode_cpu(const at::Tensor& scales, const at::Tensor& bits, int64_t block_size,
                     const at::Tensor& out, bool accumulate) {
  const DType dtype = check_sign_decode(scales, bits, block_size, out, c10::DeviceType::CPU);
  const int64_t n = out.numel();
  const int64_t block = effective_block(n, block_size);
  if (n == 0) {
    return;
  }
  const cpu::SignDecodeArgs args{scales.const_data_ptr(), bits.const_data_ptr<uint8_t>(),
                                 out.data_ptr(), n, block, accumulate};
  const cpu::SignDecodeFn fn = cpu::kernels().sign_decode[dtype];
  cpu::parallel_elements(n, cpu::kTaskElems, [&](int64_t i0, int64_t i1) { fn(args, i0, i1); });
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("sign_encode", &sign_encode_cpu);
  m.impl("sign_decode", &sign_decode_cpu);
}

}  // namespace commpress
