// The counter-based random numbers of commpress/rng.py (the specification), bit for bit.
//
//   key = mix64(seed ^ stream);  r_i = mix64(key + (i + 1) * GOLDEN)   (mod 2**64)
//   uniform_i = (r_i >> 40) * 2**-24          below_i(L) = ((r_i >> 32) * L) >> 32
//   u24_paired_i = (r_{i/2} >> (32 * (i % 2))) mod 2**24    (two per draw, rng.paired_u24)
//
// Stateless: any thread computes draw i on its own, so every thread layout on every backend
// draws the same numbers.
#pragma once

#include <cstdint>

#include "commpress/hd.h"

namespace commpress {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kStreamRandomK = 0x52414E444B000001ull;  // "RANDK"
constexpr uint64_t kStreamQSGD = 0x5153474400000002ull;     // "QSGD"
constexpr uint64_t kStreamBlockIntSR = 0x424C4B5352000003ull;  // "BLKSR": blockint_encode_sr

COMMPRESS_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

COMMPRESS_HD uint64_t rng_key(uint64_t seed, uint64_t stream) { return mix64(seed ^ stream); }

// r_i: the i-th 64-bit draw (0-based) of the stream keyed by `key`.
COMMPRESS_HD uint64_t rng_draw(uint64_t key, uint64_t i) { return mix64(key + (i + 1) * kGolden); }

// float32 uniform in [0, 1): 24 random bits, exact in float32 (and in float64).
COMMPRESS_HD float rng_uniform(uint64_t key, uint64_t i) {
  return static_cast<float>(static_cast<uint32_t>(rng_draw(key, i) >> 40)) * 5.9604644775390625e-08f;
}

// 24-bit uniform integer i of the paired sequence (commpress.rng.paired_u24): the low 24 bits
// of the low (i even) or high (i odd) 32-bit half of draw i / 2.
COMMPRESS_HD uint32_t rng_u24_paired(uint64_t key, uint64_t i) {
  return static_cast<uint32_t>(rng_draw(key, i >> 1) >> (32 * (i & 1))) & 0xFFFFFFu;
}

// Integer in [0, bound) for 1 <= bound < 2**32 (Lemire's multiply-shift on the high 32 bits).
COMMPRESS_HD uint64_t rng_below(uint64_t key, uint64_t i, uint64_t bound) {
  return ((rng_draw(key, i) >> 32) * bound) >> 32;
}

// Start of random-k stratum j of k over n elements: floor(j * n / k), without forming j * n
// (which overflows int64 for large tensors): j * (n / k) + floor(j * (n % k) / k), exact while
// j * (n % k) < 2**64, i.e. for every k < 2**32.
COMMPRESS_HD int64_t stratum_start(int64_t j, int64_t n, int64_t k) {
  const uint64_t q = static_cast<uint64_t>(n / k);
  const uint64_t r = static_cast<uint64_t>(n % k);
  const uint64_t uj = static_cast<uint64_t>(j);
  return static_cast<int64_t>(uj * q + (uj * r) / static_cast<uint64_t>(k));
}

// Walks strata j0, j0 + 1, ... with one division at the start instead of two per stratum:
// start_{j+1} = start_j + n / k + carry, the carry from accumulating n % k modulo k.
struct StrataWalker {
  int64_t q, r, k, rem, start;
  COMMPRESS_HD StrataWalker(int64_t j0, int64_t n, int64_t k_)
      : q(n / k_), r(n % k_), k(k_), rem(0), start(0) {
    const uint64_t jr = static_cast<uint64_t>(j0) * static_cast<uint64_t>(r);
    rem = static_cast<int64_t>(jr % static_cast<uint64_t>(k));
    start = j0 * q + static_cast<int64_t>(jr / static_cast<uint64_t>(k));
  }
  // Length of the current stratum; moves to the next one (start becomes its start).
  COMMPRESS_HD int64_t advance() {
    rem += r;
    const int64_t carry = rem >= k ? 1 : 0;
    rem -= carry * k;
    const int64_t length = q + carry;
    start += length;
    return length;
  }
};

}  // namespace commpress
