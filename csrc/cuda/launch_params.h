// Launch parameters of the CUDA kernels, stated once: grid geometry, scratch layouts, flag
// bits, reduction kinds, and every kernel instantiation the launchers use.
//
// Two readers: the C launchers (csrc/cuda/*.cu include this header) and the CuPy backend
// (commpress/kernels/cupy_cuda.py parses it: every `constexpr` integer, every enumerator and
// the two string tables below), so a change here reaches both paths. Keep each constant a
// plain integer expression of literals and earlier constants (+ - * / << and parentheses).
// Plain C++: no CUDA or torch headers, readable by nvcc, NVRTC and Python alike.
#pragma once

#include <cstdint>

namespace commpress {
namespace cuda {

// ----- grid geometry -------------------------------------------------------------------------
constexpr int kThreads = 256;  // threads per block of every kernel but scan_counts_kernel
constexpr int kWarp = 32;
// Enough blocks to fill any current GPU several times over; grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 1 << 16;

// ----- block reductions (block_sums.cuh) -------------------------------------------------------
// One warp sums a group of kWarp chunks of kSumChunk (include/commpress/tree.h) elements.
constexpr int64_t kGroupElems = 1024;
// Scratch of sign/QSGD encode, in doubles: kReductions reductions' levels
// (reduce_scratch(layout) each) plus kReductions spare words.
constexpr int kReductions = 2;

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

// ----- kernel instantiations (NVRTC name expressions) --------------------------------------
// "<unit>: <expression>": the kernels of csrc/cuda/<unit>.cu the launchers use. A {X} in an
// expression stands for each value of domain X (kNameDomains), every combination.
constexpr const char* kNameDomains[] = {
    "T = float, commpress::Half, commpress::BFloat16, double",  // storage types
    "T32 = float, commpress::Half, commpress::BFloat16",        // computed in float32
    "E = false, true",                                          // has a residual
    "A = false, true",                                          // accumulate
    "B = 2, 4, 8",                                              // QSGD widths
    "P = 1, 2, 4, 8",                                           // pack widths
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
