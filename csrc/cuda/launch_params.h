// Launch parameters of the CUDA kernels, stated once: grid geometry and the grid of every
// launch shape, scratch layouts and sizes, flag bits, reduction kinds, the template domains the
// launchers dispatch over, and every kernel instantiation the launchers use.
//
// Two readers, one text. The C launchers (csrc/cuda/*.cu) include this header, call the
// functions below for every grid and scratch size, and dispatch over the domain lists. The CuPy
// backend (commpress/kernels/cupy_cuda.py) parses every `constexpr` integer and integer list,
// every enumerator, every COMMPRESS_LAUNCH_FN function, the COMMPRESS_* type lists and the two
// string tables, and evaluates the functions itself. So a grid formula, a scratch size or a
// domain changes here, once, for both paths. Keep the parsed forms plain:
//   * constants: integer expressions of literals and earlier names (+ - * / << and parentheses);
//   * functions: `COMMPRESS_LAUNCH_FN constexpr int64_t f(int64_t a, ...) { return e; }`, e such
//     an expression with calls of earlier functions (or f itself) and at most one top-level
//     `cond ? a : b` (cond: one comparison); arguments are never negative (/ truncates);
//   * domains: `constexpr int kName[] = {literals};`, or, for types,
//     `#define COMMPRESS_<NAME>(X) X(..., type) X(..., type) ...` (the type last).
// What stays per path: each kernel's argument list (test_cupy.py checks the CuPy launches
// against the compiled PTX) and the sequence of launches of each op, which both paths write
// as calls with those arguments.
// Plain C++: no torch headers, readable by nvcc, NVRTC, g++ and Python alike.
#pragma once

#include <cstdint>

// The functions below are host code, but NVRTC compiles no host-only function.
#if defined(__CUDACC__)
#define COMMPRESS_LAUNCH_FN __host__ __device__
#else
#define COMMPRESS_LAUNCH_FN
#endif

