// The one place where commpress operator schemas are defined. Backends only add kernels with
// TORCH_LIBRARY_IMPL (csrc/cpu/*.cpp, csrc/cuda/bindings.cpp); Python adds fake (meta)
// kernels in commpress/ops.py.
#include <Python.h>
#include <torch/library.h>

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
}
