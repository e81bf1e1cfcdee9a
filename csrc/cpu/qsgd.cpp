// CPU kernels of commpress::qsgd_encode and commpress::qsgd_decode (schemas in
// registration.cpp; specification: commpress/codecs/qsgd.py).
//
// Encode is two passes, like sign_encode (see sign.cpp): bucket norms in the fixed summation
// order (float64 input: a max pass first, then the sum of (w / max)^2), validated before
// pass 2 quantises with the counter-based RNG, packs the fields and updates the residual.
// Without a residual (float32/16, buckets of a multiple of 16 elements) both passes run per
// cache-sized chunk instead (one_pass_encode): x is read from memory once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "commpress/bitpack.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.h"

namespace commpress {
namespace {

// Writes the norms; returns 0 when all are finite and fit x's dtype (at most `limit`), 1 when
// one is NaN/Inf, 2 when one exceeds `limit`.
template <class S>
int write_norms(const std::vector<double>& sums, const std::vector<double>* amax,
                const cpu::BlockLayout& layout, double limit, S* norms) {
  std::atomic<bool> nonfinite{false};
  std::atomic<bool> too_big{false};
  at::parallel_for(0, layout.nblocks, 4096, [&](int64_t b0, int64_t b1) {
    bool nf = false;
    bool big = false;
    for (int64_t b = b0; b < b1; ++b) {
      double v = std::sqrt(sums[static_cast<size_t>(b)]);
      if (amax != nullptr) {
        v *= (*amax)[static_cast<size_t>(b)];
      }
      const S norm = static_cast<S>(v);
      norms[b] = norm;
      nf |= !std::isfinite(norm);
      big |= static_cast<double>(norm) > limit;
    }
    if (nf) {
      nonfinite.store(true, std::memory_order_relaxed);
    }
    if (big) {
      too_big.store(true, std::memory_order_relaxed);
    }
  });
  return nonfinite.load() ? 1 : too_big.load() ? 2 : 0;
}

template <class S>
double first_above(const S* norms, int64_t count, double limit) {
  for (int64_t b = 0; b < count; ++b) {
    if (static_cast<double>(norms[b]) > limit) {
      return static_cast<double>(norms[b]);
    }
  }
  return limit;
}

// Blocks per cache-resident chunk of the one-pass encode: about kTaskElems elements (128 KB of
// float32), summed and then quantised while they are still in L2.
int64_t chunk_blocks(const cpu::BlockLayout& layout) {
  return std::max<int64_t>(1, cpu::kTaskElems / layout.block);
}

// Whether the one-pass encode applies: no residual to protect (the outputs are fresh, so writing
// them before the input is validated is harmless), float32/16 input (float64 needs the max
// pass first), blocks of one summation group and a multiple of 16 elements (every chunk then
// starts on a whole packed byte and on the AVX-512 path's 16-element alignment).
bool one_pass(const void* e, DType dtype, const cpu::BlockLayout& layout) {
  return e == nullptr && dtype != kF64 && layout.groups_per_block == 1 && layout.block % 16 == 0;
}

// Pass 1 and pass 2 fused per chunk of blocks: the block sums of a chunk, its norms, then its
// fields, so x is read from memory once. The same sums, norms and fields as the two passes;
// returns write_norms' status. A chunk with a non-finite norm (NaN/Inf input: the op raises)
// is not quantised.
int one_pass_encode(DType dtype, const cpu::BlockLayout& layout, double limit, float* norms,
                    const cpu::QsgdArgs& args, cpu::QsgdEncodeFn encode, std::atomic<bool>* bad) {
  const cpu::SumFn sum = cpu::kernels().sum[cpu::kSumSquare][dtype][0];
  const cpu::SumArgs sargs{args.x, nullptr, nullptr, layout};
  std::atomic<bool> nonfinite{false};
  std::atomic<bool> too_big{false};
  const int64_t chunk = chunk_blocks(layout);
  cpu::QsgdArgs ahead = args;
  ahead.prefetch_ahead = chunk * layout.block;
  std::vector<double> sums(static_cast<size_t>(layout.nblocks));
  at::parallel_for(0, layout.nblocks, chunk, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(c0 + chunk, b1);
      sum(sargs, c0, c1, sums.data(), bad);
      bool nf = false;
      bool big = false;
      for (int64_t b = c0; b < c1; ++b) {
        const auto norm = static_cast<float>(std::sqrt(sums[static_cast<size_t>(b)]));
        norms[b] = norm;
        nf |= !std::isfinite(norm);
        big |= static_cast<double>(norm) > limit;
      }
      if (nf) {
        nonfinite.store(true, std::memory_order_relaxed);
        continue;
      }
      if (big) {
        too_big.store(true, std::memory_order_relaxed);
      }
      encode(ahead, c0 * layout.block, std::min(c1 * layout.block, layout.n));
    }
  });
  return nonfinite.load() ? 1 : too_big.load() ? 2 : 0;
}

