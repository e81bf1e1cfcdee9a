// CPU kernels of commpress::topk_select and commpress::sparse_scatter_add (schemas in
// registration.cpp; specification: commpress/codecs/topk.py).
//
// topk_select: exact top-k by magnitude without sorting the tensor.
//   1. Estimate a threshold from a deterministic random sample of |x| (512 runs of 64
//      elements at seed-drawn positions): the r-th largest sample value, with r a few
//      standard deviations above the expected rank of the k-th largest, so that about
//      k(1 + eps) elements of x reach it.
//   2. One parallel pass compacts the indices (and values) with |x_i| >= threshold, in index
//      order, and checks every element for NaN/Inf. If fewer than k reach it (unlikely),
//      the pass is repeated with threshold 0 (every element).
//   3. Exact fix-up on the candidates: a radix select on the magnitude bits finds the k-th
//      largest magnitude T; the result is every candidate above T plus the lowest-index
//      candidates equal to T.
// The result is a pure function of x and k (ties broken toward the lower index), the same
// on every backend; indices come out sorted, as the codec sends them.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../checks.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "common.h"

namespace commpress {
namespace {

constexpr int64_t kSampleRuns = 512;  // sample: 512 runs of 64 consecutive elements at
constexpr int64_t kRunLength = 64;    // seed-drawn positions (4 cache lines per random access)
constexpr int64_t kSampleSize = kSampleRuns * kRunLength;
constexpr uint64_t kSampleKey = 0x544F504B53414D50ull;  // "TOPKSAMP"

template <class T>
void sample_runs(const T* x, int64_t n, double* out) {
  for (int64_t r = 0; r < kSampleRuns; ++r) {
    const uint64_t draw = rng_draw(kSampleKey, static_cast<uint64_t>(r));
    const auto start = static_cast<int64_t>(
        (static_cast<unsigned __int128>(draw) * static_cast<uint64_t>(n - kRunLength + 1)) >> 64);
    for (int64_t j = 0; j < kRunLength; ++j) {
      out[r * kRunLength + j] = std::fabs(static_cast<double>(Elem<T>::load(x[start + j])));
    }
  }
}

// Threshold whose expected count of |x_i| >= threshold is a little above k (0: every element).
// Only speed depends on it: too high a guess is caught and redone with 0 by the caller.
double sampled_threshold(DType dtype, const void* x, int64_t n, int64_t k) {
  const int64_t m = kSampleSize;
  const double expected = static_cast<double>(k) * static_cast<double>(m) / static_cast<double>(n);
  const auto rank = static_cast<int64_t>(std::ceil(expected + 4.0 * std::sqrt(expected) + 8.0));
  if (rank >= m) {
    return 0.0;
  }
  std::vector<double> sample(static_cast<size_t>(m));
  switch (dtype) {
    case kF32: sample_runs(static_cast<const float*>(x), n, sample.data()); break;
    case kF16: sample_runs(static_cast<const Half*>(x), n, sample.data()); break;
    case kBF16: sample_runs(static_cast<const BFloat16*>(x), n, sample.data()); break;
    default: sample_runs(static_cast<const double*>(x), n, sample.data()); break;
  }
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(),
                   std::greater<double>());
  return sample[static_cast<size_t>(rank - 1)];
}

struct Candidates {
  std::vector<int64_t> index;  // ascending
  std::vector<double> val;     // x at each index (exact)
};

// Indices (and values) with |x_i| >= threshold, in order, from a parallel pass; `bad`
// flags NaN/Inf.
Candidates compact(DType dtype, const void* x, int64_t n, double threshold,
                   double expected_fraction, std::atomic<bool>* bad) {
  const cpu::TopkCompactFn fn = cpu::kernels().topk_compact[dtype];
  constexpr int64_t kTaskLen = 1 << 18;
  const int64_t ntasks = std::max<int64_t>(1, (n + kTaskLen - 1) / kTaskLen);
  std::vector<Candidates> found(static_cast<size_t>(ntasks));
  at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i0 = t * kTaskLen;
      const int64_t i1 = std::min(n, i0 + kTaskLen);
      Candidates& out = found[static_cast<size_t>(t)];
      auto cap = static_cast<int64_t>(
          std::min<double>(static_cast<double>(i1 - i0),
                           expected_fraction * 1.5 * static_cast<double>(i1 - i0) + 1024));
      out.index.resize(static_cast<size_t>(cap));
      out.val.resize(static_cast<size_t>(cap));
      int64_t count = fn(x, i0, i1, threshold, out.index.data(), out.val.data(), cap, bad);
      if (count > cap) {  // more than expected: redo, exactly sized
        out.index.resize(static_cast<size_t>(count));
        out.val.resize(static_cast<size_t>(count));
        count = fn(x, i0, i1, threshold, out.index.data(), out.val.data(), count, bad);
      }
      out.index.resize(static_cast<size_t>(count));
      out.val.resize(static_cast<size_t>(count));
    }
  });
  if (ntasks == 1) {
    return std::move(found[0]);
  }
  size_t total = 0;
  for (const auto& f : found) {
    total += f.index.size();
  }
  Candidates all;
  all.index.reserve(total);
  all.val.reserve(total);
  for (const auto& f : found) {
    all.index.insert(all.index.end(), f.index.begin(), f.index.end());
    all.val.insert(all.val.end(), f.val.begin(), f.val.end());
  }
  return all;
}

