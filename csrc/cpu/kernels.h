// The CPU kernels' inner loops, as a table of plain functions over an element range.
//
// The torch-facing files (sign.cpp, qsgd.cpp, topk.cpp) check arguments, allocate outputs and
// split the work with at::parallel_for; each task calls one of these functions on its range.
// The loops have no torch dependency, so kernels_impl.h is compiled once per instruction set
// (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp) and the best table for the
// running CPU is picked once at first use. Every variant computes the same bits: the cores in
// csrc/include/commpress/ are exact and the build disables FMA contraction.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace commpress {
namespace cpu {

// Elements summed per task of the block-sum pass: a power-of-two number of 32-element chunks,
// so every group is an aligned subtree of the summation order (include/commpress/tree.h).
constexpr int64_t kGroupElems = 32768;

enum SumKind : int {
  kSumAbs = 0,           // sum |w|          (sign scales)
  kSumSquare = 1,        // sum w^2          (QSGD norms of float32/16 input)
  kSumScaledSquare = 2,  // sum (w / amax)^2 (QSGD norms of float64 input)
  kMaxAbs = 3,           // max |w|          (the amax of float64 QSGD buckets)
};

// Blocks of `block` elements (the last one shorter) cut into groups of `group` elements.
// A block of 0 (whole tensor) or longer than the tensor is stored as one block of n (>= 1)
// elements: the same block, and no later arithmetic (block + group, (b + 1) * block) comes
// near INT64_MAX.
struct BlockLayout {
  int64_t n = 0;
  int64_t block = 1;
  int64_t nblocks = 0;
  int64_t group = kGroupElems;
  int64_t groups_per_block = 1;
  int64_t ngroups = 0;

