"""The ``reference`` backend: every op run on its pure-torch specification (:mod:`commpress.spec`).

The backend of last resort on every device, and what the others are tested against. Like the
numba and CuPy backends it exports each op with the native schema's arguments, already
validated by :mod:`.checks`; it only maps them onto the specifications' own arguments (a block
longer than the tensor is one block, the schema's int64 seed back to its uint64 bits).
"""

from __future__ import annotations

import torch

from .. import rng
from ..spec import blockint, qsgd, randomk, sign, ternary, topk
from ..spec.bitpack import pack_bits_reference, unpack_bits_reference
from . import checks, schema
from .schema import implements

OPS = frozenset(schema.OP_NAMES)  # all of them


def _unsigned(seed: int) -> int:
    return seed & rng.SEED_MASK  # the schema's int64 bit pattern back to the uint64 seed


@implements(schema.PackBits)
def pack_bits(a: schema.PackBits) -> torch.Tensor:
    """:func:`commpress.spec.bitpack.pack_bits_reference`."""
    return pack_bits_reference(*a)


@implements(schema.UnpackBits)
def unpack_bits(a: schema.UnpackBits) -> torch.Tensor:
    """:func:`commpress.spec.bitpack.unpack_bits_reference`."""
    return unpack_bits_reference(*a)


@implements(schema.SignEncode)
def sign_encode(a: schema.SignEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`commpress.spec.sign.encode_reference` (a block longer than x is one block)."""
    return sign.encode_reference(a.x, checks.effective_block(a.x.numel(), a.block_size), a.residual)


@implements(schema.SignDecode)
def sign_decode(a: schema.SignDecode) -> None:
    """:func:`commpress.spec.sign.decode_reference`."""
    block = checks.effective_block(a.out.numel(), a.block_size)
    sign.decode_reference(a.scales, a.bits, block, a.out, a.accumulate)


@implements(schema.QsgdEncode)
def qsgd_encode(a: schema.QsgdEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`commpress.spec.qsgd.encode_reference`."""
    bucket = checks.effective_block(a.x.numel(), a.bucket_size)
    return qsgd.encode_reference(a.x, a.bits, a.levels, bucket, _unsigned(a.seed), a.residual)


@implements(schema.QsgdDecode)
def qsgd_decode(a: schema.QsgdDecode) -> None:
    """:func:`commpress.spec.qsgd.decode_reference`."""
    bucket = checks.effective_block(a.out.numel(), a.bucket_size)
    qsgd.decode_reference(a.norms, a.packed, a.bits, a.levels, bucket, a.out, a.accumulate)


@implements(schema.TopkSelect)
def topk_select(a: schema.TopkSelect) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`commpress.spec.topk.select_reference`."""
    return topk.select_reference(*a)


@implements(schema.SparseScatterAdd)
def sparse_scatter_add(a: schema.SparseScatterAdd) -> None:
    """:func:`commpress.spec.topk.scatter_add_reference`."""
    topk.scatter_add_reference(*a)


@implements(schema.RandomkGather)
def randomk_gather(a: schema.RandomkGather) -> torch.Tensor:
    """:func:`commpress.spec.randomk.gather_reference`."""
    return randomk.gather_reference(a.x, a.k, _unsigned(a.seed), a.scaled)


@implements(schema.RandomkScatterAdd)
def randomk_scatter_add(a: schema.RandomkScatterAdd) -> None:
    """:func:`commpress.spec.randomk.scatter_add_reference`."""
    randomk.scatter_add_reference(a.values, _unsigned(a.seed), a.out)


@implements(schema.BlockintEncode)
def blockint_encode(a: schema.BlockintEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`commpress.spec.blockint.encode_reference` (a block longer than x is one block)."""
    return blockint.encode_reference(a.x, a.bits, checks.effective_block(a.x.numel(), a.block_size))


@implements(schema.BlockintEncodeSr)
def blockint_encode_sr(a: schema.BlockintEncodeSr) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`commpress.spec.blockint.encode_stochastic_reference` (a block longer than x is one block)."""
    block = checks.effective_block(a.x.numel(), a.block_size)
    return blockint.encode_stochastic_reference(a.x, a.bits, block, _unsigned(a.seed))


@implements(schema.BlockintDecode)
def blockint_decode(a: schema.BlockintDecode) -> None:
    """:func:`commpress.spec.blockint.decode_reference`."""
    block = checks.effective_block(a.out.numel(), a.block_size)
    blockint.decode_reference(a.scales, a.packed, a.bits, block, a.out, a.accumulate)


@implements(schema.TernaryEncodeSr)
def ternary_encode_sr(a: schema.TernaryEncodeSr) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`commpress.spec.ternary.encode_stochastic` (a block longer than x is padded, as there)."""
    return ternary.encode_stochastic(a.x, a.block_size, _unsigned(a.seed))


@implements(schema.TernaryDecode)
def ternary_decode(a: schema.TernaryDecode) -> None:
    """:func:`commpress.spec.ternary.decode`, written into ``out``."""
    a.out.copy_(ternary.decode(a.scales, a.packed, a.block_size, a.out.numel()))
