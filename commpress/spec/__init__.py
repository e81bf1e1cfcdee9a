"""The specifications every kernel backend matches: pure torch, no kernels, no codecs.

- :mod:`.numerics`: the dtype of codec arithmetic, the fixed summation order (``tree_sum``),
  the correctly rounded square root, the finiteness test;
- :mod:`.bitpack`: LSB-first bit-field packing; :mod:`.varlen`: Elias-gamma coding of levels;
- :mod:`.blocks`: what the block codecs' references share (fused error feedback, per-block decode);
- :mod:`.sign`, :mod:`.qsgd`, :mod:`.topk`, :mod:`.randomk`: each codec's reference encode/decode,
  the ``reference`` backend of :mod:`commpress.kernels` and what native, numba and CuPy are tested against;
- :mod:`.blockint`: the int8/int4 codecs' reference (block absmax scales, round half to even), what
  their fast path :mod:`commpress.kernels.blockint` is tested against bit for bit;
- :mod:`.ternary`: the ternary kind of FSDP's compression state (levels -1, 0, 1, five per byte;
  stochastic rounding), the specification and, having no kernel, the implementation.

Imports point down only: to :mod:`commpress.rng`, :mod:`commpress.dtypes` and :mod:`commpress.errors`.
"""
