"""The shaped multi-host harness: links really are rate-limited, counters count, nothing leaks."""

import json
import os
import subprocess
import sys
import time

import pytest

from commpress.comm import topology
from commpress.demo import shaped_net

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(ROOT, "scripts")

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


@needs_root
def test_cluster_ranks_of_a_node_talk_over_loopback_and_cross_node_bytes_are_counted(tmp_path):
    """2 nodes x 2 ranks: an all-reduce inside a node leaves the shaped veth alone, one across nodes crosses it."""
    with shaped_net.ShapedNetwork(2, "1gbit", ranks_per_node=2) as net:
        assert len(namespaces()) == 3 and net.world_size == 4
        before = [net.tx_rx_bytes(h) for h in range(2)]
        codes = net.run(lambda r: [sys.executable, os.path.join(HERE, "cluster_workers.py"), str(tmp_path)], timeout=120,
                        env={"MASTER_PORT": "29533", "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "OMP_NUM_THREADS": "1"})
        after = [net.tx_rx_bytes(h) for h in range(2)]
    assert namespaces() == []
    assert codes == [0, 0, 0, 0]
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for r, rep in enumerate(reports):  # started where torchrun would put it, and commpress sees the layout
        assert (rep["node"], rep["local_rank"], rep["master"]) == (r // 2, r % 2, shaped_net.SUBNET + ".1")
        assert rep["topology"] == {"nodes": 2, "local_world_size": 2, "source": "torchrun"}
    for rep in reports[::2]:  # local rank 0 reads its node's counters
        intra, inter, payload = rep["phases"]["intra"], rep["phases"]["inter"], rep["payload"]
        assert intra["lo"] >= payload and intra["eth0"] < 0.02 * payload, intra  # store and barriers only
        assert inter["eth0"] >= payload and inter["lo"] < 0.02 * payload, inter
    for (tx0, rx0), (tx1, rx1) in zip(before, after):  # the whole run, seen from outside the nodes
        assert 2 * reports[0]["payload"] <= tx1 - tx0 < 2.5 * reports[0]["payload"]
        assert 2 * reports[0]["payload"] <= rx1 - rx0 < 2.5 * reports[0]["payload"]


def test_cluster_env_describes_the_layout_as_torchrun_would(monkeypatch):
    monkeypatch.setattr(shaped_net, "can_shape", lambda: (False, "not root"))
    with shaped_net.ShapedNetwork(2, "1gbit", quiet=True, ranks_per_node=2) as net:
        envs = [net.rank_env(r) for r in range(net.world_size)]
        assert [net.node_of(r) for r in range(4)] == [0, 0, 1, 1]
        with pytest.raises(ValueError):
            net.node_of(4)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert all(e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2" and e["MASTER_ADDR"] == net.addr(0)
               for e in envs)
    topo = topology.decide([topology.read_environment(e) for e in envs])
    assert (topo.nodes, topo.local_world_size, topo.source) == (2, 2, "torchrun")


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
