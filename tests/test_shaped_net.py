"""The shaped multi-host harness: links really are rate-limited, counters count, nothing leaks."""

import os
import subprocess
import sys
import time

import pytest

from commpress.demo import shaped_net

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")

needs_root = pytest.mark.skipif(not shaped_net.can_shape()[0], reason=f"cannot shape: {shaped_net.can_shape()[1]}")

SINK = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('{addr}', 29124)); s.listen(1); c, _ = s.accept(); n = 0\n"
    "while True:\n    b = c.recv(1 << 20)\n    if not b: break\n    n += len(b)\n"
    "print(n)\n"
)


def namespaces():
    """This process's namespaces (other runs on the machine may have their own)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{shaped_net.PREFIX}-{os.getpid()}-")]


@needs_root
def test_link_is_shaped_and_counted_and_torn_down():
    payload = 4 << 20  # 4 MiB at 50 Mbit/s: >= 0.67 s on a shaped link (loopback: ~ms)
    with shaped_net.ShapedNetwork(2, "50mbit") as net:
        assert len(namespaces()) == 3
        sink = subprocess.Popen(net.command(0, [sys.executable, "-c", SINK.format(addr=net.addr(0))]),
                                stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        t0 = time.perf_counter()
        subprocess.run(net.command(1, [sys.executable, "-c",
                                       f"import socket; s = socket.create_connection(('{net.addr(0)}', 29124)); "
                                       f"s.sendall(bytes({payload})); s.close()"]), check=True, timeout=60)
        assert int(sink.communicate(timeout=60)[0]) == payload
        elapsed = time.perf_counter() - t0
        tx, _ = net.tx_rx_bytes(1)
        _, rx = net.tx_rx_bytes(0)
    assert elapsed >= 0.8 * payload * 8 / 50e6
    assert payload <= tx <= 1.1 * payload and payload <= rx <= 1.1 * payload  # TCP/IP headers ~3%
    assert namespaces() == []


@needs_root
def test_torn_down_on_exception():
    with pytest.raises(RuntimeError):
        with shaped_net.ShapedNetwork(2, "1gbit"):
            raise RuntimeError("boom")
    assert namespaces() == []


@needs_root
def test_stale_namespaces_of_dead_processes_are_removed_others_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    subprocess.run(["ip", "netns", "add", f"{shaped_net.PREFIX}-{dead}-h0"], check=True)
    with shaped_net.ShapedNetwork(1, None) as net:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{shaped_net.PREFIX}-{dead}-h0" not in out and net.ns(0) in out


def test_loopback_fallback(monkeypatch, capsys):
    monkeypatch.setattr(shaped_net, "can_shape", lambda: (False, "not root"))
    with shaped_net.ShapedNetwork(3, "1gbit") as net:
        assert net.addr(2) == "127.0.0.1" and net.ifname == "lo"
        assert net.command(1, ["true"]) == ["true"] and net.tx_rx_bytes(0) == (0, 0)
    assert "not root" in capsys.readouterr().err


def test_loopback_on_request_even_as_root(capsys):
    with shaped_net.ShapedNetwork(2, "1gbit", loopback=True) as net:
        assert not net.shaped and net.addr(1) == "127.0.0.1" and net.command(0, ["true"]) == ["true"]
    assert "loopback requested" in capsys.readouterr().err


def test_scripts_shim_is_the_package_module():
    """scripts/shaped_net.py (the benchmarks' import) is the package module, not a copy."""
    sys.path.insert(0, SCRIPTS)
    try:
        sys.modules.pop("shaped_net", None)
        import shaped_net as shim
    finally:
        sys.path.remove(SCRIPTS)
        sys.modules.pop("shaped_net", None)
    assert shim is shaped_net and shim.ShapedNetwork is shaped_net.ShapedNetwork
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "shaped_net.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "--self-test" in proc.stdout
