"""The CuPy CUDA backend: the native CUDA kernels, compiled at run time, when ``_C`` has none.

A torch wheel without the CUDA extension (pure-Python install, CPU build of ``commpress._C``,
a build for another torch) still has CUDA tensors to compress. This backend compiles the very
same kernel sources as the nvcc build (``csrc/cuda/*.cu``, one source, no copies) with NVRTC
and launches them with CuPy, so CUDA tensors get the native kernels' results bit for bit.

How it maps onto the native build:

* **Sources.** Each ``csrc/cuda/<unit>.cu`` is one NVRTC program (like one nvcc translation
  unit). Their host code -- the C launchers and ``<<<...>>>`` -- is fenced off with
  ``#ifndef __CUDACC_RTC__``; ``csrc/cuda/nvrtc/`` stands in for the few system headers. The
  kernels are templates: every instantiation the launchers use is an NVRTC name expression
  in the table of ``csrc/cuda/launch_params.h`` (:func:`launch_params`), looked up by its
  lowered name.
* **Launch parameters** come from that same header, which the C launchers include:
  threads, grid caps, reduction kinds, flag bits, the top-k scratch layout, the template
  domains the launchers dispatch over (storage types, pack and QSGD widths), and every grid
  and scratch size as a ``constexpr`` function (``grid_items``, ``grid_words``,
  ``grid_count``, ``reduce_scratch``, ``encode_scratch``, ...). The C launchers call those
  functions; :func:`launch_params` evaluates the very same text (a small checked subset of C
  integer arithmetic), and the header's ``static_assert`` values pin both evaluations. A
  change of geometry is one edit in ``launch_params.h``.
* **Compiler options** are nvcc's defaults spelled out (``-ftz=false -prec-div=true
  -prec-sqrt=true -fmad=true``): results must not depend on the compiler. That is also why
  this module calls NVRTC itself (:func:`compile_unit`) and loads the binary with
  ``cupy.RawModule(path=...)`` instead of ``RawModule(code=...)``: CuPy appends ``-ftz=true``
  to every source it compiles, which would flush float32 subnormals to zero.
* **Launches** follow the C launchers (``csrc/cuda/*.cu``, ``extern "C"``) step by step: the
  same kernels in the same order with the same grid functions, scratch offsets and flag words,
  on torch's current stream. What is written on both sides is only that sequence of calls
  with each kernel's arguments -- a language binding, which ``tests/test_cupy.py`` records and
  checks against the compiled PTX (every launched kernel compiled, every compiled kernel
  launched, every argument of the declared size). Outputs and scratch are torch tensors
  (torch's caching allocator); kernels get raw device pointers, so float16/bfloat16 tensors
  need no CuPy dtype (CuPy has no bfloat16).
* **Errors**: arguments arrive validated (:mod:`commpress.kernels.ops` runs the op's check in
  :mod:`.checks` before any backend; call these only through it). Data errors (NaN/Inf, an
  overflowing scale, a bad index) come back through the flag words of the launchers and raise
  the errors :mod:`.checks` words. Reading a flag synchronises the stream, as in the native
  binding.

Nothing here touches CUDA or CuPy before an op runs or :func:`unavailable` is called.
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .. import rng
from ..dtypes import index_dtype
from . import checks, schema
from .schema import implements

OPS = frozenset(schema.OP_NAMES)  # all of them

#: The CUDA sources the backend compiles at run time: csrc/ of the checkout (source and editable
#: installs), else the copy setup.py puts into the package (wheels and ``pip install .``).
_CHECKOUT_CSRC = Path(__file__).resolve().parents[2] / "csrc"
CSRC = _CHECKOUT_CSRC if (_CHECKOUT_CSRC / "cuda").is_dir() else Path(__file__).resolve().parents[1] / "_csrc"
UNITS = ("bitpack", "sign", "qsgd", "topk", "randomk")

# Storage type of each dtype in the kernels (include/commpress/hd.h).
_CTYPE = {
    torch.float32: "float",
    torch.float16: "commpress::Half",
    torch.bfloat16: "commpress::BFloat16",
    torch.float64: "double",
}
_BOOLS = ("false", "true")
_NS = "commpress::cuda::"
# struct Layout of block_sums.cuh, passed to kernels by value.
_LAYOUT = np.dtype([("n", "<i8"), ("block", "<i8"), ("nblocks", "<i8"), ("groups", "<i8")])


# ----- csrc/cuda/launch_params.h -------------------------------------------------------------------
_CONSTEXPR = re.compile(r"constexpr\s+[\w:]+\s+(k\w+)\s*=\s*([^;{]+);")
_INT_LIST = re.compile(r"constexpr\s+int\s+(k\w+)\[\]\s*=\s*\{([^}]*)\};")
_FUNCTION = re.compile(
    r"COMMPRESS_LAUNCH_FN\s+constexpr\s+int64_t\s+(\w+)\(([^)]*)\)\s*\{\s*return\s+([^;]+);\s*\}", re.S
)
_TYPE_LIST = re.compile(r"#define\s+(COMMPRESS_\w+)\(X\)\s*((?:\\\n|[^\n])*)")
_ENUM = re.compile(r"enum\s+\w+\s*:\s*int\s*\{([^}]*)\}")
_TABLE = re.compile(r"constexpr\s+const\s+char\s*\*\s*(k\w+)\[\]\s*=\s*\{(.*?)\};", re.S)
_ARITH = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Add,
          ast.Sub, ast.Mult, ast.FloorDiv, ast.LShift, ast.USub)
# in a function body besides: calls of earlier functions and one `cond ? a : b`
_BODY = (*_ARITH, ast.Call, ast.IfExp, ast.Compare, ast.Lt, ast.Gt, ast.LtE, ast.GtE, ast.Eq,
         ast.NotEq)


def _eval_int(expr: str, known: dict[str, int]) -> int:
    """An integer constant expression of the header (literals, earlier constants, + - * / <<)."""
    tree = ast.parse(expr.replace("/", "//"), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ARITH) or (isinstance(node, ast.Constant) and type(node.value) is not int):
            raise ValueError(f"launch_params.h: unsupported constant expression {expr!r}")
        if isinstance(node, ast.Name) and node.id not in known:
            raise ValueError(f"launch_params.h: {node.id} used before it is defined in {expr!r}")
    return int(eval(compile(tree, "launch_params.h", "eval"), {"__builtins__": {}}, dict(known)))


def _function(name: str, params: str, body: str, scope: dict[str, Any]) -> Any:
    """A ``constexpr int64_t name(int64_t a, ...) { return body; }`` of the header, in Python.

    The body is C integer arithmetic on non-negative values (``/`` truncates: ``//`` here) with
    at most one top-level ``cond ? a : b``; names are the parameters, earlier constants and
    functions, and ``name`` itself (recursion).
    """
    args = [p.split()[-1] for p in params.split(",") if p.strip()]
    if any(p.split()[0] != "int64_t" for p in params.split(",") if p.strip()):
        raise ValueError(f"launch_params.h: {name} must take int64_t arguments only")
    expr = " ".join(body.split()).replace("/", "//")
    cond, q, rest = expr.partition("?")
    if q:
        then, colon, other = rest.partition(":")
        if not colon or ":" in other or "?" in other:
            raise ValueError(f"launch_params.h: {name}: one top-level `c ? a : b` at most")
        expr = f"({then}) if ({cond}) else ({other})"
    tree = ast.parse(expr, mode="eval")
    known = {*args, *scope, name}
    for node in ast.walk(tree):
        if not isinstance(node, _BODY) or (isinstance(node, ast.Constant) and type(node.value) is not int):
            raise ValueError(f"launch_params.h: unsupported expression in {name}: {body!r}")
        if isinstance(node, ast.Name) and node.id not in known:
            raise ValueError(f"launch_params.h: {node.id} used before it is defined in {name}")
    source = f"lambda {', '.join(args)}: {ast.unparse(tree)}"
    env = {"__builtins__": {}, **scope}
    fn = eval(compile(source, "launch_params.h", "eval"), env)
    env[name] = fn  # recursion
    return fn


@lru_cache(maxsize=1)
def launch_params() -> SimpleNamespace:
    """The constants, functions, domains and kernel table of ``csrc/cuda/launch_params.h``.

    Attributes: every ``constexpr`` integer, integer list and enumerator by its C++ name
    (``kThreads``, ``kQsgdWidths``, ``kFlagNonFinite``, ...); every ``constexpr int64_t``
    function by its name (``grid_items``, ``reduce_scratch``, ...) as a Python function of
    ints, evaluating the very text the C launchers compile; and ``kernels``: unit -> NVRTC name
    expressions, the table's ``{X}`` placeholders expanded over ``kNameDomains``. Read once,
    on first use; needs no GPU.
    """
    raw = (CSRC / "cuda" / "launch_params.h").read_text(encoding="utf-8")
    text = re.sub(r"//[^\n]*", "", raw)
    # declarations in source order: a function may use any constant or function above it
    decls = sorted(
        [(m.start(), "const", m) for m in _CONSTEXPR.finditer(text)]
        + [(m.start(), "list", m) for m in _INT_LIST.finditer(text)]
        + [(m.start(), "fn", m) for m in _FUNCTION.finditer(text)]
        + [(m.start(), "enum", m) for m in _ENUM.finditer(text)],
        key=lambda d: d[0],
    )
    values: dict[str, Any] = {}
    for _, kind, m in decls:
        if kind == "const":
            values[m.group(1)] = _eval_int(m.group(2).strip(), values)
        elif kind == "list":
            values[m.group(1)] = tuple(_eval_int(v.strip(), values) for v in m.group(2).split(","))
        elif kind == "fn":
            values[m.group(1)] = _function(m.group(1), m.group(2), m.group(3), values)
        else:
            for item in m.group(1).split(","):
                if item.strip():
                    name, expr = (part.strip() for part in item.split("="))
                    values[name] = _eval_int(expr, values)
    type_lists = {
        name: [args.split(",")[-1].strip() for args in re.findall(r"X\(([^)]*)\)", body)]
        for name, body in _TYPE_LIST.findall(raw)
    }
    tables = {name: re.findall(r'"([^"]*)"', body) for name, body in _TABLE.findall(text)}
    domains: dict[str, list[str]] = {}
    for entry in tables["kNameDomains"]:
        key, _, spec = (part.strip() for part in entry.partition("="))
        if spec in type_lists:
            domains[key] = type_lists[spec]
        elif isinstance(values.get(spec), tuple):
            domains[key] = [str(v) for v in values[spec]]
        else:
            domains[key] = [v.strip() for v in spec.split(",")]
    kernels: dict[str, list[str]] = {}
    for entry in tables["kKernelNames"]:
        unit, _, expr = (part.strip() for part in entry.partition(":"))
        keys = [k for k in domains if "{" + k + "}" in expr]
        for combo in itertools.product(*(domains[k] for k in keys)):
            name = expr
            for key, value in zip(keys, combo):
                name = name.replace("{" + key + "}", value)
            kernels.setdefault(unit, []).append(name)
    return SimpleNamespace(**values, domains=domains, kernels=kernels)


def _kernel_names(unit: str) -> list[str]:
    """Every kernel instantiation the launches of ``unit`` use (NVRTC name expressions)."""
    names = launch_params().kernels.get(unit)
    if not names:
        raise ValueError(f"unknown CUDA source unit {unit!r}; expected one of {', '.join(UNITS)}")
    return names


def module_source(unit: str) -> tuple[str, tuple[str, ...], list[str]]:
    """``(code, options, name_expressions)`` of ``csrc/cuda/<unit>.cu`` for NVRTC.

    ``code`` is the file as nvcc compiles it. Needs no GPU (tests compile it on any machine).
    """
    names = _kernel_names(unit)
    code = (CSRC / "cuda" / f"{unit}.cu").read_text(encoding="utf-8")
    options = (
        "-std=c++17",
        f"-I{CSRC / 'include'}",
        f"-I{CSRC / 'cuda'}",
        f"-I{CSRC / 'cuda' / 'nvrtc'}",
        # nvcc's defaults, so results match the nvcc build bit for bit
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        "-fmad=true",
    )
    return code, options, names


def compile_unit(unit: str, arch: str) -> tuple[bytes, dict[str, str]]:
    """Compile ``unit`` with NVRTC for ``arch`` (``sm_90``: cubin; ``compute_90``: PTX).

    Returns the image and the lowered (mangled) name of every name expression. Needs CuPy's
    NVRTC binding but no GPU. Raises RuntimeError with NVRTC's log when compilation fails.
    """
    from cupy.cuda import nvrtc

    code, options, names = module_source(unit)
    prog = nvrtc.createProgram(code, f"{unit}.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*options, f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile csrc/cuda/{unit}.cu:\n{log}") from exc
        image = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(image, str):
        image = image.encode()
    return bytes(image), lowered


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when CuPy, NVRTC, a CUDA device and the kernel sources are all there, else why not.

    Called only on first use (never at ``import commpress``); it asks torch and CuPy for a
    device, which loads the CUDA driver.
    """
    missing = [u for u in UNITS if not (CSRC / "cuda" / f"{u}.cu").is_file()]
    if missing:
        return (
            f"CUDA kernel sources not found under {CSRC / 'cuda'} (an installed copy without csrc/)"
        )
    try:
        import cupy
        from cupy.cuda import nvrtc
    except ImportError as exc:
        return f"cupy not importable: {exc}"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc raises various errors
        return f"NVRTC not loadable: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 - CuPy's runtime errors vary by version
        return f"CuPy cannot use the CUDA device: {exc}"
    return None


# ----- loading and launching ----------------------------------------------------------------------
_lock = threading.Lock()
_images: tempfile.TemporaryDirectory[str] | None = None  # cubin files of this process


def _arch_for(device: torch.device) -> str:
    """``sm_XY`` when NVRTC can build a cubin for the device, else PTX for the newest it can."""
    from cupy.cuda import nvrtc

    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    supported = [int(a) for a in nvrtc.getSupportedArchs()]
    if cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a <= cc]
    if not older:
        raise RuntimeError(f"NVRTC {nvrtc.getVersion()} cannot compile for compute capability {cc}")
    return f"compute_{max(older)}"  # the driver JITs the PTX for the newer GPU


