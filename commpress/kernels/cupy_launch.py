"""The launch steps the CUDA launchers share, in Python: kernel arguments, grids, block encodes.

What ``csrc/cuda/common.cuh`` and ``block_sums.cuh`` do around every kernel launch, for the CuPy
backend's ops (:mod:`.cupy_cuda`): the storage type of each dtype (:data:`CTYPE`), pointer
arguments (:func:`ptr`), a thread per item or a warp per 32 (:func:`per_item`,
:func:`per_word`), the block layout, the block codecs' encode sequence (:class:`BlockEncode`)
and the flag word. Every grid and scratch size comes from :mod:`.cupy_header`; the launches
themselves go through whatever launcher the op passes (:class:`.cupy_nvrtc.Launcher`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import checks
from .cupy_header import launch_params
from .cupy_nvrtc import Launcher

# Storage type of each dtype in the kernels (include/commpress/hd.h).
CTYPE = {
    torch.float32: "float",
    torch.float16: "commpress::Half",
    torch.bfloat16: "commpress::BFloat16",
    torch.float64: "double",
}
BOOLS = ("false", "true")
NS = "commpress::cuda::"
# struct Layout of block_sums.cuh, passed to kernels by value.
LAYOUT = np.dtype([("n", "<i8"), ("block", "<i8"), ("nblocks", "<i8"), ("groups", "<i8")])


def per_item(launch: Launcher, name: str, count: int, *args: Any) -> None:
    """Launch ``name`` with a thread per item: ``grid(grid_items(count)), kThreads`` in C."""
    p = launch_params()
    launch(name, p.grid_items(count), p.kThreads, *args)


def per_word(launch: Launcher, name: str, count: int, *args: Any) -> None:
    """Launch ``name`` with a warp per 32 items: ``grid(grid_words(count)), kThreads`` in C."""
    p = launch_params()
    launch(name, p.grid_words(count), p.kThreads, *args)


def ptr(t: torch.Tensor | None, byte_offset: int = 0) -> np.uint64:
    """A kernel pointer argument: 8 bytes by value (null for an absent residual)."""
    return np.uint64(0 if t is None else t.data_ptr() + byte_offset)


def layout(n: int, block: int) -> tuple[np.void, int, int]:
    """(Layout struct, nblocks, groups_per_block) of block_sums.cuh make_layout."""
    block = checks.effective_block(n, block)
    nblocks = checks.n_blocks(n, block)
    groups = launch_params().groups_per_block(block)
    struct: np.void = np.array([(n, block, nblocks, groups)], dtype=LAYOUT)[0]
    return struct, nblocks, groups


class BlockEncode:
    """One block codec's encode, launched as ``block_sums.cuh`` ``launch_block_encode`` does.

    The sequence sign and QSGD share: the launcher's scratch (``commpress_reduce_scratch_cuda``)
    and flag word, :meth:`reduce` (per-block sums into the scratch), :meth:`finalize` (one
    thread per block writes its scale), :meth:`encode` (whole warps per 32 elements write the
    packed output), then :meth:`raise_flags` reads the flag word like the binding does.
    """

    def __init__(
        self, launch: Launcher, x: torch.Tensor, residual: torch.Tensor | None, block: int
    ) -> None:
        self.x, self.residual = x, residual
        self.struct, self.nblocks, self.groups = layout(x.numel(), block)
        self.scratch = torch.empty(
            launch_params().encode_scratch(self.nblocks, self.groups), dtype=torch.float64, device=x.device
        )
        self.flags = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.launch = launch
        self.t, self.has_e = CTYPE[x.dtype], BOOLS[residual is not None]

    def reduce(self, kind: str, amax_off: int | None = None, base: int = 0) -> int:
        """block_sums.cuh launch_block_reduce; returns the double offset of the per-block values."""
        amax = self.scratch_ptr(amax_off) if amax_off is not None else np.uint64(0)
        nblocks, launch, p = self.nblocks, self.launch, launch_params()
        launch(
            f"{NS}group_sums_kernel<{NS}{kind}, {self.t}, {self.has_e}>",
            p.grid_warps(nblocks * self.groups),
            p.kThreads,
            ptr(self.x),
            ptr(self.residual),
            amax,
            self.struct,
            self.scratch_ptr(base),
            ptr(self.flags),
        )
        level = BOOLS[kind == "kMaxAbs"]
        src, per = base, self.groups
        while per > 1:
            per_out = p.ceil_div(per, p.kWarp)
            dst = src + nblocks * per
            launch(
                f"{NS}tree_level_kernel<{level}>",
                p.grid_warps(nblocks * per_out),
                p.kThreads,
                self.scratch_ptr(src),
                np.int64(per),
                np.int64(nblocks),
                np.int64(per_out),
                self.scratch_ptr(dst),
            )
            src, per = dst, per_out
        return src

    def scratch_ptr(self, offset: int) -> np.uint64:
        """Pointer to the double at ``offset`` of the scratch."""
        return ptr(self.scratch, 8 * offset)

    def finalize(self, kernel: str, *args: Any) -> None:
        """Launch ``kernel`` (in ``commpress::cuda``) over the blocks, one thread per block."""
        per_item(self.launch, NS + kernel, self.nblocks, *args)

    def encode(self, kernel: str, *args: Any) -> None:
        """Launch ``kernel`` (in ``commpress::cuda``) over the elements, one warp per 32."""
        per_word(self.launch, NS + kernel, self.x.numel(), *args)

    def raise_flags(self, op: str, scale: str, ct: torch.dtype) -> int:
        """Read the flag word; NaN/Inf and an overflowing ``scale`` raise. Returns the flags."""
        f, p = read_flags(self.flags), launch_params()
        if f & p.kFlagNonFinite:
            raise checks.non_finite(op, self.residual is not None)
        if f & p.kFlagOverflow:
            raise checks.overflow(op, scale, ct)
        return f


def read_flags(flags: torch.Tensor) -> int:
    """The flag word's value; synchronises the stream, like the binding's read_flags."""
    return int(flags.item())


def launch_check_finite(launch: Launcher, x: torch.Tensor, flags: torch.Tensor) -> None:
    """Launch ``check_finite_kernel``: sets kFlagNonFinite when ``x`` holds NaN/Inf."""
    n = x.numel()
    per_item(
        launch,
        f"{NS}check_finite_kernel<{CTYPE[x.dtype]}>",
        n,
        ptr(x),
        np.int64(n),
        ptr(flags),
    )
