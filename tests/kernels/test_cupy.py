"""The CuPy CUDA backend (commpress/kernels/cupy_cuda.py and its rooms cupy_header, cupy_nvrtc,
cupy_launch).

Without a GPU (any machine with CuPy's NVRTC): the exact sources, options and name expressions
the backend uses compile for sm_80/sm_90 and every kernel it launches is in the result; every
launch passes arguments of the sizes the compiled kernel declares (the launches are recorded on
CPU tensors and checked against the PTX parameter lists). With a GPU and CuPy: every op against
the pure-torch reference, bit for bit, for the four dtypes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from commpress import bitpack
from commpress.codecs import qsgd as qsgd_mod
from commpress.codecs import randomk as randomk_mod
from commpress.codecs import sign as sign_mod
from commpress.codecs import topk as topk_mod
from commpress.errors import KernelArgumentError, NonFiniteError
from commpress.kernels import cupy_cuda, cupy_header, cupy_nvrtc, ops, schema

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ARCHS = ["compute_80", "compute_90"]


def _nvrtc() -> Any:
    pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - libnvrtc missing or unloadable
        pytest.skip(f"NVRTC not loadable: {exc}")
    return nvrtc


_images: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}


def _ptx(unit: str, arch: str = "compute_90") -> tuple[str, dict[str, str]]:
    if (unit, arch) not in _images:
        _nvrtc()
        image, lowered = cupy_nvrtc.compile_unit(unit, arch)
        _images[unit, arch] = image.decode(), lowered
    return _images[unit, arch]


_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.([a-z]+)(\d+)\s+[\w$]+(?:\[(\d+)\])?")


def _entry_params(ptx: str, lowered: str) -> list[tuple[str, int]]:
    """(PTX type class, size in bytes) of each parameter of kernel ``lowered``."""
    m = re.search(r"\.entry\s+" + re.escape(lowered) + r"\s*\((.*?)\)", ptx, re.S)
    assert m is not None, f"{lowered} is not an entry of the PTX"
    params = []
    for kind, bits, count in _PARAM.findall(m.group(1)):
        params.append((kind, int(bits) // 8 * (int(count) if count else 1)))
    return params


# ----- without a GPU --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("unit", cupy_header.UNITS)
def test_sources_compile_and_every_kernel_lowers(unit: str, arch: str) -> None:
    ptx, lowered = _ptx(unit, arch)
    _, _, names = cupy_nvrtc.module_source(unit)
    assert set(lowered) == set(names) and names
    entries = set(re.findall(r"\.entry\s+([\w$]+)\s*\(", ptx))
    assert not [n for n in names if lowered[n] not in entries]


def test_cubin_for_a_real_gpu_arch() -> None:
    _nvrtc()
    image, _ = cupy_nvrtc.compile_unit("bitpack", "sm_90")
    assert image[:4] == b"\x7fELF"


def test_module_source_is_the_nvcc_source() -> None:
    code, options, _ = cupy_nvrtc.module_source("sign")
    assert code == (cupy_header.CSRC / "cuda" / "sign.cu").read_text()
    # results must not depend on the compiler: no flush-to-zero, IEEE division and sqrt
    assert "-ftz=false" in options and "-prec-div=true" in options and "-prec-sqrt=true" in options


def test_launch_parameters_come_from_the_cuda_header() -> None:
    """cupy_header restates nothing: constants and kernel names are read from launch_params.h."""
    p = cupy_header.launch_params()
    assert (p.kThreads, p.kWarp, p.kMaxBlocks, p.kGroupElems) == (256, 32, 1 << 16, 1024)
    assert (p.kSumAbs, p.kMaxAbs, p.kFlagNonFinite, p.kFlagTooBig) == (0, 3, 1, 4)
    assert p.kBins == 1 << p.kDigitBits
    assert p.kTopkScratchWords == p.kSelectStateWords + p.kBins + 3 * p.kCountBlocks
    assert set(p.kernels) == set(cupy_header.UNITS)
    sign = cupy_nvrtc.module_source("sign")[2]
    assert "commpress::cuda::sign_encode_kernel<commpress::Half, true>" in sign
    assert len(sign) == len(set(sign)) == 1 + 4 * 2 + 4 * (1 + 2 + 2)
    qsgd = cupy_nvrtc.module_source("qsgd")[2]
    assert "commpress::cuda::group_sums_kernel<commpress::cuda::kMaxAbs, double, false>" in qsgd
    assert not any("kSumSquare, double" in name for name in qsgd)
    header = (cupy_header.CSRC / "cuda" / "launch_params.h").read_text()
    for source in ("common.cuh", "bitpack.cu"):  # the launchers include the same header
        assert '#include "launch_params.h"' in (cupy_header.CSRC / "cuda" / source).read_text()
    assert "kThreads = 256" in header


def test_grid_and_scratch_functions_evaluate_as_the_compiler_does() -> None:
    """The header's static_asserts (checked by nvcc/NVRTC) hold for the Python evaluation too."""
    p = cupy_header.launch_params()
    header = (cupy_header.CSRC / "cuda" / "launch_params.h").read_text()
    asserts = re.findall(r"static_assert\((.*?),\s*\"", header, re.S)
    assert len(asserts) >= 4
    env = vars(p)
    for expr in asserts:
        py = re.sub(r"(\d+)LL\b", r"\1", " ".join(expr.split())).replace("&&", " and ")
        assert eval(py, {"__builtins__": {}}, env), expr
    # the functions are the launchers' formulas, not copies of them
    for fn in ("grid_items", "grid_warps", "grid_words", "grid_histogram", "grid_count"):
        assert callable(getattr(p, fn))
    for n in (1, 31, 32, 33, 1000, 1 << 20, 1 << 33):
        assert p.grid_items(n) == max(1, min(-(-n // 256), 1 << 16))
        assert p.grid_words(n) == p.grid_items(-(-n // 32) * 32)
        assert p.grid_count(n) == min(n // 256 + 1, 1024)
    for nblocks, per in ((1, 1), (3, 2000), (7, 33), (2, 1 << 20)):
        total, level = 0, per
        while True:  # block_sums.cuh's levels
            total += nblocks * level
            if level == 1:
                break
            level = -(-level // 32)
        assert p.reduce_scratch(nblocks, per) == total
        assert p.encode_scratch(nblocks, per) == 2 * total + 2
    assert p.domains["B"] == ["2", "4", "8"] and p.domains["P"] == ["1", "2", "4", "8"]
    assert p.kQsgdWidths == (2, 4, 8)
    assert p.domains["T"] == ["float", "commpress::Half", "commpress::BFloat16", "double"]
    with pytest.raises(ValueError, match="one top-level"):
        cupy_header._function("f", "int64_t a", "a ? 1 : a ? 2 : 3", {})
    with pytest.raises(ValueError, match="int64_t arguments"):
        cupy_header._function("f", "int a", "a", {})


def test_import_does_not_load_cupy_or_cuda() -> None:
    code = (
        "import sys, commpress, commpress.kernels.ops, commpress.kernels.cupy_cuda\n"
        "import commpress.kernels.cupy_header, commpress.kernels.cupy_nvrtc\n"
        "import commpress.kernels.cupy_launch\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "import torch; assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_backend_module_still_offers_what_it_did_before_the_split() -> None:
    """Imports from ``cupy_cuda`` (info.py's and users') keep working: the same objects."""
    assert cupy_cuda.CSRC == cupy_header.CSRC and cupy_cuda.UNITS == cupy_header.UNITS
    assert cupy_cuda.launch_params is cupy_header.launch_params
    assert cupy_cuda.module_source is cupy_nvrtc.module_source
    assert cupy_cuda.compile_unit is cupy_nvrtc.compile_unit
    assert cupy_cuda.unavailable is cupy_nvrtc.unavailable
    assert cupy_cuda.OPS == frozenset(schema.OP_NAMES) - frozenset(schema.NATIVE_ONLY_OPS)
    assert all(callable(getattr(cupy_cuda, op)) for op in cupy_cuda.OPS)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the fallback on a machine without a GPU"
)
def test_without_a_gpu_cuda_ops_fall_back_to_the_reference() -> None:
    reason = cupy_cuda.unavailable()
    assert reason is not None
    assert ops.backend_unavailable("cupy") == reason
    for op in cupy_cuda.OPS:
        assert ops.backend_for(op, "cuda") in ("native", "reference")


class _Recorder:
    """Stands in for ``cupy_nvrtc.Launcher``: records every launch instead of running it."""

    launches: list[tuple[str, str, int, int, tuple[Any, ...]]] = []

    def __init__(self, unit: str, device: torch.device) -> None:
        self.unit_name = unit

    def __call__(self, name: str, grid: int, block: int, *args: Any) -> None:
        self.launches.append((self.unit_name, name, grid, block, args))


def _run_every_op(dtype: torch.dtype, n: int) -> None:
    x = torch.randn(n).to(dtype)
    e = torch.zeros(n, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    out = torch.zeros(n, dtype=dtype)
    for residual in (None, e):
        s, b = cupy_cuda.sign_encode(x, residual, 0)
        s, b = cupy_cuda.sign_encode(x, residual, 33)
        for bits, bucket in ((2, 7), (4, 2048), (8, 7)):  # 2048: the tree levels of the sums
            norms, packed = cupy_cuda.qsgd_encode(x, residual, bits, 1, bucket, 3)
            cupy_cuda.qsgd_decode(norms, packed, bits, 1, bucket, out, True)
            cupy_cuda.qsgd_decode(norms, packed, bits, 1, bucket, out, False)
    for acc in (True, False):
        cupy_cuda.sign_decode(s, b, 33, out, acc)
    for k in (0, 1, n // 3 + 1):
        idx, val = cupy_cuda.topk_select(x, min(k, n))
    cupy_cuda.sparse_scatter_add([idx, idx.long()], [val, val], out)
    values = cupy_cuda.randomk_gather(x, n // 4 + 1, 5, True)
    cupy_cuda.randomk_scatter_add(values, 5, out)
    for bits in (1, 2, 4, 8):
        fields = torch.zeros(n, dtype=torch.uint8)
        cupy_cuda.unpack_bits(cupy_cuda.pack_bits(fields, bits), bits, n)


def test_launch_arguments_match_the_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch of every op (recorded on CPU tensors) against the PTX parameter lists."""
    _nvrtc()
    monkeypatch.setattr(cupy_cuda, "Launcher", _Recorder)  # the ops build every launcher
    _Recorder.launches = []
    for dtype in DTYPES:
        for n in (1, 100, 3000):  # one block, several blocks, several summation groups
            _run_every_op(dtype, n)
    launched = {(unit, name) for unit, name, *_ in _Recorder.launches}
    expected = {(u, name) for u in cupy_header.UNITS for name in cupy_nvrtc.module_source(u)[2]}
    assert launched <= expected  # every launched kernel is compiled ...
    # int64 top-k indices need more than 2**31 elements: not recordable here
    missing = {
        (u, name)
        for u, name in expected - launched
        if "int64_t>" not in name or "write" not in name
    }
    assert not missing, f"compiled but never launched here: {sorted(missing)[:5]}"  # ... and used
    for unit, name, grid, block, args in _Recorder.launches:
        ptx, lowered = _ptx(unit)
        params = _entry_params(ptx, lowered[name])
        assert len(params) == len(args), name
        for i, ((kind, size), arg) in enumerate(zip(params, args)):
            assert isinstance(arg, np.generic), f"{name} argument {i} is {type(arg).__name__}"
            assert arg.itemsize == size, (
                f"{name} argument {i}: {arg.itemsize} bytes, kernel takes {size}"
            )
            if kind == "f":
                assert arg.dtype.kind == "f", f"{name} argument {i} must be a float"
            if kind == "b" and size > 1:
                assert arg.dtype.names is not None, f"{name} argument {i} must be a struct"
        assert 1 <= grid <= 1 << 16 and 32 <= block <= 1024 and block % 32 == 0, name


# ----- with a GPU and CuPy --------------------------------------------------------------------------
def _gpu() -> None:
    pytest.importorskip("cupy", reason="CuPy is not installed")
    reason = cupy_cuda.unavailable()
    if reason is not None:
        pytest.skip(reason)


BITS_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _same(got: Any, want: Any, what: str) -> None:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        g, w = g.cpu(), w.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, what
        if g.is_floating_point():
            g, w = g.view(BITS_VIEW[g.dtype]), w.view(BITS_VIEW[w.dtype])
        assert torch.equal(g, w), what


SIZES = [1, 33, 1000, 40_000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_ops_match_the_reference(dtype: torch.dtype, n: int) -> None:
    _gpu()
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    e = torch.randn(n, generator=gen, dtype=ct) * 0.1
    xd, ed = x.cuda(), e.cuda()
    for block in (0, 64):
        e_ref, e_dev = e.clone(), ed.clone()
        want = sign_mod.encode_reference(x, block, e_ref)
        got = cupy_cuda.sign_encode(xd, e_dev, block)
        _same(got, want, f"sign_encode {block}")
        _same(e_dev, e_ref, "sign_encode residual")
        for acc in (True, False):
            out_ref, out_dev = x.clone(), xd.clone()
            sign_mod.decode_reference(*want, block, out_ref, acc)
            cupy_cuda.sign_decode(*got, block, out_dev, acc)
            _same(out_dev, out_ref, "sign_decode")
    for bits, levels in ((2, 1), (4, 7), (8, 127)):
        e_ref, e_dev = e.clone(), ed.clone()
        want = qsgd_mod.encode_reference(x, bits, levels, 512, 2**64 - 3, e_ref)
        got = cupy_cuda.qsgd_encode(xd, e_dev, bits, levels, 512, -3)  # the int64 bit pattern
        _same(got, want, f"qsgd_encode bits={bits}")
        _same(e_dev, e_ref, "qsgd_encode residual")
        for acc in (True, False):
            out_ref, out_dev = x.clone(), xd.clone()
            qsgd_mod.decode_reference(*want, bits, levels, 512, out_ref, acc)
            cupy_cuda.qsgd_decode(*got, bits, levels, 512, out_dev, acc)
            _same(out_dev, out_ref, "qsgd_decode")
    k = max(1, n // 10)
    want = topk_mod.select_reference(x, k)
    got = cupy_cuda.topk_select(xd, k)
    _same(got, want, "topk_select")
    out_ref, out_dev = x.clone(), xd.clone()
    topk_mod.scatter_add_reference([want[0]], [want[1]], out_ref)
    cupy_cuda.sparse_scatter_add([got[0]], [got[1]], out_dev)
    _same(out_dev, out_ref, "sparse_scatter_add")
    for scaled in (True, False):
        want_v = randomk_mod.gather_reference(x, k, 11, scaled)
        got_v = cupy_cuda.randomk_gather(xd, k, 11, scaled)
        _same(got_v, want_v, "randomk_gather")
        out_ref, out_dev = x.clone(), xd.clone()
        randomk_mod.scatter_add_reference(want_v, 11, out_ref)
        cupy_cuda.randomk_scatter_add(got_v, 11, out_dev)
        _same(out_dev, out_ref, "randomk_scatter_add")


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_gpu_bit_packing_matches_the_reference(bits: int) -> None:
    _gpu()
    for n in (0, 1, 7, 33, 10_001):
        fields = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
        packed = cupy_cuda.pack_bits(fields.cuda(), bits)
        _same(packed, bitpack.pack_bits_reference(fields, bits), "pack_bits")
        _same(cupy_cuda.unpack_bits(packed, bits, n), fields, "unpack_bits")


def test_gpu_data_errors_name_the_argument() -> None:
    _gpu()
    x = torch.tensor([1.0, float("nan"), 2.0], device="cuda")
    e = torch.zeros(3, device="cuda")
    c = ops.checked
    with ops.use_backend("cupy"):
        with pytest.raises(NonFiniteError, match=r"^sign_encode: x \+ residual contains NaN or Inf"):
            c.sign_encode(x, e, 0)
        assert torch.equal(e, torch.zeros(3, device="cuda"))  # nothing was written
        with pytest.raises(NonFiniteError, match=r"^topk_select: x contains NaN or Inf"):
            c.topk_select(x, 1)
        with pytest.raises(
            KernelArgumentError, match=r"^pack_bits: fields\[1\] = 2 does not fit in bits=1"
        ):
            c.pack_bits(torch.tensor([1, 2], dtype=torch.uint8, device="cuda"), 1)
        out = torch.zeros(4, device="cuda")
        bad = torch.tensor([1, 1], dtype=torch.int32, device="cuda")
        with pytest.raises(KernelArgumentError, match=r"strictly increasing"):
            c.sparse_scatter_add([bad], [torch.ones(2, device="cuda")], out)
        assert torch.equal(out, torch.zeros(4, device="cuda"))


def test_gpu_cupy_serves_cuda_ops_without_native_kernels() -> None:
    _gpu()
    for op in cupy_cuda.OPS:
        if not ops.has_native(op, "cuda"):
            assert ops.backend_for(op, "cuda") == "cupy", op
    with ops.use_backend("cupy"):
        assert all(ops.backend_for(op, "cuda") == "cupy" for op in cupy_cuda.OPS)