class _Unit:
    """One compiled source unit on one device: kernels by name expression."""

    def __init__(self, unit: str, device: torch.device) -> None:
        import cupy

        global _images
        image, self.lowered = compile_unit(unit, _arch_for(device))
        if _images is None:
            _images = tempfile.TemporaryDirectory(prefix="commpress-cupy-")
        path = os.path.join(_images.name, f"{unit}-{device.index}.bin")
        with open(path, "wb") as f:
            f.write(image)
        with cupy.cuda.Device(device.index):
            self.module = cupy.RawModule(path=path)
        self.kernels: dict[str, Any] = {}

    def kernel(self, name: str) -> Any:
        fn = self.kernels.get(name)
        if fn is None:
            fn = self.kernels[name] = self.module.get_function(self.lowered[name])
        return fn


_units: dict[tuple[str, int], _Unit] = {}


def _unit(unit: str, device: torch.device) -> _Unit:
    key = (unit, device.index if device.index is not None else torch.cuda.current_device())
    with _lock:
        if key not in _units:
            _units[key] = _Unit(unit, torch.device("cuda", key[1]))
        return _units[key]


class _Launcher:
    """Launches one unit's kernels on ``device`` and torch's current stream there."""

    def __init__(self, unit: str, device: torch.device) -> None:
        import cupy

        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.unit = _unit(unit, self.device)
        self._cupy = cupy
        self._stream = cupy.cuda.ExternalStream(
            torch.cuda.current_stream(self.device).cuda_stream, index
        )

    def __call__(self, name: str, grid: int, block: int, *args: Any) -> None:
        with self._cupy.cuda.Device(self.device.index), self._stream:
            self.unit.kernel(name)((grid,), (block,), args)