  BlockLayout() = default;
  BlockLayout(int64_t n_, int64_t block_) : n(n_), block(block_) {
    const int64_t whole = n > 0 ? n : 1;
    if (block <= 0 || block > whole) {
      block = whole;
    }
    nblocks = n == 0 ? 0 : n / block + (n % block != 0 ? 1 : 0);
    groups_per_block = (block + group - 1) / group;
    if (nblocks > 0) {
      const int64_t last = n - (nblocks - 1) * block;
      ngroups = (nblocks - 1) * groups_per_block + (last + group - 1) / group;
    }
  }
  int64_t block_len(int64_t b) const {
    const int64_t start = b * block;
    return (n - start < block) ? n - start : block;
  }
  int64_t block_groups(int64_t b) const { return (block_len(b) + group - 1) / group; }
};

// x: storage dtype; e: residual (compute dtype) or null; amax: per block, for kSumScaledSquare.
// bits (kSumAbs only, else null): where to also write the sign bits of w (w < 0, LSB-first, the
// sign codec's bits), so an encode without a residual reads x once; every group must then start
// at a multiple of 8 elements (whole blocks a multiple of 8 long, or one block).
struct SumArgs {
  const void* x;
  const void* e;
  const double* amax;
  BlockLayout layout;
  uint8_t* bits = nullptr;
};
// out[g] = tree sum (or max) of group g, for g in [g0, g1); `bad` is set when an encoded value
// w is NaN or Inf.
using SumFn = void (*)(const SumArgs&, int64_t g0, int64_t g1, double* out,
                       std::atomic<bool>* bad);

// Element ranges [i0, i1) of the pass-2 and decode functions start at a multiple of 8 and end
// at a multiple of 8 or at n, so every task owns whole packed bytes.
struct SignArgs {
  const void* x;
  void* e;  // residual, updated in place, or null
  const void* scales;
  uint8_t* bits;
  int64_t n;
  int64_t block;
};
using SignEncodeFn = void (*)(const SignArgs&, int64_t i0, int64_t i1);

// Decode writes out[i] = v (rounded to out's dtype, -0 as +0: what adding to zeros gives), or
// out[i] += v when accumulate.
struct SignDecodeArgs {
  const void* scales;
  const uint8_t* bits;
  void* out;
  int64_t n;
  int64_t block;
  bool accumulate;
};
using SignDecodeFn = void (*)(const SignDecodeArgs&, int64_t i0, int64_t i1);

struct QsgdArgs {
  const void* x;
  void* e;
  const void* norms;
  uint8_t* packed;
  int64_t n;
  int64_t bucket;
  int levels;
  uint64_t key;  // rng_key(seed, kStreamQSGD)
  // Elements ahead of the one being encoded to prefetch into L2 (0: none). The one-pass encode
  // (qsgd.cpp) sets it to its chunk length, so the next chunk's block sums read from cache.
  int64_t prefetch_ahead = 0;
};
using QsgdEncodeFn = void (*)(const QsgdArgs&, int64_t i0, int64_t i1);

struct QsgdDecodeArgs {
  const void* norms;
  const uint8_t* packed;
  void* out;
  int64_t n;
  int64_t bucket;
  int levels;
  bool accumulate;
};
using QsgdDecodeFn = void (*)(const QsgdDecodeArgs&, int64_t i0, int64_t i1);

// Writes the indices i in [i0, i1) with |x_i| >= threshold (a double holding a value of the
// compute dtype) to idx[0 .. cap) in order, and x_i (exact, as a double) to val[0 .. cap)
// when val is not null; returns how many there are (possibly > cap, then only the first cap
// were written). Sets `bad` when an element is NaN or Inf.
using TopkCompactFn = int64_t (*)(const void* x, int64_t i0, int64_t i1, double threshold,
                                  int64_t* idx, double* val, int64_t cap,
                                  std::atomic<bool>* bad);

// Block-scaled integers (int8 / int4): the scales of blocks [b0, b1) and the fields of their
// elements. b0 * block is a multiple of 2 (whole packed bytes for 4 bits). Returns false, with
// no field written, when an element of those blocks is NaN or Inf; otherwise *top is the
// largest scale written (as a double; 0 for none).
struct BlockIntEncodeArgs {
  const void* x;
  void* scales;  // compute dtype, one per block
  uint8_t* packed;
  int64_t n;
  int64_t block;
  int qmax;
  uint64_t key;  // the stochastic variant's random stream (rng_key(seed, kStreamBlockIntSR)); else unused
};
using BlockIntEncodeFn = bool (*)(const BlockIntEncodeArgs&, int64_t b0, int64_t b1, double* top);

// out[i] = (field_i - q_max) * s_b rounded to out's dtype (-0 as +0), or out[i] += that.
struct BlockIntDecodeArgs {
  const void* scales;
  const uint8_t* packed;
  void* out;
  int64_t n;
  int64_t block;
  int qmax;
  bool accumulate;
};
using BlockIntDecodeFn = void (*)(const BlockIntDecodeArgs&, int64_t i0, int64_t i1);

// Ternary (commpress/spec/ternary.py; float32 only, what the FSDP store keeps): the scales
// (absmax) of blocks [b0, b1) and the bytes of their levels (five per byte, base 3), the
// elements past n written as level 0 up to the padded end of the blocks (b1 * block) and of
// the last byte. b0 * block and, unless b1 is the last block, b1 * block are multiples of 5,
// so every task owns whole bytes. Returns false, with no level written, when an element of
// those blocks is NaN or Inf.
struct TernaryEncodeArgs {
  const float* x;
  float* scales;  // one per block
  uint8_t* packed;
  int64_t n;
  int64_t block;
  uint64_t key;  // rng_key(seed, kStreamBlockIntSR): the uniforms of blockint_encode_sr
};
using TernaryEncodeFn = bool (*)(const TernaryEncodeArgs&, int64_t b0, int64_t b1);

// out[i] = (digit_i - 1) * s_b for i in [i0, i1), i0 a multiple of 5: the product as it is
// (a -0 stays -0, like the specification's decode). Any byte value is read safely.
struct TernaryDecodeArgs {
  const float* scales;
  const uint8_t* packed;
  float* out;
  int64_t n;
  int64_t block;
};
using TernaryDecodeFn = void (*)(const TernaryDecodeArgs&, int64_t i0, int64_t i1);

// Index of a blockint width in the tables: 4 -> 0, 8 -> 1.
inline int blockint_bits_index(int64_t bits) { return bits == 4 ? 0 : 1; }

// Index of a bits value in the tables: 2 -> 0, 4 -> 1, 8 -> 2.
inline int qsgd_bits_index(int64_t bits) { return bits == 2 ? 0 : bits == 4 ? 1 : 2; }

struct Kernels {
  const char* isa;
  SumFn sum[4][4][2];  // [kind][dtype][has residual]
  SignEncodeFn sign_encode[4][2];
  SignDecodeFn sign_decode[4];
  QsgdEncodeFn qsgd_encode[4][2][3];  // [dtype][has residual][bits index]
  QsgdDecodeFn qsgd_decode[4][3];
  TopkCompactFn topk_compact[4];
  BlockIntEncodeFn blockint_encode[4][2];  // [dtype][bits index]
  BlockIntEncodeFn blockint_encode_sr[4][2];  // stochastic rounding (blockint_field_sr)
  BlockIntDecodeFn blockint_decode[4][2];
  TernaryEncodeFn ternary_encode_sr;  // float32
  TernaryDecodeFn ternary_decode;
};

// The table in use: the widest variant this CPU supports, unless select_isa() chose another.
const Kernels& kernels();
// Switches the table ("default", "avx2", "avx512"; "" keeps it) and returns the active name.
// Throws std::invalid_argument for a name that is unknown, not built or not supported here.
std::string select_isa(const std::string& name);
// Variants built into this binary and supported by this CPU, comma separated.
std::string available_isas();

}  // namespace cpu
}  // namespace commpress