// Order-preserving key of |v|: float32 bits for the dtypes computed in float32 (exact: v came
// from such a value), float64 bits otherwise.
template <class K>
K key_of(double v) {
  if constexpr (sizeof(K) == 4) {
    return float_bits(std::fabs(static_cast<float>(v)));
  } else {
    return double_bits(std::fabs(v));
  }
}

// The k-th largest of `keys` (1 <= k <= size) by MSB-first radix select over 11-bit digits,
// starting at the highest bit where the keys differ: a few linear passes over the candidates
// (nth_element's partitioning is several times slower on random data).
template <class K>
K kth_largest(const std::vector<K>& keys, int64_t k) {
  K lo = keys[0];
  K hi = keys[0];
  for (const K key : keys) {
    lo = key < lo ? key : lo;
    hi = key > hi ? key : hi;
  }
  if (lo == hi) {
    return hi;
  }
  int shift = 0;
  for (K diff = lo ^ hi; diff != 0; diff >>= 1) {
    ++shift;  // bits [shift, ...) are equal in every key
  }
  K mask = shift >= static_cast<int>(8 * sizeof(K)) ? K{0} : static_cast<K>(~K{0} << shift);
  K prefix = hi & mask;
  uint64_t remaining = static_cast<uint64_t>(k);
  std::vector<uint64_t> counts;
  while (shift > 0) {
    const int width = shift < 11 ? shift : 11;
    shift -= width;
    const K digit_mask = static_cast<K>((K{1} << width) - 1);
    counts.assign(size_t{1} << width, 0);
    for (const K key : keys) {
      if ((key & mask) == prefix) {
        ++counts[(key >> shift) & digit_mask];
      }
    }
    uint64_t above = 0;
    for (int64_t d = static_cast<int64_t>(counts.size()) - 1; d >= 0; --d) {
      if (above + counts[static_cast<size_t>(d)] >= remaining) {
        prefix = static_cast<K>(prefix | (static_cast<K>(d) << shift));
        mask = static_cast<K>(mask | (digit_mask << shift));
        remaining -= above;
        break;
      }
      above += counts[static_cast<size_t>(d)];
    }
  }
  return prefix;
}

