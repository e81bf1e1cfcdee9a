// C launchers of the CUDA kernels (csrc/cuda/*.cu): raw device pointers, a dtype code
// (commpress::DType: 0 float32, 1 float16, 2 bfloat16, 3 float64) and a stream. No torch:
// bindings.cpp validates the tensors, allocates outputs and scratch, and calls these on
// torch's current stream. Every launcher returns cudaErrorInvalidValue for arguments it
// cannot handle (unknown dtype or width) and otherwise the launch status.
//
// Kernels that must not write when the input is invalid (NaN/Inf, overflowing scale, bad
// index) set bits in a device `flags` word (or `first_bad`) that the writing kernels read
// first; the binding copies the word back to raise the error.
#pragma once

#ifndef __CUDACC_RTC__  // host API: not for NVRTC (the CuPy backend launches the kernels)
#include <cuda_runtime_api.h>

#include <cstdint>

extern "C" {

// Doubles of scratch the block reductions of sign/QSGD need for n elements in blocks of `block`.
int64_t commpress_reduce_scratch_cuda(int64_t n, int64_t block);

// sign: flags bit 1 = NaN/Inf in the encoded values, 2 = a scale overflows. `block` >= 1 (the
// caller passes n for one whole-tensor block). residual may be null.
cudaError_t commpress_sign_encode_cuda(const void* x, int dtype, void* residual, int64_t n,
                                       int64_t block, void* scales, uint8_t* bits,
                                       double* scratch, int* flags, cudaStream_t stream);
// Decode: out = decoded (accumulate == 0) or out += decoded.
cudaError_t commpress_sign_decode_cuda(const void* scales, const uint8_t* bits, int64_t n,
                                       int64_t block, int dtype, void* out, int accumulate,
                                       cudaStream_t stream);

// qsgd: flags bit 1 = NaN/Inf, 2 = a norm overflows, 4 = a norm exceeds `limit` (the largest
// value of x's dtype). bits in {2, 4, 8}; seed is the uint64 seed.
cudaError_t commpress_qsgd_encode_cuda(const void* x, int dtype, void* residual, int64_t n,
                                       int bits, int levels, int64_t bucket, uint64_t seed,
                                       double limit, void* norms, uint8_t* packed,
                                       double* scratch, int* flags, cudaStream_t stream);
cudaError_t commpress_qsgd_decode_cuda(const void* norms, const uint8_t* packed, int64_t n,
                                       int bits, int levels, int64_t bucket, int dtype,
                                       void* out, int accumulate, cudaStream_t stream);

// top-k: exact k largest |x|, ties toward the lower index, indices ascending (int32 when
// index64 == 0, else int64). Scratch: commpress_topk_scratch_cuda(n) bytes. flags bit 1 =
// NaN/Inf in x (then the outputs are meaningless).
int64_t commpress_topk_scratch_cuda(int64_t n);
cudaError_t commpress_topk_select_cuda(const void* x, int dtype, int64_t n, int64_t k,
                                       void* indices, int index64, void* values, void* scratch,
                                       int* flags, cudaStream_t stream);

// Scatter-add of one payload: validate (first_bad lowered to payload << 40 | j << 1 | kind,
// kind 0 = out of range, 1 = not increasing; start it at UINT64_MAX), then add -- the add
// kernel does nothing once first_bad is set, so call validate for every payload first.
cudaError_t commpress_scatter_validate_cuda(const void* indices, int index64, int64_t k,
                                            int64_t n, int64_t payload,
                                            unsigned long long* first_bad, cudaStream_t stream);
cudaError_t commpress_scatter_add_cuda(const void* indices, int index64, const void* values,
                                       int64_t k, int dtype, void* out,
                                       const unsigned long long* first_bad, cudaStream_t stream);

// random-k: flags bit 1 = NaN/Inf in x, 2 = a scaled value overflows.
cudaError_t commpress_randomk_gather_cuda(const void* x, int dtype, int64_t n, int64_t k,
                                          uint64_t seed, int scaled, void* values, int* flags,
                                          cudaStream_t stream);
cudaError_t commpress_randomk_scatter_add_cuda(const void* values, int dtype, int64_t k,
                                               int64_t n, uint64_t seed, void* out,
                                               cudaStream_t stream);

// int8 / int4 (blockint.cu): bits in {4, 8}; scales in the compute dtype, one per block.
// Scratch `amax`: commpress_blockint_scratch_cuda(n, block) words. flags bit 1 = NaN/Inf in x,
// 2 = the decode of a block would overflow x's dtype (then no field is written).
int64_t commpress_blockint_scratch_cuda(int64_t n, int64_t block);
cudaError_t commpress_blockint_encode_cuda(const void* x, int dtype, int64_t n, int bits,
                                           int64_t block, void* scales, uint8_t* packed,
                                           unsigned long long* amax, int* flags,
                                           cudaStream_t stream);
// The same with stochastic rounding (blockint_encode_sr); seed is the uint64 seed.
cudaError_t commpress_blockint_encode_sr_cuda(const void* x, int dtype, int64_t n, int bits,
                                              int64_t block, uint64_t seed, void* scales,
                                              uint8_t* packed, unsigned long long* amax,
                                              int* flags, cudaStream_t stream);
// Decode: out = decoded (accumulate == 0) or out += decoded.
cudaError_t commpress_blockint_decode_cuda(const void* scales, const uint8_t* packed, int64_t n,
                                           int bits, int64_t block, int dtype, void* out,
                                           int accumulate, cudaStream_t stream);

// ternary (ternary.cu), float32 only: scales one per block (amax), packed
// ceil(nblocks * block / 5) = nbytes bytes (the padded blocks, five levels per byte). Scratch
// `amax`: commpress_blockint_scratch_cuda(n, block) words. flags bit 1 = NaN/Inf in x (then
// nothing is written). seed is the uint64 seed.
cudaError_t commpress_ternary_encode_sr_cuda(const float* x, int64_t n, int64_t block,
                                             int64_t nbytes, uint64_t seed, float* scales,
                                             uint8_t* packed, unsigned long long* amax,
                                             int* flags, cudaStream_t stream);
// Decode: out = decoded (n elements).
cudaError_t commpress_ternary_decode_cuda(const float* scales, const uint8_t* packed, int64_t n,
                                          int64_t block, float* out, cudaStream_t stream);

// bit packing (bitpack.cu)
cudaError_t commpress_pack_bits_cuda(const uint8_t* fields, int64_t n, int bits, uint8_t* packed,
                                     unsigned long long* first_bad, cudaStream_t stream);
cudaError_t commpress_unpack_bits_cuda(const uint8_t* packed, int64_t n, int bits,
                                       uint8_t* fields, cudaStream_t stream);

}  // extern "C"
#endif  // __CUDACC_RTC__
