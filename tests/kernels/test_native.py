"""The native extension commpress._C checked against the pure-torch reference (the spec).

Tests that call the kernels skip, with the reason, when the extension is not built; the nvcc
and header checks only need the compilers, and the pure-mode check needs neither.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commpress.errors import CodecError
from commpress.kernels import ops
from commpress.spec.bitpack import (
    SUPPORTED_BITS,
    pack_bits_reference,
    packed_nbytes,
    unpack_bits_reference,
)

import kernel_backends

ROOT = Path(__file__).resolve().parents[2]
NATIVE_REASON = ops.load_native()

# Lengths where packing goes wrong first: empty, partial first/last byte, byte boundaries
# for every width, and powers of two and their neighbours.
EDGE_LENGTHS = sorted(
    {0, 1, 7, 8, 9, 31, 33} | {2**k + d for k in range(1, 13) for d in (-1, 0, 1)}
)
# Big enough that every width spans several parallel_for tasks (32 KiB of packed bytes each).
LARGE_LENGTH = 2**20 + 3


BACKENDS = kernel_backends.params(all_isas=False, op="pack_bits")
TORCH_OP_BACKENDS = kernel_backends.params(all_isas=False, op="pack_bits", python=False)


def pack(backend, fields: torch.Tensor, bits: int) -> torch.Tensor:
    return backend.ops.pack_bits(fields, bits)


def unpack(backend, packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return backend.ops.unpack_bits(packed, bits, n)


def random_fields(n: int, bits: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=gen).to(device)


def random_bytes(n: int, seed: int, device: str) -> torch.Tensor:
    # Arbitrary bytes, including non-zero padding bits: unpack must ignore them like the spec.
    return random_fields(n, 8, seed, device)


def check_matches_reference(n: int, bits: int, seed: int, backend) -> None:
    case = f"n={n} bits={bits} seed={seed}"
    fields = random_fields(n, bits, seed, backend)
    packed = pack(backend, fields, bits)
    assert packed.device == fields.device, case
    assert packed.dtype == torch.uint8 and packed.shape == (packed_nbytes(n, bits),), case
    assert torch.equal(packed.cpu(), pack_bits_reference(fields.cpu(), bits)), case
    assert torch.equal(unpack(backend, packed, bits, n), fields), case

    noisy = random_bytes(packed_nbytes(n, bits), seed + 1, backend)
    expected = unpack_bits_reference(noisy.cpu(), bits, n)
    assert torch.equal(unpack(backend, noisy, bits, n).cpu(), expected), case


# ---------------------------------------------------------------------------------------------
# Bit-exactness against the reference


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_edge_lengths_match_reference(bits: int, backend) -> None:
    for n in EDGE_LENGTHS:
        check_matches_reference(n, bits, seed=n * 8 + bits, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_large_input_matches_reference(bits: int, backend) -> None:
    check_matches_reference(LARGE_LENGTH, bits, seed=bits, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, 5000)),
    bits=st.sampled_from(SUPPORTED_BITS),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_lengths_match_reference(backend, n: int, bits: int, seed: int) -> None:
    check_matches_reference(n, bits, seed, backend)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_views_with_storage_offset(bits: int, backend) -> None:
    # A contiguous slice starts mid-storage: kernels must honour the data pointer's offset.
    fields = random_fields(101, bits, seed=bits, device=backend)[3:]
    packed = pack(backend, fields, bits)
    assert torch.equal(packed.cpu(), pack_bits_reference(fields.cpu(), bits))
    wider = torch.cat([torch.zeros(5, dtype=torch.uint8, device=backend), packed])
    assert torch.equal(unpack(backend, wider[5:], bits, fields.numel()), fields)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_wrappers_use_the_backend_and_map_errors(backend) -> None:
    assert ops.backend_for("pack_bits", backend) == ("native" if backend.native else backend.name)
    fields = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8, device=backend)
    assert ops.pack_bits(fields, 1).tolist() == [0b10001101, 1]
    with pytest.raises(CodecError, match=r"fields\[1\] = 5"):
        ops.pack_bits(torch.tensor([0, 5], dtype=torch.uint8, device=backend), 2)


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck: schema, fake kernels (registered by ops.load_native), AOT dispatch


@pytest.mark.parametrize("backend", TORCH_OP_BACKENDS, indirect=True)
@pytest.mark.parametrize("n, bits", [(0, 1), (1, 2), (33, 1), (100, 2), (257, 4), (64, 8)])
def test_opcheck(n: int, bits: int, backend) -> None:
    fields = random_fields(n, bits, seed=n, device=backend)
    torch.library.opcheck(torch.ops.commpress.pack_bits.default, (fields, bits))
    packed = pack(backend, fields, bits)
    torch.library.opcheck(torch.ops.commpress.unpack_bits.default, (packed, bits, n))


# ---------------------------------------------------------------------------------------------
# Bad input raises KernelArgumentError (a RuntimeError) naming the argument, from the one check


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_bits(backend) -> None:
    fields = torch.zeros(4, dtype=torch.uint8, device=backend)
    with pytest.raises(RuntimeError, match=r"pack_bits: bits must be one of 1, 2, 4, 8, got 3"):
        pack(backend, fields, 3)
    with pytest.raises(RuntimeError, match=r"unpack_bits: bits must be one of 1, 2, 4, 8, got 3"):
        unpack(backend, fields, 3, 8)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_dtype(backend) -> None:
    with pytest.raises(RuntimeError, match=r"pack_bits: fields must have dtype uint8, got torch.float32"):
        pack(backend, torch.zeros(4, device=backend), 1)
    with pytest.raises(RuntimeError, match=r"unpack_bits: packed must have dtype uint8, got torch.float32"):
        unpack(backend, torch.zeros(1, device=backend), 1, 8)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_rank_and_layout(backend) -> None:
    grid = torch.zeros(2, 4, dtype=torch.uint8, device=backend)
    with pytest.raises(RuntimeError, match=r"pack_bits: fields must be 1-D, got shape \[2, 4\]"):
        pack(backend, grid, 1)
    with pytest.raises(RuntimeError, match=r"unpack_bits: packed must be 1-D"):
        unpack(backend, grid, 8, 8)
    with pytest.raises(RuntimeError, match=r"pack_bits: fields must be contiguous"):
        pack(backend, torch.zeros(16, dtype=torch.uint8, device=backend)[::2], 1)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_field_out_of_range_reports_first_offender(backend) -> None:
    fields = torch.tensor([3, 0, 1, 2, 5, 7, 1], dtype=torch.uint8, device=backend)
    with pytest.raises(RuntimeError, match=r"pack_bits: fields\[4\] = 5 does not fit in bits=2"):
        pack(backend, fields, 2)
    big = torch.zeros(LARGE_LENGTH, dtype=torch.uint8, device=backend)
    big[LARGE_LENGTH - 1] = 2  # in the partial last byte
    big[300_000] = 9  # deep inside a parallel task; reported first
    with pytest.raises(RuntimeError, match=r"fields\[300000\] = 9 does not fit in bits=1"):
        pack(backend, big, 1)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bad_packed_length_and_n(backend) -> None:
    packed = torch.zeros(3, dtype=torch.uint8, device=backend)
    with pytest.raises(
        RuntimeError, match=r"unpack_bits: packed holds 3 bytes, but n=13 fields of bits=2 need 4"
    ):
        unpack(backend, packed, 2, 13)
    with pytest.raises(RuntimeError, match=r"unpack_bits: n must be >= 0, got -1"):
        unpack(backend, packed, 2, -1)


# ---------------------------------------------------------------------------------------------
# Sources that must compile without torch: the CUDA kernels with plain nvcc, the shared
# header as plain C++


def _find_nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None
    )


@pytest.mark.parametrize(
    "source", sorted((ROOT / "csrc" / "cuda").glob("*.cu")), ids=lambda p: p.name
)
def test_cuda_sources_compile_with_plain_nvcc(source: Path, tmp_path: Path) -> None:
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or in /usr/local/cuda/bin")
    cmd = [
        nvcc, "-c", "-std=c++17", "-Werror", "all-warnings",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-I", str(ROOT / "csrc" / "include"),
        str(source), "-o", str(tmp_path / f"{source.stem}.o"),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr


def _cxx() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def test_shared_header_is_plain_cpp(tmp_path: Path) -> None:
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    probe = tmp_path / "probe.cpp"
    headers = sorted(p.name for p in (ROOT / "csrc" / "include" / "commpress").glob("*.h"))
    probe.write_text(
        "".join(f'#include "commpress/{h}"\n' for h in headers)
        + "int main() {\n"
        "  const uint8_t fields[3] = {1, 0, 1};\n"
        "  uint8_t seen = 0;\n"
        "  return commpress::pack_fields<1>(fields, 3, seen) == 5 ? 0 : 1;\n"
        "}\n"
    )
    exe = tmp_path / "probe"
    cmd = [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "csrc" / "include"),
           str(probe), "-o", str(exe)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert subprocess.run([str(exe)]).returncode == 0


def test_shared_cores_match_torch(tmp_path: Path) -> None:
    """The host/device cores (half/bf16 conversions, RNG) against torch and commpress.rng."""
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    import numpy as np

    from commpress import rng

    probe = tmp_path / "cores.cpp"
    probe.write_text(
        '#include <cstdio>\n#include "commpress/hd.h"\n#include "commpress/rng.h"\n'
        "using namespace commpress;\n"
        "int main(int argc, char** argv) {\n"
        "  FILE* in = std::fopen(argv[1], \"rb\"); FILE* out = std::fopen(argv[2], \"wb\");\n"
        "  for (uint32_t h = 0; h < 65536; ++h) {\n"
        "    const float f = half_to_float(static_cast<uint16_t>(h)); std::fwrite(&f, 4, 1, out);\n"
        "    const float g = bf16_to_float(static_cast<uint16_t>(h)); std::fwrite(&g, 4, 1, out); }\n"
        "  float v;\n"
        "  while (std::fread(&v, 4, 1, in) == 1) {\n"
        "    const uint16_t a = float_to_half(v), b = float_to_bf16(v);\n"
        "    std::fwrite(&a, 2, 1, out); std::fwrite(&b, 2, 1, out); }\n"
        "  const uint64_t key = rng_key(12345, kStreamQSGD);\n"
        "  for (uint64_t i = 0; i < 1000; ++i) { const float u = rng_uniform(key, i); std::fwrite(&u, 4, 1, out); }\n"
        "  const uint64_t k2 = rng_key(~0ull, kStreamRandomK);\n"
        "  for (uint64_t i = 0; i < 1000; ++i) { const uint64_t b = rng_below(k2, i, 1 + i * 7919); std::fwrite(&b, 8, 1, out); }\n"
        "  return 0;\n}\n"
    )
    exe = tmp_path / "cores"
    cmd = [cxx, "-std=c++17", "-O2", "-I", str(ROOT / "csrc" / "include"), str(probe), "-o", str(exe)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # every float32 bit pattern with a stride, plus the rounding edge cases of both formats
    g = torch.Generator().manual_seed(0)
    patterns = torch.arange(0, 2**32, 4099, dtype=torch.int64)
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-24, 2.0**-25,
                             2.0**-25 * 1.0000001, 3 * 2.0**-26, 2.0**-14, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
                             3.3895314e38, 3.4e38, float("inf"), -float("inf")])
    floats = torch.cat([(patterns - 2**31).to(torch.int32).view(torch.float32), specials,
                        torch.randn(100_000, generator=g) * 1e-5, torch.randn(100_000, generator=g) * 3e4])
    floats = floats[~torch.isnan(floats)]
    (tmp_path / "in.bin").write_bytes(floats.numpy().tobytes())
    run = subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], timeout=120)
    assert run.returncode == 0
    raw = np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint8)
    widened = torch.from_numpy(raw[: 65536 * 8].copy().view(np.float32).reshape(65536, 2))
    all16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for column, fmt in ((0, torch.float16), (1, torch.bfloat16)):
        want = all16.view(fmt).float()
        keep = ~torch.isnan(want)  # NaN payloads are not part of the contract
        assert torch.equal(widened[keep, column].view(torch.int32), want[keep].view(torch.int32)), fmt
    nf = floats.numel()
    narrowed = torch.from_numpy(raw[65536 * 8 : 65536 * 8 + nf * 4].copy().view(np.int16).reshape(nf, 2))
    assert torch.equal(narrowed[:, 0], floats.to(torch.float16).view(torch.int16))
    assert torch.equal(narrowed[:, 1], floats.to(torch.bfloat16).view(torch.int16))
    tail = raw[65536 * 8 + nf * 4 :]
    uniforms = torch.from_numpy(tail[:4000].copy().view(np.float32))
    assert torch.equal(uniforms, rng.uniform_f32(12345, rng.STREAM_QSGD, 1000))
    below = torch.from_numpy(tail[4000:].copy().view(np.uint64).astype(np.int64))
    bounds = 1 + torch.arange(1000, dtype=torch.int64) * 7919
    assert torch.equal(below, rng.below(2**64 - 1, rng.STREAM_RANDOMK, bounds))


def test_cuda_bindings_compile_against_torch_headers(tmp_path: Path) -> None:
    """bindings.cpp (torch + CUDA runtime headers) compiles, even with a CPU-only torch.

    A CPU wheel ships c10/cuda headers but not the one CMake generates
    (c10/cuda/impl/cuda_cmake_macros.h); a stub stands in for it, for this syntax check only.
    """
    cxx = _cxx()
    nvcc = _find_nvcc()
    if cxx is None or nvcc is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit (nvcc)")
    from torch.utils.cpp_extension import include_paths

    cuda_include = Path(nvcc).resolve().parent.parent / "include"
    if not (cuda_include / "cuda_runtime.h").exists():
        cuda_include = Path("/usr/local/cuda/include")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Werror=return-type",
           *(f"-I{p}" for p in include_paths()), f"-I{tmp_path}", f"-I{cuda_include}",
           f"-I{ROOT / 'csrc' / 'include'}", str(ROOT / "csrc" / "cuda" / "bindings.cpp")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]


# ---------------------------------------------------------------------------------------------
# Without the extension the package still works, through numba (or the reference)


def test_disabled_native_falls_back_to_numba() -> None:
    code = (
        "import torch, commpress.kernels.ops as o\n"
        "x = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8)\n"
        "p = o.pack_bits(x, 1)\n"
        "assert torch.equal(o.unpack_bits(p, 1, 9), x)\n"
        "print(o.load_native()); print(o.has_native('pack_bits', 'cpu')); print(p.tolist())\n"
        "print(o.backend_for('pack_bits', 'cpu'))\n"
    )
    env = {**os.environ, "COMMPRESS_DISABLE_NATIVE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    reason, native, packed, backend = result.stdout.splitlines()
    assert "disabled" in reason
    assert native == "False"
    assert packed == "[141, 1]"
    assert backend == "numba"