def _per_item(launch: _Launcher, name: str, count: int, *args: Any) -> None:
    """Launch ``name`` with a thread per item: ``grid(grid_items(count)), kThreads`` in C."""
    launch(name, _p().grid_items(count), _p().kThreads, *args)


def _per_word(launch: _Launcher, name: str, count: int, *args: Any) -> None:
    """Launch ``name`` with a warp per 32 items: ``grid(grid_words(count)), kThreads`` in C."""
    launch(name, _p().grid_words(count), _p().kThreads, *args)


def _ptr(t: torch.Tensor | None, byte_offset: int = 0) -> np.uint64:
    # A kernel pointer argument: 8 bytes by value (null for an absent residual).
    return np.uint64(0 if t is None else t.data_ptr() + byte_offset)


def _p() -> SimpleNamespace:
    return launch_params()


def _layout(n: int, block: int) -> tuple[np.void, int, int]:
    """(Layout struct, nblocks, groups_per_block) of block_sums.cuh make_layout."""
    block = checks.effective_block(n, block)
    nblocks = checks.n_blocks(n, block)
    groups = _p().groups_per_block(block)
    struct: np.void = np.array([(n, block, nblocks, groups)], dtype=_LAYOUT)[0]
    return struct, nblocks, groups


class _BlockEncode:
    """One block codec's encode, launched as ``block_sums.cuh`` ``launch_block_encode`` does.

    The sequence sign and QSGD share: the launcher's scratch (``commpress_reduce_scratch_cuda``)
    and flag word, :meth:`reduce` (per-block sums into the scratch), :meth:`finalize` (one
    thread per block writes its scale), :meth:`encode` (whole warps per 32 elements write the
    packed output), then :meth:`raise_flags` reads the flag word like the binding does.
    """

    def __init__(self, unit: str, x: torch.Tensor, residual: torch.Tensor | None, block: int) -> None:
        self.x, self.residual = x, residual
        self.struct, self.nblocks, self.groups = _layout(x.numel(), block)
        self.scratch = torch.empty(
            _p().encode_scratch(self.nblocks, self.groups), dtype=torch.float64, device=x.device
        )
        self.flags = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.launch = _Launcher(unit, x.device)
        self.t, self.has_e = _CTYPE[x.dtype], _BOOLS[residual is not None]

    def reduce(self, kind: str, amax_off: int | None = None, base: int = 0) -> int:
        """block_sums.cuh launch_block_reduce; returns the double offset of the per-block values."""
        amax = self.scratch_ptr(amax_off) if amax_off is not None else np.uint64(0)
        nblocks, launch = self.nblocks, self.launch
        launch(
            f"{_NS}group_sums_kernel<{_NS}{kind}, {self.t}, {self.has_e}>",
            _p().grid_warps(nblocks * self.groups),
            _p().kThreads,
            _ptr(self.x),
            _ptr(self.residual),
            amax,
            self.struct,
            self.scratch_ptr(base),
            _ptr(self.flags),
        )
        level = _BOOLS[kind == "kMaxAbs"]
        src, per = base, self.groups
        while per > 1:
            per_out = _p().ceil_div(per, _p().kWarp)
            dst = src + nblocks * per
            launch(
                f"{_NS}tree_level_kernel<{level}>",
                _p().grid_warps(nblocks * per_out),
                _p().kThreads,
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
        return _ptr(self.scratch, 8 * offset)

    def finalize(self, kernel: str, *args: Any) -> None:
        """Launch ``kernel`` (in ``commpress::cuda``) over the blocks, one thread per block."""
        _per_item(self.launch, _NS + kernel, self.nblocks, *args)

    def encode(self, kernel: str, *args: Any) -> None:
        """Launch ``kernel`` (in ``commpress::cuda``) over the elements, one warp per 32."""
        _per_word(self.launch, _NS + kernel, self.x.numel(), *args)

    def raise_flags(self, op: str, scale: str, ct: torch.dtype) -> int:
        """Read the flag word; NaN/Inf and an overflowing ``scale`` raise. Returns the flags."""
        f = _read_flags(self.flags)
        if f & _p().kFlagNonFinite:
            raise checks.non_finite(op, self.residual is not None)
        if f & _p().kFlagOverflow:
            raise checks.overflow(op, scale, ct)
        return f


def _block_decode(
    unit: str, kernel: str, out: torch.Tensor, block: int, before: tuple[Any, ...], after: tuple[Any, ...] = ()
) -> None:
    """A block codec's decode, ``block_sums.cuh`` ``launch_block_decode``: one warp per 32 outputs.

    The kernel's arguments: ``before``, the layout, ``after``, then ``out``.
    """
    n = out.numel()
    if n == 0:
        return
    struct, _, _ = _layout(n, block)
    _per_word(_Launcher(unit, out.device), _NS + kernel, n, *before, struct, *after, _ptr(out))


def _read_flags(flags: torch.Tensor) -> int:
    return int(flags.item())  # synchronises the stream, like the binding's read_flags


def _check_finite(launch: _Launcher, x: torch.Tensor, flags: torch.Tensor) -> None:
    """Launch ``check_finite_kernel``: sets kFlagNonFinite when ``x`` holds NaN/Inf."""
    n = x.numel()
    _per_item(
        launch,
        f"{_NS}check_finite_kernel<{_CTYPE[x.dtype]}>",
        n,
        _ptr(x),
        np.int64(n),
        _ptr(flags),
    )


# ----- bit packing --------------------------------------------------------------------------------
@implements(schema.PackBits)
def pack_bits(a: schema.PackBits) -> torch.Tensor:
    """Pack ``bits``-wide fields LSB-first (specification: :mod:`commpress.bitpack`)."""
    fields, bits = a.fields, a.bits
    n = fields.numel()
    packed = torch.empty(checks.packed_nbytes(n, bits), dtype=torch.uint8, device=fields.device)
    if n == 0:
        return packed
    first_bad = torch.full((1,), -1, dtype=torch.int64, device=fields.device)  # UINT64_MAX
    nbytes = packed.numel()
    _per_item(
        _Launcher("bitpack", fields.device),
        f"commpress::pack_kernel<{bits}>",
        nbytes,
        _ptr(fields),
        np.int64(n),
        _ptr(packed),
        np.int64(nbytes),
        _ptr(first_bad),
    )
    bad = int(first_bad.item())
    if bad >= 0:
        raise checks.field_too_wide(fields, bad, bits)
    return packed


@implements(schema.UnpackBits)
def unpack_bits(a: schema.UnpackBits) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits."""
    fields = torch.empty(a.n, dtype=torch.uint8, device=a.packed.device)
    if a.n:
        _per_item(
            _Launcher("bitpack", a.packed.device),
            f"commpress::unpack_kernel<{a.bits}>",
            a.n,
            _ptr(a.packed),
            np.int64(a.n),
            _ptr(fields),
        )
    return fields


# ----- sign ---------------------------------------------------------------------------------------
@implements(schema.SignEncode)
def sign_encode(a: schema.SignEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, bits)`` of sign; with ``residual``, fused error feedback (updated in place)."""
    block = checks.effective_block(a.x.numel(), a.block_size)
    scales, bits = checks.sign_outputs(a.x, block)
    if a.x.numel() == 0:
        return scales, bits
    enc = _BlockEncode("sign", a.x, a.residual, block)
    sums = enc.reduce("kSumAbs")
    enc.finalize(
        f"sign_finalize_kernel<{enc.t}>",
        enc.scratch_ptr(sums),
        enc.struct,
        _ptr(scales),
        _ptr(enc.flags),
    )
    enc.encode(
        f"sign_encode_kernel<{enc.t}, {enc.has_e}>",
        _ptr(a.x),
        _ptr(a.residual),
        _ptr(scales),
        enc.struct,
        _ptr(bits),
        _ptr(enc.flags),
    )
    enc.raise_flags("sign_encode", "a block's mean magnitude", scales.dtype)
    return scales, bits


@implements(schema.SignDecode)
def sign_decode(a: schema.SignDecode) -> None:
    """``out (+)= +-scale`` per element."""
    kernel = f"sign_decode_kernel<{_CTYPE[a.out.dtype]}, {_BOOLS[bool(a.accumulate)]}>"
    _block_decode("sign", kernel, a.out, a.block_size, (_ptr(a.scales), _ptr(a.bits)))


# ----- qsgd ---------------------------------------------------------------------------------------
@implements(schema.QsgdEncode)
def qsgd_encode(a: schema.QsgdEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, packed levels)`` of QSGD; with ``residual``, fused error feedback."""
    x = a.x
    norms, packed = checks.qsgd_outputs(x, a.bits, a.bucket_size)
    if x.numel() == 0:
        return norms, packed
    enc = _BlockEncode("qsgd", x, a.residual, a.bucket_size)
    amax: int | None = None
    if x.dtype == torch.float64:
        # squares of float64 can overflow: divide by the bucket's max magnitude first
        amax = enc.reduce("kMaxAbs")
        sums = enc.reduce("kSumScaledSquare", amax, _p().second_reduction(enc.nblocks, enc.groups))
    else:
        sums = enc.reduce("kSumSquare")
    limit = float(torch.finfo(x.dtype).max)
    enc.finalize(
        f"qsgd_finalize_kernel<{enc.t}>",
        enc.scratch_ptr(sums),
        enc.scratch_ptr(amax) if amax is not None else np.uint64(0),
        enc.struct,
        np.float64(limit),
        _ptr(norms),
        _ptr(enc.flags),
    )
    enc.encode(
        f"qsgd_encode_kernel<{enc.t}, {enc.has_e}, {a.bits}>",
        _ptr(x),
        _ptr(a.residual),
        _ptr(norms),
        enc.struct,
        np.int32(a.levels),
        checks.rng_key(a.seed, rng.STREAM_QSGD),
        _ptr(packed),
        _ptr(enc.flags),
    )
    if enc.raise_flags("qsgd_encode", "a bucket norm", norms.dtype) & _p().kFlagTooBig:
        raise checks.norm_above_range("qsgd_encode", norms, limit, x.dtype)
    return norms, packed


@implements(schema.QsgdDecode)
def qsgd_decode(a: schema.QsgdDecode) -> None:
    """``out (+)= norm * ((field - s) / s)`` per element."""
    kernel = f"qsgd_decode_kernel<{_CTYPE[a.out.dtype]}, {a.bits}, {_BOOLS[bool(a.accumulate)]}>"
    before, after = (_ptr(a.norms), _ptr(a.packed)), (np.int32(a.levels),)
    _block_decode("qsgd", kernel, a.out, a.bucket_size, before, after)


# ----- top-k and sparse scatter-add ---------------------------------------------------------------
@implements(schema.TopkSelect)
def topk_select(a: schema.TopkSelect) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the k largest ``|x|``, exact, ties to the lower index, ascending."""
    op, x, k = "topk_select", a.x, a.k
    n = x.numel()
    index64 = index_dtype(n) == torch.int64
    indices = torch.empty(k, dtype=index_dtype(n), device=x.device)
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    if n == 0:
        return indices, values
    t = _CTYPE[x.dtype]
    flags = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch = _Launcher("topk", x.device)
    ns, lp = _NS, _p()
    if k == 0:  # nothing to select, but x must still be finite
        _check_finite(launch, x, flags)
    else:
        # scratch (launch_params.h): SelectState, hist[kBins], counts, off_gt, off_eq
        scratch = torch.zeros(lp.kTopkScratchWords, dtype=torch.int64, device=x.device)
        state = scratch[: lp.kSelectStateWords]
        state[lp.kSelectRemainingWord].fill_(k)  # SelectState{prefix 0, mask 0, remaining k, pad 0}
        hist = scratch[lp.kSelectStateWords : lp.kSelectStateWords + lp.kBins]
        counts_off = 8 * (lp.kSelectStateWords + lp.kBins)
        gt_off, eq_off = counts_off + 8 * lp.kCountBlocks, counts_off + 16 * lp.kCountBlocks
        # the top key bit is the sign, always 0 after fabs: digits cover bits [0, key_bits - 1)
        shift = (64 if x.dtype == torch.float64 else 32) - 1
        first = True
        while shift > 0:
            width = min(shift, _p().kDigitBits)
            shift -= width
            hist.zero_()
            launch(
                f"{ns}histogram_kernel<{t}>",
                lp.grid_histogram(n),
                _p().kThreads,
                _ptr(x),
                np.int64(n),
                _ptr(state),
                np.int32(shift),
                np.int32(width),
                _ptr(hist),
                _ptr(flags),
                np.bool_(first),
            )
            launch(
                f"{ns}select_digit_kernel",
                1,
                _p().kThreads,
                _ptr(hist),
                np.int32(shift),
                np.int32(width),
                _ptr(state),
            )
            first = False
        cblocks = lp.grid_count(n)
        launch(
            f"{ns}count_kernel<{t}>",
            cblocks,
            _p().kThreads,
            _ptr(x),
            np.int64(n),
            _ptr(state),
            _ptr(scratch, counts_off),
        )
        launch(
            f"{ns}scan_counts_kernel",
            1,
            _p().kCountBlocks,
            _ptr(scratch, counts_off),
            np.int32(cblocks),
            _ptr(scratch, gt_off),
            _ptr(scratch, eq_off),
        )
        launch(
            f"{ns}write_kernel<{t}, {'int64_t' if index64 else 'int32_t'}>",
            cblocks,
            _p().kThreads,
            _ptr(x),
            np.int64(n),
            _ptr(state),
            _ptr(scratch, gt_off),
            _ptr(scratch, eq_off),
            _ptr(indices),
            _ptr(values),
        )
    if _read_flags(flags) & lp.kFlagNonFinite:
        raise checks.non_finite(op, False)
    return indices, values


@implements(schema.SparseScatterAdd)
def sparse_scatter_add(a: schema.SparseScatterAdd) -> None:
    """``out[indices[p]] += values[p]`` payload by payload; every payload is validated first."""
    indices, values, out = a.indices, a.values, a.out
    if not indices:
        return
    n = out.numel()
    ns = _NS
    launch = _Launcher("topk", out.device)
    # All payloads are validated before any is added: the add kernels skip once first_bad is set.
    first_bad = torch.full((1,), -1, dtype=torch.int64, device=out.device)  # UINT64_MAX
    for p, idx in enumerate(indices):
        if idx.numel():
            _per_item(
                launch,
                f"{ns}scatter_validate_kernel<{'int64_t' if idx.dtype == torch.int64 else 'int32_t'}>",
                idx.numel(),
                _ptr(idx),
                np.int64(idx.numel()),
                np.int64(n),
                np.int64(p),
                _ptr(first_bad),
            )
    t = _CTYPE[out.dtype]
    for idx, val in zip(indices, values):
        if idx.numel():
            _per_item(
                launch,
                f"{ns}scatter_add_kernel<{'int64_t' if idx.dtype == torch.int64 else 'int32_t'}, {t}>",
                idx.numel(),
                _ptr(idx),
                _ptr(val),
                np.int64(idx.numel()),
                _ptr(out),
                _ptr(first_bad),
            )
    code = int(first_bad.item()) & rng.SEED_MASK
    if code != rng.SEED_MASK:
        p, j = code >> 40, (code >> 1) & ((1 << 39) - 1)
        # kind bit 0: out of range, 1: not increasing; the message follows from the values
        value = int(indices[p][j])
        previous = int(indices[p][j - 1]) if j else 0
        raise checks.bad_index(p, j, value, previous, n)


# ----- random-k -----------------------------------------------------------------------------------
@implements(schema.RandomkGather)
def randomk_gather(a: schema.RandomkGather) -> torch.Tensor:
    """The k values random-k sends (one per stratum, shared-seed positions)."""
    op, x, k = "randomk_gather", a.x, a.k
    n = x.numel()
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    if n == 0:
        return values
    t = _CTYPE[x.dtype]
    flags = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch = _Launcher("randomk", x.device)
    _check_finite(launch, x, flags)
    _per_item(
        launch,
        f"commpress::cuda::gather_kernel<{t}>",
        k,
        _ptr(x),
        np.int64(n),
        np.int64(k),
        checks.rng_key(a.seed, rng.STREAM_RANDOMK),
        np.bool_(a.scaled),
        _ptr(values),
        _ptr(flags),
    )
    f = _read_flags(flags)
    if f & _p().kFlagNonFinite:
        raise checks.non_finite(op, False)
    if f & _p().kFlagOverflow:
        raise checks.scaled_overflow(op, x.dtype)
    return values


@implements(schema.RandomkScatterAdd)
def randomk_scatter_add(a: schema.RandomkScatterAdd) -> None:
    """``out[idx] += values`` at the seed's random-k positions."""
    values, seed, out = a.values, a.seed, a.out
    k = values.numel()
    if k == 0:
        return
    _per_item(
        _Launcher("randomk", out.device),
        f"commpress::cuda::scatter_kernel<{_CTYPE[out.dtype]}>",
        k,
        _ptr(values),
        np.int64(k),
        np.int64(out.numel()),
        checks.rng_key(seed, rng.STREAM_RANDOMK),
        _ptr(out),
    )
