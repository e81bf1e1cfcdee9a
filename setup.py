"""Build commpress: the pure-Python package, or the package with its native extension ``commpress._C``.

    pip install .                                   # pure Python: reference, numba and CuPy backends
    pip install --no-build-isolation .              # + C++ CPU kernels (+ CUDA kernels, see below)
    pip install --no-build-isolation --no-deps -e . # the same, editable (what scripts/env.sh runs)
    pip wheel --no-build-isolation --no-deps -w dist .   # a native wheel, tagged cp311-abi3

The extension is compiled against the torch importable while this file runs, and only loads
beside that exact torch. pyproject.toml therefore does not list torch as a build requirement: a
build that pip isolates sees no torch and gives the pure-Python package (py3-none-any), while
``--no-build-isolation`` builds against the torch you installed. ``COMMPRESS_PURE_PYTHON=1``
forces the pure-Python package; ``COMMPRESS_NATIVE=1`` makes a build that cannot compile the
extension (no torch) an error instead.

CUDA kernels are added when the torch is a CUDA build and a CUDA toolkit is found whose
``include/cuda_runtime.h`` exists and whose nvcc has torch's CUDA major version. Looked for in
order: ``$CUDA_HOME``, ``$CUDA_PATH``, the folder of ``nvcc`` on PATH (through symlinks, and as
nvcc itself reports it, so a wrapper script outside the toolkit is seen through),
``/usr/local/cuda``, ``/usr/local/cuda-*`` (newest first). The build says which one it chose.
The decision never looks at a GPU, so CUDA wheels build on GPU-less machines; pick the
architectures with ``TORCH_CUDA_ARCH_LIST`` (e.g. "9.0"), else torch chooses them.
``COMMPRESS_NO_CUDA=1`` builds the CPU kernels only. ``python setup.py --cuda-home`` prints the
toolkit that would be used (scripts/gpu_check.sh and scripts/cuda_build_check.sh ask it).

Build speed: ninja with ``MAX_JOBS`` parallel compiles (default: this machine's cores) and no
debug info (``-g0``: about 25% less compile time; ``COMMPRESS_DEBUG_INFO=1`` keeps ``-g``).
"""

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time

from setuptools import find_packages, setup

# Built against the Python limited API (csrc/registration.cpp has no pybind11), so one
# binary works on every CPython >= this version.
PY_LIMITED_API = "cp311"
ROOT = os.path.dirname(os.path.abspath(__file__))

# Optional features, `pip install .[name]`. requirements/dev.txt (CI's list) pins them all;
# tests/test_install.py checks that every package named here is in it.
EXTRAS = {
    "numba": ["numba>=0.60"],  # CPU kernels without the extension
    "cupy": ["cupy-cuda13x>=14.0", "nvidia-cuda-nvrtc>=13,<14"],  # CUDA kernels via NVRTC, CUDA 13 torch
    "mpi": ["mpi4py>=4.0", "openmpi>=5.0"],  # parameter-server mode (python -m commpress.ps)
    "demo": ["matplotlib>=3.8", "scikit-learn>=1.4"],  # commpress train's plot, the digits workload
    "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"],
    "build": ["setuptools>=69", "wheel", "ninja"],  # the native build (--no-build-isolation)
    "lightning": ["lightning>=2.6"],  # commpress.integrations.lightning
    "accelerate": ["accelerate>=1.15"],  # commpress.integrations.accelerate
    "tensorboard": ["tensorboard>=2.16"],  # state.log_to(SummaryWriter(...)) (commpress.statslog)
    "fuzz": ["atheris>=3.0"],  # scripts/fuzz_wire.py
}
EXTRAS["dev"] = sorted({r for reqs in EXTRAS.values() for r in reqs} | {"ruff>=0.6", "mypy>=1.10"})