// Writes every candidate above the k-th largest key plus the lowest-index ones equal to it.
template <class K, class I, class T>
void select_and_emit(const Candidates& cand, int64_t k, I* idx, T* values) {
  std::vector<K> keys(cand.val.size());
  for (size_t j = 0; j < keys.size(); ++j) {
    keys[j] = key_of<K>(cand.val[j]);
  }
  const K kth = kth_largest(keys, k);
  int64_t above = 0;
  for (const K key : keys) {
    above += key > kth;
  }
  int64_t need_eq = k - above;
  int64_t out = 0;
  for (size_t j = 0; j < keys.size(); ++j) {
    if (keys[j] > kth || (keys[j] == kth && need_eq-- > 0)) {
      idx[out] = static_cast<I>(cand.index[j]);
      values[out] = static_cast<T>(cand.val[j]);
      ++out;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> topk_select_cpu(const at::Tensor& x, int64_t k) {
  static constexpr const char* op = "topk_select";
  check_vector(op, "x", x, c10::DeviceType::CPU);
  const DType dtype = float_code(op, "x", x);
  const int64_t n = x.numel();
  TORCH_CHECK(k >= 0 && k <= n, op, ": k must be in [0, numel=", n, "], got ", k);
  const bool small_index = n <= std::numeric_limits<int32_t>::max();
  at::Tensor indices = at::empty({k}, x.options().dtype(small_index ? at::kInt : at::kLong));
  at::Tensor values = at::empty({k}, x.options());
  const void* xp = x.const_data_ptr();

  std::atomic<bool> bad{false};
  double threshold = 0.0;
  if (k == 0) {
    threshold = std::numeric_limits<double>::infinity();  // select nothing, still check x
  } else if (n > 4 * kSampleSize && k < n / 4) {
    threshold = sampled_threshold(dtype, xp, n, k);
  }
  const double fraction = threshold > 0.0 ? 1.25 * static_cast<double>(k) / static_cast<double>(n)
                                          : 1.0;
  Candidates cand = compact(dtype, xp, n, threshold, fraction, &bad);
  check_finite(!bad.load(), op, "x");
  if (static_cast<int64_t>(cand.index.size()) < k) {  // the sample overestimated: take all
    cand = compact(dtype, xp, n, 0.0, 1.0, &bad);
  }
  if (k == 0) {
    return {indices, values};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "topk_select", [&] {
    auto* vs = values.mutable_data_ptr<scalar_t>();
    using K = std::conditional_t<std::is_same_v<scalar_t, double>, uint64_t, uint32_t>;
    if (small_index) {
      select_and_emit<K>(cand, k, indices.mutable_data_ptr<int32_t>(), vs);
    } else {
      select_and_emit<K>(cand, k, indices.mutable_data_ptr<int64_t>(), vs);
    }
  });
  return {indices, values};
}

// ----- sparse_scatter_add ------------------------------------------------------------------

template <class I>
void check_payload(const char* op, int64_t p, const I* idx, int64_t k, int64_t n) {
  for (int64_t j = 0; j < k; ++j) {
    const auto v = static_cast<int64_t>(idx[j]);
    TORCH_CHECK(v >= 0 && v < n, op, ": indices[", p, "][", j, "] = ", v,
                " is out of range [0, ", n, ")");
    TORCH_CHECK(j == 0 || v > static_cast<int64_t>(idx[j - 1]), op, ": indices[", p,
                "] must be strictly increasing (no duplicates): indices[", p, "][", j,
                "] = ", v, " follows ", static_cast<int64_t>(idx[j - 1]));
  }
}

template <class I>
int64_t lower(const I* idx, int64_t k, int64_t value) {
  return std::lower_bound(idx, idx + k, value,
                          [](I a, int64_t b) { return static_cast<int64_t>(a) < b; }) -
         idx;
}

void sparse_scatter_add_cpu(at::TensorList indices, at::TensorList values, const at::Tensor& out) {
  static constexpr const char* op = "sparse_scatter_add";
  check_sparse_scatter_add(indices, values, out, c10::DeviceType::CPU);
  const int64_t n = out.numel();
  int64_t total = 0;
  for (size_t p = 0; p < indices.size(); ++p) {
    const at::Tensor& idx = indices[p];
    // Every payload is validated before anything is written.
    if (idx.scalar_type() == at::kInt) {
      check_payload(op, static_cast<int64_t>(p), idx.const_data_ptr<int32_t>(), idx.numel(), n);
    } else {
      check_payload(op, static_cast<int64_t>(p), idx.const_data_ptr<int64_t>(), idx.numel(), n);
    }
    total += idx.numel();
  }
  if (total == 0) {
    return;
  }
  // Each task owns windows of out (64K elements, L2-sized) and adds, payload after payload,
  // the entries that fall in a window (found by binary search: indices are sorted). A window's
  // cache lines are loaded once for all payloads; no two tasks touch one element, and every
  // element receives its additions in payload order, so the result is deterministic.
  constexpr int64_t kWindow = int64_t{1} << 16;
  const int64_t nwindows = (n + kWindow - 1) / kWindow;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), op, [&] {
    auto* o = out.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, nwindows * 32768 / std::max<int64_t>(total, 1));
    at::parallel_for(0, nwindows, grain, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t lo = w * kWindow;
        const int64_t hi = std::min(n, lo + kWindow);
        for (size_t p = 0; p < indices.size(); ++p) {
          const auto* v = values[p].const_data_ptr<scalar_t>();
          const int64_t k = indices[p].numel();
          auto add = [&](const auto* idx) {
            const int64_t j1 = lower(idx, k, hi);
            for (int64_t j = lower(idx, k, lo); j < j1; ++j) {
              o[idx[j]] += v[j];
            }
          };
          if (indices[p].scalar_type() == at::kInt) {
            add(indices[p].const_data_ptr<int32_t>());
          } else {
            add(indices[p].const_data_ptr<int64_t>());
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("topk_select", &topk_select_cpu);
  m.impl("sparse_scatter_add", &sparse_scatter_add_cpu);
}

}  // namespace commpress
