// Helpers of the torch-facing CPU ops: the parallel block-sum pass and task splitting.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "commpress/tree.h"
#include "kernels.h"

namespace commpress {
namespace cpu {

// Elements per parallel task of the streaming passes (a multiple of 8: whole packed bytes).
constexpr int64_t kTaskElems = 32768;

// Per-block reductions of the encoded values w (see SumKind): the deterministic tree sum of
// include/commpress/tree.h, or the max. Groups run in parallel, then each block combines its
// group sums by the same tree. `bad` is set when some w is NaN or Inf. With `bits` (kSumAbs
// only; see SumArgs for the layouts allowed), the sign bits of w are written in the same pass.
inline std::vector<double> block_reduce(int kind, DType dtype, const void* x, const void* e,
                                        const double* amax, const BlockLayout& layout,
                                        std::atomic<bool>* bad, uint8_t* bits = nullptr) {
  const SumFn fn = kernels().sum[kind][dtype][e != nullptr ? 1 : 0];
  const SumArgs args{x, e, amax, layout, bits};
  std::vector<double> groups(static_cast<size_t>(layout.ngroups));
  const int64_t per_group = std::min(layout.block, layout.group);
  const int64_t grain = std::max<int64_t>(1, kTaskElems / per_group);
  at::parallel_for(0, layout.ngroups, grain, [&](int64_t g0, int64_t g1) {
    fn(args, g0, g1, groups.data(), bad);
  });
  if (layout.groups_per_block == 1) {
    return groups;
  }
  std::vector<double> blocks(static_cast<size_t>(layout.nblocks));
  at::parallel_for(0, layout.nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const double* g = groups.data() + b * layout.groups_per_block;
      const int64_t count = layout.block_groups(b);
      if (kind == kMaxAbs) {
        double m = 0.0;
        for (int64_t j = 0; j < count; ++j) {
          m = g[j] > m ? g[j] : m;
        }
        blocks[static_cast<size_t>(b)] = m;
      } else {
        blocks[static_cast<size_t>(b)] = pairwise_sum(g, count);
      }
    }
  });
  return blocks;
}

// Runs fn(i0, i1) over [0, n) in tasks that start at multiples of 64 elements (whole packed
// bytes for every field width, and whole vectors for the SIMD paths).
template <class F>
void parallel_elements(int64_t n, int64_t grain_elems, const F& fn) {
  constexpr int64_t kUnit = 64;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, std::max<int64_t>(1, grain_elems / kUnit), [&](int64_t u0, int64_t u1) {
    fn(u0 * kUnit, std::min(u1 * kUnit, n));
  });
}

}  // namespace cpu
}  // namespace commpress