namespace commpress {
namespace cuda {

// ----- grid geometry -------------------------------------------------------------------------
constexpr int kThreads = 256;  // threads per block of every kernel but scan_counts_kernel
constexpr int kWarp = 32;
// Enough blocks to fill any current GPU several times over; grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 1 << 16;

COMMPRESS_LAUNCH_FN constexpr int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
COMMPRESS_LAUNCH_FN constexpr int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
COMMPRESS_LAUNCH_FN constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Grid of a kernel with one thread per item (grid-stride beyond kMaxBlocks blocks).
COMMPRESS_LAUNCH_FN constexpr int64_t grid_items(int64_t items) {
  return imax(1, imin(ceil_div(items, kThreads), kMaxBlocks));
}
// Grid of a kernel with one warp per item (a summation group, a tree level's output value).
COMMPRESS_LAUNCH_FN constexpr int64_t grid_warps(int64_t warps) {
  return grid_items(warps * kWarp);
}
// Grid of a kernel with one warp per word of 32 elements (block codecs' encode and decode).
COMMPRESS_LAUNCH_FN constexpr int64_t grid_words(int64_t n) {
  return grid_warps(ceil_div(n, kWarp));
}

// ----- block reductions (block_sums.cuh) -------------------------------------------------------
// One warp sums a group of kWarp chunks of kSumChunk (include/commpress/tree.h) elements.
constexpr int64_t kGroupElems = 1024;
// Scratch of sign/QSGD encode, in doubles: kReductions reductions' levels
// (reduce_scratch(layout) each) plus kReductions spare words.
constexpr int kReductions = 2;

// struct Layout (block_sums.cuh): groups of kGroupElems per block of `block` elements.
COMMPRESS_LAUNCH_FN constexpr int64_t groups_per_block(int64_t block) {
  return ceil_div(block, kGroupElems);
}
// Doubles one reduction needs: every level's per-block values (per = groups per block; each
// tree level combines kWarp of them).
COMMPRESS_LAUNCH_FN constexpr int64_t reduce_scratch(int64_t nblocks, int64_t per) {
  return per == 1 ? nblocks : nblocks * per + reduce_scratch(nblocks, ceil_div(per, kWarp));
}
// Doubles of the encode scratch (commpress_reduce_scratch_cuda); the second reduction starts
// one spare word after the first one's levels.
COMMPRESS_LAUNCH_FN constexpr int64_t encode_scratch(int64_t nblocks, int64_t per) {
  return kReductions * reduce_scratch(nblocks, per) + kReductions;
}
COMMPRESS_LAUNCH_FN constexpr int64_t second_reduction(int64_t nblocks, int64_t per) {
  return reduce_scratch(nblocks, per) + 1;
}

enum SumKind : int { kSumAbs = 0, kSumSquare = 1, kSumScaledSquare = 2, kMaxAbs = 3 };
// Flags word written by the reduction/finalize kernels and read by every pass-2 kernel (and the
// check_finite / gather kernels of top-k and random-k).
enum Flag : int { kFlagNonFinite = 1, kFlagOverflow = 2, kFlagTooBig = 4 };

// ----- top-k radix select (topk.cu) ----------------------------------------------------------
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kHistogramBlocks = 1024;  // most CTAs of histogram_kernel
constexpr int kCountBlocks = 1024;      // CTAs of the count / write passes (one scan block)
// Scratch of topk_select, in 8-byte words: SelectState {prefix, mask, remaining, pad}, then
// hist[kBins], then counts, off_gt and off_eq (kCountBlocks each).
constexpr int kSelectStateWords = 4;
constexpr int kSelectRemainingWord = 2;  // SelectState::remaining (the third word) starts at k
constexpr int kTopkScratchWords = kSelectStateWords + kBins + 3 * kCountBlocks;
COMMPRESS_LAUNCH_FN constexpr int64_t grid_histogram(int64_t n) {
  return imin(grid_items(n), kHistogramBlocks);
}
// CTAs of the count and write passes (the same contiguous ranges); the scan has one thread each.
COMMPRESS_LAUNCH_FN constexpr int64_t grid_count(int64_t n) {
  return imin(n / kThreads + 1, kCountBlocks);
}

// Worked values: the compiler checks them here, tests/test_cupy.py checks the Python evaluation
// against the same lines.
static_assert(grid_items(0) == 1 && grid_items(257) == 2 && grid_items(1LL << 40) == kMaxBlocks,
              "grid_items");
static_assert(grid_words(33) == 1 && grid_words(8193) == 33, "grid_words");
static_assert(reduce_scratch(3, 2000) == 6198 && encode_scratch(1, 1) == 4, "reduce_scratch");
static_assert(grid_count(5000) == 20 && grid_histogram(1LL << 30) == kHistogramBlocks, "grids");

// ----- template domains and kernel instantiations (NVRTC name expressions) -------------------
// The launchers dispatch over these lists (common.cuh dispatch_dtype, dispatch_width); the CuPy
// backend compiles one instantiation per value. X(dtype code, storage type).
#define COMMPRESS_STORAGE_TYPES(X) \
  X(kF32, float) X(kF16, commpress::Half) X(kBF16, commpress::BFloat16) X(kF64, double)
constexpr int kPackWidths[] = {1, 2, 4, 8};  // pack_bits / unpack_bits
constexpr int kQsgdWidths[] = {2, 4, 8};     // QSGD fields

// "<unit>: <expression>": the kernels of csrc/cuda/<unit>.cu the launchers use. A {X} in an
// expression stands for each value of domain X (kNameDomains; a k* or COMMPRESS_* name there is
// the list above), every combination.
constexpr const char* kNameDomains[] = {
    "T = COMMPRESS_STORAGE_TYPES",                              // storage types
    "T32 = float, commpress::Half, commpress::BFloat16",        // computed in float32
    "E = false, true",                                          // has a residual
    "A = false, true",                                          // accumulate
    "B = kQsgdWidths",                                          // QSGD widths
    "P = kPackWidths",                                          // pack widths
    "I = int32_t, int64_t",                                     // index types
};
constexpr const char* kKernelNames[] = {
    "bitpack: commpress::pack_kernel<{P}>",
    "bitpack: commpress::unpack_kernel<{P}>",
    "sign: commpress::cuda::group_sums_kernel<commpress::cuda::kSumAbs, {T}, {E}>",
    "sign: commpress::cuda::tree_level_kernel<false>",
    "sign: commpress::cuda::sign_finalize_kernel<{T}>",
    "sign: commpress::cuda::sign_encode_kernel<{T}, {E}>",
    "sign: commpress::cuda::sign_decode_kernel<{T}, {A}>",
    "qsgd: commpress::cuda::group_sums_kernel<commpress::cuda::kSumSquare, {T32}, {E}>",
    "qsgd: commpress::cuda::group_sums_kernel<commpress::cuda::kMaxAbs, double, {E}>",
    "qsgd: commpress::cuda::group_sums_kernel<commpress::cuda::kSumScaledSquare, double, {E}>",
    "qsgd: commpress::cuda::tree_level_kernel<false>",
    "qsgd: commpress::cuda::tree_level_kernel<true>",
    "qsgd: commpress::cuda::qsgd_finalize_kernel<{T}>",
    "qsgd: commpress::cuda::qsgd_encode_kernel<{T}, {E}, {B}>",
    "qsgd: commpress::cuda::qsgd_decode_kernel<{T}, {B}, {A}>",
    "topk: commpress::cuda::check_finite_kernel<{T}>",
    "topk: commpress::cuda::histogram_kernel<{T}>",
    "topk: commpress::cuda::select_digit_kernel",
    "topk: commpress::cuda::count_kernel<{T}>",
    "topk: commpress::cuda::scan_counts_kernel",
    "topk: commpress::cuda::write_kernel<{T}, {I}>",
    "topk: commpress::cuda::scatter_validate_kernel<{I}>",
    "topk: commpress::cuda::scatter_add_kernel<{I}, {T}>",
    "randomk: commpress::cuda::check_finite_kernel<{T}>",
    "randomk: commpress::cuda::gather_kernel<{T}>",
    "randomk: commpress::cuda::scatter_kernel<{T}>",
};

}  // namespace cuda
}  // namespace commpress
