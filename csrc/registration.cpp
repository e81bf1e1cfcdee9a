// The one place where commpress operator schemas are defined. Backends only add kernels with
// TORCH_LIBRARY_IMPL (csrc/cpu/*.cpp, csrc/cuda/bindings.cpp); Python adds fake (meta)
// kernels in commpress/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>

#include "cpu/kernels.h"

// An empty module: `from commpress import _C` only loads this shared library, whose static
// initialisers (TORCH_LIBRARY / TORCH_LIBRARY_IMPL) register the ops with the dispatcher.
// No pybind11 and only the limited Python API, so one build serves every CPython >= 3.11.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",     // m_name
      nullptr,  // m_doc
      -1,       // m_size: no per-interpreter state
      nullptr,  // m_methods
      nullptr,  // m_slots
      nullptr,  // m_traverse
      nullptr,  // m_clear
      nullptr,  // m_free
  };
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(commpress, m) {
  // Packs 1-D uint8 `fields` (each < 2**bits, bits in {1, 2, 4, 8}) LSB-first into
  // ceil(numel * bits / 8) bytes. See commpress/bitpack.py for the exact layout.
  m.def("pack_bits(Tensor fields, int bits) -> Tensor");
  // Inverse of pack_bits: n fields from exactly ceil(n * bits / 8) packed bytes.
  m.def("unpack_bits(Tensor packed, int bits, int n) -> Tensor");

  // Codec kernels. Specifications: the pure-torch references in commpress/codecs/*.py.
  // `x` is the 1-D tensor to encode (float32, float16, bfloat16 or float64). An optional
  // `residual` (1-D, x's compute dtype: float64 for float64 x, float32 otherwise) turns on fused
  // error feedback: the kernel encodes w = (x + residual) rounded to x's dtype and overwrites
  // residual with x + residual - decode(w), all in one call. Invalid input (NaN/Inf in w, an
  // overflowing scale) raises before anything is written, leaving residual as it was.
  // Seeds are the uint64 seed's bit pattern as int64. Decode ops write the decoded tensor into
  // `out` (1-D, its dtype), or add it to `out` when accumulate (the reduce step of a collective).

  // Sign: bits (1 for w < 0, LSB-first) and one scale per block (mean |w|, block_size 0 = one
  // block), summed in the fixed order of include/commpress/tree.h.
  m.def("sign_encode(Tensor x, Tensor(a!)? residual, int block_size) -> (Tensor scales, Tensor bits)");
  m.def("sign_decode(Tensor scales, Tensor bits, int block_size, Tensor(a!) out, bool accumulate=True) -> ()");
  // QSGD: per-bucket norms and bits-wide fields (level + levels) with stochastic rounding
  // drawn from the counter-based RNG keyed by seed.
  m.def("qsgd_encode(Tensor x, Tensor(a!)? residual, int bits, int levels, int bucket_size, int seed) -> (Tensor norms, Tensor packed)");
  m.def("qsgd_decode(Tensor norms, Tensor packed, int bits, int levels, int bucket_size, Tensor(a!) out, bool accumulate=True) -> ()");
  // Top-k by magnitude, exact, ties toward the lower index; indices sorted ascending (int32,
  // or int64 past 2**31 - 1 elements), values copied from x.
  m.def("topk_select(Tensor x, int k) -> (Tensor indices, Tensor values)");
  // out[indices[p][j]] += values[p][j] for every payload p in order; each payload's indices
  // must be strictly increasing and in range (checked before anything is written).
  m.def("sparse_scatter_add(Tensor[] indices, Tensor[] values, Tensor(a!) out) -> ()");
  // Random-k: value j is x at a seed-drawn index of stratum j (times its length if scaled);
  // the scatter adds values back at the same indices, regenerated from the seed.
  m.def("randomk_gather(Tensor x, int k, int seed, bool scaled) -> Tensor");
  m.def("randomk_scatter_add(Tensor values, int seed, Tensor(a!) out) -> ()");
  // Block-scaled integers (int8 / int4, commpress/spec/blockint.py): per block of block_size
  // elements (a longer block is the whole tensor) the scale absmax / q_max in x's compute
  // dtype, q_max = 127 (bits 8) or 7 (bits 4), and per element the field
  // clamp(round_half_even(x / scale), -q_max, q_max) + q_max, packed LSB-first. NaN/Inf, or a
  // scale whose q_max multiple overflows x's dtype, raises. Decode: (field - q_max) * scale.
  m.def("blockint_encode(Tensor x, int bits, int block_size) -> (Tensor scales, Tensor packed)");
  m.def("blockint_decode(Tensor scales, Tensor packed, int bits, int block_size, Tensor(a!) out, bool accumulate=True) -> ()");
  // The same with stochastic rounding (the FSDP error-feedback store): field =
  // floor((floor(clamp(x / scale, -q_max, q_max) * 2**24) + v) / 2**24) + q_max, v element i's
  // 24-bit uniform of rng.paired_u24(seed, STREAM_BLOCKINT_SR); decoded by blockint_decode.
  m.def("blockint_encode_sr(Tensor x, int bits, int block_size, int seed) -> (Tensor scales, Tensor packed)");
  // Ternary (commpress/spec/ternary.py, the FSDP store's smallest kind), float32 only: per
  // block of block_size elements (the last one padded with zeros to a whole block, even a
  // block longer than x) the scale absmax, per element the level q in {-1, 0, 1} of
  // blockint_encode_sr's rounding with q_max = 1, the fields q + 1 packed five per byte in base
  // 3 (first element least significant), padded with field 1. Decode: out[i] = q_i * scale.
  m.def("ternary_encode_sr(Tensor x, int block_size, int seed) -> (Tensor scales, Tensor packed)");
  m.def("ternary_decode(Tensor scales, Tensor packed, int block_size, Tensor(a!) out) -> ()");

  // The instruction-set variant of the CPU kernels ("default", "avx2", "avx512"): returns the
  // active one after switching to `isa` (empty: no change). For tests and benchmarks.
  m.def("cpu_isa(str isa) -> str", [](const std::string& isa) -> std::string {
    try {
      return commpress::cpu::select_isa(isa);
    } catch (const std::invalid_argument& exc) {
      TORCH_CHECK(false, exc.what());
    }
  });
  m.def("cpu_isas() -> str", []() -> std::string { return commpress::cpu::available_isas(); });
}
