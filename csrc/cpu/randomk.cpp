// CPU kernels of commpress::randomk_gather and commpress::randomk_scatter_add (schemas in
// registration.cpp; specification: commpress/codecs/randomk.py).
//
// The k indices are never materialised: value j comes from stratum j, [j*n/k, (j+1)*n/k),
// at offset below(seed, j, length) of the counter-based RNG (include/commpress/rng.h), so
// every rank with the seed regenerates them and the encoder reads only k elements of x (plus
// one streaming NaN/Inf check of all of x, which the codec requires).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "../checks.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.h"

namespace commpress {
namespace {

at::Tensor randomk_gather_cpu(const at::Tensor& x, int64_t k, int64_t seed, bool scaled) {
  static constexpr const char* op = "randomk_gather";
  check_vector(op, "x", x, c10::DeviceType::CPU);
  const DType dtype = float_code(op, "x", x);
  const int64_t n = x.numel();
  check_strata(op, n, k);
  at::Tensor values = at::empty({k}, x.options());
  if (n == 0) {
    return values;
  }
  // NaN/Inf anywhere in x is rejected (the codec's contract), in one streaming pass.
  std::atomic<bool> bad{false};
  const cpu::TopkCompactFn scan = cpu::kernels().topk_compact[dtype];
  at::parallel_for(0, n, cpu::kTaskElems, [&](int64_t i0, int64_t i1) {
    scan(x.const_data_ptr(), i0, i1, std::numeric_limits<double>::infinity(), nullptr, nullptr, 0,
         &bad);
  });
  check_finite(!bad.load(), op, "x");
  const uint64_t key = rng_key(seed_bits(seed), kStreamRandomK);
  std::atomic<bool> overflow{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), op, [&] {
    using opmath = at::opmath_type<scalar_t>;
    const auto* xs = x.const_data_ptr<scalar_t>();
    auto* vs = values.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, k, 4096, [&](int64_t j0, int64_t j1) {
      bool of = false;
      StrataWalker strata(j0, n, k);
      // Indices a batch at a time, prefetched: the reads are scattered, one per stratum.
      constexpr int64_t kBatch = 64;
      int64_t where[kBatch];
      int64_t len[kBatch];
      for (int64_t b0 = j0; b0 < j1; b0 += kBatch) {
        const int64_t b1 = std::min(j1, b0 + kBatch);
        for (int64_t j = b0; j < b1; ++j) {
          const int64_t start = strata.start;
          len[j - b0] = strata.advance();
          where[j - b0] = start + static_cast<int64_t>(rng_below(
                                      key, static_cast<uint64_t>(j), static_cast<uint64_t>(len[j - b0])));
          __builtin_prefetch(xs + where[j - b0]);
        }
        for (int64_t j = b0; j < b1; ++j) {
          scalar_t v = xs[where[j - b0]];
          if (scaled) {
            // values * length.to(dtype) in torch: the length is rounded to x's dtype first.
            const auto lt = static_cast<scalar_t>(static_cast<opmath>(len[j - b0]));
            v = static_cast<scalar_t>(static_cast<opmath>(v) * static_cast<opmath>(lt));
            of |= !std::isfinite(static_cast<opmath>(v));
          }
          vs[j] = v;
        }
      }
      if (of) {
        overflow.store(true, std::memory_order_relaxed);
      }
    });
  });
  TORCH_CHECK(!overflow.load(), op, ": x scaled by its block length overflows ",
              x.scalar_type(), "; use scaled=False");
  return values;
}

void randomk_scatter_add_cpu(const at::Tensor& values, int64_t seed, const at::Tensor& out) {
  static constexpr const char* op = "randomk_scatter_add";
  check_randomk_scatter_add(values, out, c10::DeviceType::CPU);
  const int64_t n = out.numel();
  const int64_t k = values.numel();
  if (k == 0) {
    return;
  }
  const uint64_t key = rng_key(seed_bits(seed), kStreamRandomK);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), op, [&] {
    const auto* vs = values.const_data_ptr<scalar_t>();
    auto* o = out.mutable_data_ptr<scalar_t>();
    // Strata are disjoint, so tasks never touch the same element.
    at::parallel_for(0, k, 4096, [&](int64_t j0, int64_t j1) {
      StrataWalker strata(j0, n, k);
      constexpr int64_t kBatch = 64;  // indices a batch at a time, prefetched (see gather)
      int64_t where[kBatch];
      for (int64_t b0 = j0; b0 < j1; b0 += kBatch) {
        const int64_t b1 = std::min(j1, b0 + kBatch);
        for (int64_t j = b0; j < b1; ++j) {
          const int64_t start = strata.start;
          const int64_t len = strata.advance();
          where[j - b0] = start + static_cast<int64_t>(rng_below(key, static_cast<uint64_t>(j),
                                                                  static_cast<uint64_t>(len)));
          __builtin_prefetch(o + where[j - b0], 1);
        }
        for (int64_t j = b0; j < b1; ++j) {
          o[where[j - b0]] += vs[j];
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("randomk_gather", &randomk_gather_cpu);
  m.impl("randomk_scatter_add", &randomk_scatter_add_cpu);
}

}  // namespace commpress