std::tuple<at::Tensor, at::Tensor> qsgd_encode_cpu(const at::Tensor& x,
                                                   const std::optional<at::Tensor>& residual,
                                                   int64_t bits, int64_t levels,
                                                   int64_t bucket_size, int64_t seed) {
  static constexpr const char* op = "qsgd_encode";
  const auto [dtype, e] = check_encode_input(op, x, residual, c10::DeviceType::CPU);
  check_qsgd_params(op, bits, levels, bucket_size);
  const int64_t n = x.numel();
  const at::ScalarType ct = compute_type(x.scalar_type());
  const cpu::BlockLayout layout(n, bucket_size);
  at::Tensor norms = at::empty({layout.nblocks}, x.options().dtype(ct));
  at::Tensor packed = at::empty({packed_nbytes(n, bits)}, x.options().dtype(at::kByte));
  if (n == 0) {
    return {norms, packed};
  }
  const void* xp = x.const_data_ptr();
  void* ep = e != nullptr ? e->data_ptr() : nullptr;

  const cpu::QsgdArgs args{xp,
                           ep,
                           norms.const_data_ptr(),
                           packed.mutable_data_ptr<uint8_t>(),
                           n,
                           layout.block,
                           static_cast<int>(levels),
                           rng_key(seed_bits(seed), kStreamQSGD)};
  const cpu::QsgdEncodeFn fn =
      cpu::kernels().qsgd_encode[dtype][e != nullptr ? 1 : 0][cpu::qsgd_bits_index(bits)];
  const double limit = dtype_max(dtype);
  std::atomic<bool> bad{false};
  if (one_pass(ep, dtype, layout)) {
    const int status =
        one_pass_encode(dtype, layout, limit, norms.mutable_data_ptr<float>(), args, fn, &bad);
    // the same errors as the two passes; only fresh outputs (which are dropped) were written
    check_finite(!bad.load(), op, "x");
    TORCH_CHECK(status != 1, op, ": a bucket norm overflows ", ct,
                " (NaN or Inf norm; nothing was written)");
    TORCH_CHECK(status != 2, op, ": a bucket norm ",
                first_above(norms.const_data_ptr<float>(), layout.nblocks, limit), " exceeds ",
                x.scalar_type(), "'s range; use a smaller bucket_size (nothing was written)");
    return {norms, packed};
  }
  std::vector<double> amax;
  std::vector<double> sums;
  if (dtype == kF64) {
    // Squares of float64 values can overflow: divide by the bucket's max magnitude first.
    amax = cpu::block_reduce(cpu::kMaxAbs, dtype, xp, ep, nullptr, layout, &bad);
    if (!bad.load()) {
      sums = cpu::block_reduce(cpu::kSumScaledSquare, dtype, xp, ep, amax.data(), layout, &bad);
    }
  } else {
    sums = cpu::block_reduce(cpu::kSumSquare, dtype, xp, ep, nullptr, layout, &bad);
  }
  check_finite(!bad.load(), op, e != nullptr ? "x + residual" : "x");
  const std::vector<double>* scale = dtype == kF64 ? &amax : nullptr;
  const int status =
      ct == at::kDouble
          ? write_norms(sums, scale, layout, limit, norms.mutable_data_ptr<double>())
          : write_norms(sums, scale, layout, limit, norms.mutable_data_ptr<float>());
  TORCH_CHECK(status != 1, op, ": a bucket norm overflows ", ct,
              " (NaN or Inf norm; nothing was written)");
  TORCH_CHECK(status != 2, op, ": a bucket norm ",
              first_above(norms.const_data_ptr<float>(), layout.nblocks, limit), " exceeds ",
              x.scalar_type(), "'s range; use a smaller bucket_size (nothing was written)");

  cpu::parallel_elements(n, cpu::kTaskElems, [&](int64_t i0, int64_t i1) { fn(args, i0, i1); });
  return {norms, packed};
}

void qsgd_decode_cpu(const at::Tensor& norms, const at::Tensor& packed, int64_t bits,
                     int64_t levels, int64_t bucket_size, const at::Tensor& out,
                     bool accumulate) {
  const DType dtype =
      check_qsgd_decode(norms, packed, bits, levels, bucket_size, out, c10::DeviceType::CPU);
  const int64_t n = out.numel();
  if (n == 0) {
    return;
  }
  const cpu::QsgdDecodeArgs args{norms.const_data_ptr(), packed.const_data_ptr<uint8_t>(),
                                 out.data_ptr(),         n,
                                 effective_block(n, bucket_size), static_cast<int>(levels),
                                 accumulate};
  const cpu::QsgdDecodeFn fn = cpu::kernels().qsgd_decode[dtype][cpu::qsgd_bits_index(bits)];
  cpu::parallel_elements(n, cpu::kTaskElems, [&](int64_t i0, int64_t i1) { fn(args, i0, i1); });
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("qsgd_encode", &qsgd_encode_cpu);
  m.impl("qsgd_decode", &qsgd_decode_cpu);
}

}  // namespace commpress
