"""The package imports and reports its backends without the extension and without CUDA."""

import json
import os
import subprocess
import sys

import torch

import commpress


def run_py(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True).stdout


def test_info_reports_backends_and_codecs():
    report = commpress.info()
    assert report["backends"]["reference"] is True
    assert report["codecs"] == ["none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "int8", "int4"]
    assert set(report["native"]["ops"]) == set(commpress.kernels.ops._OPS) >= {"pack_bits", "unpack_bits", "sign_encode"}
    assert not torch.cuda.is_initialized()


def test_cli_info_json():
    out = subprocess.run([sys.executable, "-m", "commpress", "info", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert json.loads(out)["torch"] == torch.__version__


def test_cli_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "commpress", "frobnicate"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_pure_python_mode_works_end_to_end():
    out = run_py(
        "import torch, commpress\n"
        "from commpress import codecs, wire\n"
        "r = commpress.info()\n"
        "c = codecs.get('qsgd', bits=4)\n"
        "x = torch.randn(1000)\n"
        "y = c.decode(wire.from_bytes(wire.to_bytes(c.encode(x, seed=1))))\n"
        "print(r['native']['loaded'], r['native']['reason'], y.shape[0])\n",
        COMMPRESS_DISABLE_NATIVE="1",
    )
    assert out.split() == ["False", "disabled", "by", "COMMPRESS_DISABLE_NATIVE", "1000"]


def test_every_cpu_backend_gives_identical_bytes():
    code = (
        "import torch\nfrom commpress import codecs, wire\nfrom commpress.kernels import ops\n"
        "x = torch.randn(3001, generator=torch.Generator().manual_seed(0))\n"
        "print(ops.backend_for('qsgd_encode', 'cpu'))\n"
        "print(''.join(wire.to_bytes(codecs.from_spec(n).encode(x, seed=4)).numpy().tobytes().hex() for n in ('sign', 'qsgd', 'topk:ratio=0.01', 'randomk:ratio=0.01')))\n"
    )
    native = run_py(code).split()
    numba = run_py(code, COMMPRESS_DISABLE_NATIVE="1").split()
    reference = run_py(code, COMMPRESS_DISABLE_NATIVE="1", COMMPRESS_BACKEND="reference").split()
    assert [native[0], numba[0], reference[0]] == ["native", "numba", "reference"]
    assert native[1] == numba[1] == reference[1]
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COMMPRESS_BACKEND": "fortran"})
    assert bad.returncode != 0 and "COMMPRESS_BACKEND must be one of native, numba, cupy, reference" in bad.stderr


def test_import_does_not_initialise_cuda():
    assert run_py("import commpress, torch; commpress.info(); print(torch.cuda.is_initialized())").strip() == "False"
