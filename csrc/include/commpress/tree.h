// The deterministic summation order of per-block float64 sums (sign scales, QSGD norms).
//
// A float64 sum depends on the order of its additions. commpress fixes one order, which the
// pure-torch reference (commpress.codecs.base.tree_sum) follows with elementwise adds, and
// which both a streaming CPU loop and a CUDA warp compute cheaply:
//
//   1. cut the block into chunks of 32 elements, the last one padded with zeros;
//   2. sum each chunk by a "halves" tree: v[i] += v[i + h] for h = 16, 8, 4, 2, 1 (a SIMD
//      register fold on the CPU, a shfl_down butterfly on the GPU);
//   3. sum the chunk sums by an adjacent-pairs tree, (c0 + c1) + (c2 + c3) ..., where a level
//      with an odd count carries its last element up unchanged (= padding with zeros to a
//      power of two: x + 0 == x).
//
// Any aligned power-of-two run of chunks is a subtree of step 3, so a thread (or CUDA warp)
// can sum its own aligned group and the group sums combine by the same rule. Adding zeros is
// exact and IEEE addition is commutative, so the result is one well-defined number.
#pragma once

#include <cstdint>

#include "commpress/hd.h"

namespace commpress {

constexpr int kSumChunk = 32;

// Step 2 on 32 values (v is overwritten); returns the chunk sum.
// One loop per level (not a nested loop): each has a constant trip count, so the compiler
// turns the first levels into full-width vector adds.
COMMPRESS_HD double chunk_tree_sum(double* v) {
  static_assert(kSumChunk == 32, "the unrolled levels below assume 32-element chunks");
  for (int i = 0; i < 16; ++i) {
    v[i] = v[i] + v[i + 16];
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = v[i] + v[i + 8];
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = v[i] + v[i + 4];
  }
  v[0] = v[0] + v[2];
  v[1] = v[1] + v[3];
  return v[0] + v[1];
}

// Step 3 as a stream: push the sums of consecutive equal-sized aligned subtrees (chunks, or
// groups of 2^g chunks) in order; finish() returns their adjacent-pairs tree sum. Holds one
// partial sum per set bit of the count (a binary counter), so 64 slots cover any count.
struct PairwiseStack {
  double slot[64];
  int top = 0;
  uint64_t count = 0;

  COMMPRESS_HD void push(double v) {
    for (uint64_t c = count++; c & 1u; c >>= 1) {
      v = slot[--top] + v;
    }
    slot[top++] = v;
  }

  // The pending subtrees, largest first, are folded from the smallest: s0 + (s1 + (s2 + ...)),
  // which is what padding the count to a power of two with zero subtrees gives.
  COMMPRESS_HD double finish() const {
    if (top == 0) {
      return 0.0;
    }
    double acc = slot[top - 1];
    for (int j = top - 2; j >= 0; --j) {
      acc = slot[j] + acc;
    }
    return acc;
  }
};

// Step 3 over an array of `count` subtree sums.
COMMPRESS_HD double pairwise_sum(const double* sums, int64_t count) {
  PairwiseStack stack;
  for (int64_t i = 0; i < count; ++i) {
    stack.push(sums[i]);
  }
  return stack.finish();
}

}  // namespace commpress