def _say(message: str) -> None:
    # pip shows a build's output with -v only; scripts/env.sh passes -v and keeps these lines.
    print(f"[commpress setup] {message}", file=sys.stderr, flush=True)


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _read_requirements(name: str) -> list[str]:
    path = os.path.join(ROOT, "requirements", name)
    with open(path, encoding="utf-8") as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


# ----- the CUDA toolkit -----------------------------------------------------------------------
def _nvcc_version(nvcc: str) -> str | None:
    """"13.0" for the nvcc at ``nvcc``, None when it does not run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def _nvcc_reported_home(nvcc: str) -> str | None:
    """The toolkit folder nvcc itself names (``#$ TOP=`` of a dry run), behind any wrapper script."""
    try:
        proc = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", proc.stdout + proc.stderr, re.MULTILINE)
    return os.path.realpath(match.group(1).strip()) if match else None


def _toolkit_candidates() -> list[tuple[str, str]]:
    """(folder, why it is a candidate), in the order they are tried, without duplicates."""
    found: list[tuple[str, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            found.append((os.environ[var], f"${var}"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append((os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), f"nvcc on PATH ({nvcc})"))
        reported = _nvcc_reported_home(nvcc)
        if reported:
            found.append((reported, f"the folder nvcc on PATH reports ({nvcc})"))

    def version_key(path: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", os.path.basename(path))]

    found.append(("/usr/local/cuda", "/usr/local/cuda"))
    for path in sorted(glob.glob("/usr/local/cuda-*"), key=version_key, reverse=True):
        found.append((path, "/usr/local/cuda-*"))
    unique: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path, why in found:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            unique.append((path, why))
    return unique


def find_cuda_toolkit(torch_cuda: str | None) -> tuple[str | None, str]:
    """Return (toolkit folder, how it was chosen) or (None, why none would do).

    A toolkit qualifies when it has ``include/cuda_runtime.h`` and ``bin/nvcc``, and that nvcc's
    CUDA major version equals ``torch_cuda``'s (torch refuses to mix majors; None: any major).
    """
    rejected = []
    for path, why in _toolkit_candidates():
        nvcc = os.path.join(path, "bin", "nvcc")
        if not os.path.isfile(os.path.join(path, "include", "cuda_runtime.h")):
            rejected.append(f"{path} ({why}): no include/cuda_runtime.h")
            continue
        version = _nvcc_version(nvcc)
        if version is None:
            rejected.append(f"{path} ({why}): no working bin/nvcc")
            continue
        if torch_cuda and version.split(".")[0] != torch_cuda.split(".")[0]:
            rejected.append(f"{path} ({why}): nvcc is CUDA {version}, torch is built for CUDA {torch_cuda}")
            continue
        skipped = f"; skipped {'; '.join(rejected)}" if rejected else ""
        return path, f"{path} (found via {why}; nvcc CUDA {version}){skipped}"
    return None, "; ".join(rejected) or "no nvcc on PATH, no $CUDA_HOME, nothing in /usr/local/cuda*"


# ----- the extension ----------------------------------------------------------------------------
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "version unknown"


def native_extensions() -> tuple[list, dict]:
    """Return (ext_modules, cmdclass) for commpress._C, or nothing for a pure-Python package."""
    if _flag("COMMPRESS_PURE_PYTHON"):
        _say("COMMPRESS_PURE_PYTHON is set: building the pure-Python package (no commpress._C)")
        return [], {}
    try:
        import torch
    except ImportError:
        if _flag("COMMPRESS_NATIVE"):
            sys.exit("[commpress setup] COMMPRESS_NATIVE=1 but torch is not importable here: install "
                     "torch first and build with `pip install --no-build-isolation .`")
        _say("torch is not importable in this build environment (pip isolates builds): building the "
             "pure-Python package. For the native C++/CUDA kernels install torch, setuptools, wheel "
             "and ninja, then `pip install --no-build-isolation .`")
        return [], {}

    plan: list[str] = []  # what the build is about to do, said when it starts (below)
    torch_cuda = torch.version.cuda
    cuda_home = None
    if torch_cuda and _flag("COMMPRESS_NO_CUDA"):
        plan.append("COMMPRESS_NO_CUDA is set: CPU kernels only")
    elif torch_cuda:
        cuda_home, how = find_cuda_toolkit(torch_cuda)
        if cuda_home is None:
            if _flag("COMMPRESS_REQUIRE_CUDA"):
                sys.exit(f"[commpress setup] COMMPRESS_REQUIRE_CUDA=1 but no usable CUDA {torch_cuda.split('.')[0]}.x "
                         f"toolkit: {how}. Set CUDA_HOME to one.")
            _say(f"torch is a CUDA {torch_cuda} build but no usable toolkit was found ({how}): CPU "
                 "kernels only; CUDA tensors then run on the CuPy or reference backend. Set CUDA_HOME "
                 "to a toolkit with include/cuda_runtime.h and a matching nvcc for the CUDA kernels")
        else:
            plan.append(f"CUDA toolkit: {how}")
            # torch.utils.cpp_extension reads CUDA_HOME once, at import, with a cruder guess
            # (dirname(dirname(which nvcc)), wrong for a wrapper script outside the toolkit).
            os.environ["CUDA_HOME"] = cuda_home
            os.environ.setdefault("CUDA_PATH", cuda_home)
            if "torch.utils.cpp_extension" in sys.modules:
                sys.modules["torch.utils.cpp_extension"].CUDA_HOME = cuda_home  # type: ignore[attr-defined]

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpu_sources = ["csrc/registration.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    # -ffp-contract=off: never fuse a * b + c into an FMA (GCC does by default where the target
    # has FMA, e.g. in the AVX2/AVX-512 kernel variants): the kernels must round every product
    # like the pure-torch reference does, bit for bit.
    cxx_flags = ["-O3", "-ffp-contract=off"]
    if not _flag("COMMPRESS_DEBUG_INFO"):
        cxx_flags.append("-g0")  # overrides Python's CFLAGS -g; the shipped .so needs no DWARF
    link_flags = []
    # at::parallel_for is a header template that only runs threads when the code including
    # it is compiled with OpenMP; without -fopenmp it silently runs serially. The resulting
    # libgomp.so.1 dependency resolves to the copy libtorch already loaded (same soname).
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")

    extension = CppExtension
    cuda_sources: list[str] = []
    nvcc_flags: list[str] = []
    if cuda_home is not None:
        extension = CUDAExtension
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
        # --fmad=false: same reason as -ffp-contract=off above (the device cores also use
        # __fmul_rn where it matters, so a build without the flag stays exact).
        nvcc_flags = ["-O3", "-lineinfo", "--fmad=false"]

    # What the build is about to do, in a few lines (scripts/env.sh shows them), said when it
    # starts: pip runs this file once per build hook, and only the last one compiles.
    isa = ("default, avx2, avx512 (one is picked at run time by the CPU's features)"
           if platform.machine() in ("x86_64", "AMD64") else "default only (not x86-64)")
    plan.append(f"torch {torch.__version__} (CUDA build: {torch_cuda or 'no'}) from {os.path.dirname(torch.__file__)}")
    plan.append(f"C++ sources ({len(cpu_sources)}): {', '.join(s.removeprefix('csrc/') for s in cpu_sources)}")
    plan.append(f"CPU kernel variants: {isa}")
    cxx = os.environ.get("CXX", "c++")
    plan.append(f"C++ compiler: {cxx} ({_compiler_version(cxx)}), flags {' '.join(cxx_flags)}")
    if cuda_sources:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "torch's default list")
        plan.append(f"CUDA sources ({len(cuda_sources)}): {', '.join(s.removeprefix('csrc/') for s in cuda_sources)}; "
             f"nvcc {' '.join(nvcc_flags)}; TORCH_CUDA_ARCH_LIST={arch}")
    elif torch_cuda is None:
        plan.append("CUDA kernels: not built (torch is a CPU build)")
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    os.environ["MAX_JOBS"] = jobs
    scripts_dir = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(scripts_dir, "ninja")):
        # The venv's own ninja (pip's package), whether or not the venv is activated: torch runs
        # `ninja` from PATH, and two ninja versions alternating on one build/ folder (the
        # system's 1.11, pip's 1.13) discard each other's logs and recompile everything.
        os.environ["PATH"] = scripts_dir + os.pathsep + os.environ.get("PATH", "")
    have_ninja = shutil.which("ninja") is not None
    plan.append(f"compiling with {'ninja (' + str(shutil.which('ninja')) + '), ' + jobs + ' parallel jobs (MAX_JOBS)' if have_ninja else 'one file at a time: ninja is not installed (pip install ninja)'}")

    class TimedBuildExtension(BuildExtension):
        """torch's BuildExtension that keeps its objects in build/ and reports its time."""

        def finalize_options(self) -> None:
            super().finalize_options()
            # One object folder for every kind of build in this tree (editable, wheel,
            # build_ext): setuptools' editable install would compile into a new temporary
            # folder each time, so scripts/env.sh rebuilt everything on every run. ninja
            # recompiles what changed (sources, headers, flags, torch) and otherwise only links.
            self.build_temp = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

        def build_extensions(self) -> None:
            for line in plan:
                _say(line)
            start = time.monotonic()
            super().build_extensions()
            _say(f"built commpress._C in {time.monotonic() - start:.0f} s")

    ext = extension(
        "commpress._C",
        cpu_sources + cuda_sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
        py_limited_api=True,
    )
    return [ext], {"build_ext": TimedBuildExtension}


def _build_py_with_kernel_sources() -> type:
    """build_py that also copies the CUDA kernel sources into the package (``commpress/_csrc``).

    The CuPy backend compiles ``csrc/cuda`` with NVRTC at run time; a wheel or a non-editable
    install has no checkout beside it, so the sources travel inside the package.
    """
    import shutil

    from setuptools.command.build_py import build_py

    class BuildPyWithKernelSources(build_py):
        def run(self) -> None:
            super().run()
            for sub in ("cuda", "include"):
                target = os.path.join(self.build_lib, "commpress", "_csrc", sub)
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(os.path.join(ROOT, "csrc", sub), target,
                                ignore=shutil.ignore_patterns("*.cpp", "__pycache__"))

    return BuildPyWithKernelSources


def main() -> None:
    """``python setup.py --cuda-home`` prints the toolkit a build would use; else setuptools."""
    if sys.argv[1:] == ["--cuda-home"]:
        import torch

        home, how = find_cuda_toolkit(torch.version.cuda)
        print(home or "", flush=True)
        print(f"[commpress setup] CUDA toolkit: {how}", file=sys.stderr)
        sys.exit(0 if home else 1)

    ext_modules, cmdclass = native_extensions()
    cmdclass = {**cmdclass, "build_py": _build_py_with_kernel_sources()}
    setup(
        name="commpress",
        version="0.1.0",
        description="Gradient compression for PyTorch data-parallel training (DDP hooks, MPI PS)",
        long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
        long_description_content_type="text/markdown",
        python_requires=">=3.11",
        packages=find_packages(include=["commpress*"]),
        # torch is deliberately absent: a loose `torch` requirement lets pip replace the pinned
        # build with a multi-GB CUDA wheel, and the extension is ABI-tied to the exact torch it
        # was compiled against anyway. Install torch first (README, "Install").
        install_requires=_read_requirements("runtime.txt"),
        extras_require=EXTRAS,
        entry_points={"console_scripts": ["commpress=commpress.__main__:main"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}} if ext_modules else {},
    )


if __name__ == "__main__":
    main()
