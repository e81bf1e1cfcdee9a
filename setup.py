"""Build commpress and its optional native extension ``commpress._C``.

    pip install --no-build-isolation -e .           # C++ CPU kernels (+ CUDA, see below)
    COMMPRESS_PURE_PYTHON=1 pip install -e .        # no extension: reference kernels only

CUDA kernels are added when the installed torch is a CUDA build and a CUDA toolkit is found
(``torch.utils.cpp_extension.CUDA_HOME``). The decision looks at the toolkit, never at a
visible GPU, so wheels build on GPU-less CI machines; pick the architectures with
``TORCH_CUDA_ARCH_LIST`` (e.g. "8.0;9.0"), otherwise torch chooses them.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

# Built against the Python limited API (csrc/registration.cpp has no pybind11), so one
# binary works on every CPython >= this version.
PY_LIMITED_API = "cp311"


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def native_extensions() -> tuple[list, dict]:
    """Return (ext_modules, cmdclass) for commpress._C, or nothing for a pure-Python install."""
    if _flag("COMMPRESS_PURE_PYTHON"):
        return [], {}

    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = ["csrc/registration.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    # -ffp-contract=off: never fuse a * b + c into an FMA (GCC does by default where the target
    # has FMA, e.g. in the AVX2/AVX-512 kernel variants): the kernels must round every product
    # like the pure-torch reference does, bit for bit.
    cxx_flags = ["-O3", "-ffp-contract=off"]
    link_flags = []
    # at::parallel_for is a header template that only runs threads when the code including
    # it is compiled with OpenMP; without -fopenmp it silently runs serially. The resulting
    # libgomp.so.1 dependency resolves to the copy libtorch already loaded (same soname).
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")

    extension = CppExtension
    nvcc_flags = []
    if torch.version.cuda and CUDA_HOME is not None:
        extension = CUDAExtension
        sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
        # --fmad=false: same reason as -ffp-contract=off above (the device cores also use
        # __fmul_rn where it matters, so a build without the flag stays exact).
        nvcc_flags = ["-O3", "-lineinfo", "--fmad=false"]

    ext = extension(
        "commpress._C",
        sources,
        include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "include")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = native_extensions()

setup(
    name="commpress",
    version="0.1.0",
    description="Gradient compression for PyTorch data-parallel training (DDP hooks, MPI PS)",
    python_requires=">=3.11",
    packages=find_packages(include=["commpress*"]),
    # torch is deliberately absent: a loose `torch` requirement lets pip replace the pinned
    # build with a multi-GB CUDA wheel, and the extension is ABI-tied to the exact torch it
    # was compiled against anyway. Install it from requirements/dev.txt (pinned) first.
    install_requires=["numpy>=1.26", "tqdm>=4.66"],
    entry_points={"console_scripts": ["commpress=commpress.__main__:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}} if ext_modules else {},
)
