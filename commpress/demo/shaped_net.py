"""Emulate several hosts on shaped network links on one machine (Linux network namespaces).

Topology: one "switch" namespace holding a bridge, and N host namespaces, each joined to the
bridge by a veth pair whose both ends are rate-limited with ``tc ... tbf`` (so a host's link
is shaped in both directions, like a NIC on a switch port), optionally with a netem delay.
Hosts get addresses 198.18.0.1, 198.18.0.2, ... (198.18.0.0/15 is reserved for benchmarks,
RFC 2544) on an interface named ``eth0``. Everything is torn down on exit, on an exception,
and on SIGINT/SIGTERM. Names carry the creating process id, so concurrent runs (a benchmark
next to the test suite) never touch each other; namespaces whose creator has died are removed
before a new network is built.

**An emulated cluster.** ``ShapedNetwork(nodes, rate, ranks_per_node=L)`` makes each host a
node of ``L`` ranks: :meth:`ShapedNetwork.run` starts rank ``r`` in host ``r // L`` with torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ...,
``MASTER_ADDR`` = host 0's address; :meth:`~ShapedNetwork.rank_env`), so
:mod:`commpress.comm.topology` sees ``nodes x L``. gloo binds every rank to its host's ``eth0``
address (``GLOO_SOCKET_IFNAME``); a peer on the same host has a local address, which the
kernel routes through that namespace's ``lo``: the ranks of a node talk over loopback (fast,
unshaped) and only cross-node traffic passes the shaped veth, whose counters
(:meth:`~ShapedNetwork.tx_rx_bytes`) therefore measure the inter-node bytes. Measured on 2
nodes x 2 (tests/cluster_workers.py): two 4 MB all-reduces between the ranks of each node moved
1.4 KB on a node's veth (barriers) and 16.8 MB on its ``lo``; the same between the nodes, 16.8 MB
on the veth. Without ``GLOO_SOCKET_IFNAME`` gloo binds to the hostname's address (127.0.0.1
here) and the ranks of different nodes cannot reach each other.

Without root (or without ``ip``), or when asked (``loopback=True``), :class:`ShapedNetwork`
says so and falls back to loopback: every host is 127.0.0.1 and nothing is shaped.

It lives in the package so that ``commpress train`` (:mod:`.train`) can use it from an
installed copy; ``scripts/shaped_net.py`` is the same module under its old name (the
benchmarks import it from there). Command line (one command per rank, ``{rank}``, ``{node}``,
``{local_rank}`` and ``{addr}`` (the rank's host address) substituted)::

    python -m commpress.demo.shaped_net --hosts 2 --rate 1gbit -- python train.py --rank {rank}
    python -m commpress.demo.shaped_net --hosts 2 --ranks-per-node 2 -- python train.py --rank {rank}
    python -m commpress.demo.shaped_net --self-test          # measures the shaped throughput
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

SUBNET = "198.18.0"
PREFIX = "cpn"  # namespace / interface prefix; short: interface names max 15 chars


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def can_shape() -> tuple[bool, str]:
    """Return (True, "") when namespaces can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) not installed"
    return True, ""


class ShapedNetwork:
    """Context manager: N hosts on links of ``rate`` (tc syntax, e.g. "1gbit"), or loopback.

    ``ranks_per_node``: ranks :meth:`run` starts on each host (a node); rank ``r`` is on host ``r // L``.
    """

    def __init__(self, hosts: int, rate: str | None = "1gbit", delay_ms: float = 0.0, quiet: bool = False,
                 loopback: bool = False, ranks_per_node: int = 1) -> None:
        if hosts < 1 or ranks_per_node < 1:
            raise ValueError(f"hosts and ranks_per_node must be >= 1, got {hosts} and {ranks_per_node}")
        self.hosts = hosts
        self.ranks_per_node = ranks_per_node
        self.rate = rate
        self.delay_ms = delay_ms
        self.shaped, self.why_not = (False, "loopback requested") if loopback else can_shape()
        self.quiet = quiet
        self.tag = str(os.getpid())
        self._made: list[str] = []
        self._old_handlers: dict[int, object] = {}

    # --- naming ---------------------------------------------------------------------------
    def ns(self, rank: int) -> str:
        """Namespace of host ``rank``."""
        return f"{PREFIX}-{self.tag}-h{rank}"

    @property
    def switch(self) -> str:
        """Namespace holding the bridge."""
        return f"{PREFIX}-{self.tag}-sw"

    def addr(self, rank: int) -> str:
        """IPv4 address of host ``rank`` (127.0.0.1 on the loopback fallback)."""
        return f"{SUBNET}.{rank + 1}" if self.shaped else "127.0.0.1"

    @property
    def ifname(self) -> str:
        """Interface name to give gloo (GLOO_SOCKET_IFNAME)."""
        return "eth0" if self.shaped else "lo"

    @property
    def world_size(self) -> int:
        """Ranks :meth:`run` starts: ``hosts x ranks_per_node``."""
        return self.hosts * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The host (node) of rank ``rank``: ranks of a node are contiguous, as torchrun numbers them."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return rank // self.ranks_per_node

    def rank_env(self, rank: int) -> dict[str, str]:
        """The variables torchrun would give rank ``rank`` of this cluster, gloo's interface and ``MASTER_ADDR``."""
        L, node = self.ranks_per_node, self.node_of(rank)
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank % L),
                "LOCAL_WORLD_SIZE": str(L), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(self.hosts),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.addr(0),
                "GLOO_SOCKET_IFNAME": self.ifname}

    # --- set-up / tear-down ---------------------------------------------------------------
    def __enter__(self) -> ShapedNetwork:
        if not self.shaped:
            if not self.quiet:
                print(f"[shaped_net] {self.why_not}: falling back to loopback, links are NOT shaped", file=sys.stderr)
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        cleanup_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.close()
        raise KeyboardInterrupt(f"signal {signum}")

    def _tbf(self, ns: str, dev: str) -> None:
        # burst must hold at least one timer tick of traffic at the rate; 1 MB suits 1-10 Gbit/s
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
              "tbf", "rate", str(self.rate), "burst", "1mb", "latency", "50ms"])
        if self.delay_ms:
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1",
                  "handle", "10:", "netem", "delay", f"{self.delay_ms}ms"])

    def _build(self) -> None:
        _run(["ip", "netns", "add", self.switch])
        self._made.append(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for rank in range(self.hosts):
            ns, port = self.ns(rank), f"p{rank}"
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            a, b = f"cv{self.tag}{rank}a", f"cv{self.tag}{rank}b"  # <= 15 chars, renamed below
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            _run(["ip", "link", "set", a, "netns", ns, "name", "eth0"])
            _run(["ip", "link", "set", b, "netns", self.switch, "name", port])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(rank)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.rate:
                self._tbf(ns, "eth0")  # host -> switch
                self._tbf(self.switch, port)  # switch -> host

    def close(self) -> None:
        """Delete every namespace this object made (their veths go with them). Idempotent."""
        while self._made:
            _run(["ip", "netns", "del", self._made.pop()], check=False)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    # --- use ------------------------------------------------------------------------------
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``host`` (unchanged on the loopback fallback)."""
        return ["ip", "netns", "exec", self.ns(host), *argv] if self.shaped else list(argv)

    def run(self, argv: Callable[[int], Sequence[str]], timeout: float | None = None,
            env: Mapping[str, str] | None = None) -> list[int]:
        """Run ``argv(rank)`` for every rank at once, each on its node with :meth:`rank_env`; their exit codes.

        ``env`` adds to the environment. Processes still running when ``timeout`` seconds have
        passed (``subprocess.TimeoutExpired`` is raised) or when waiting is interrupted are killed.
        """
        procs = [subprocess.Popen(self.command(self.node_of(r), argv(r)), env={**os.environ, **self.rank_env(r), **(env or {})})
                 for r in range(self.world_size)]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return [p.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
                    for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    def tx_rx_bytes(self, host: int) -> tuple[int, int]:
        """Bytes host ``host`` has sent and received on its link, all of its ranks together (0, 0 on the fallback).

        Traffic between ranks of one host stays on its loopback: these are the node's inter-node bytes.
        """
        if not self.shaped:
            return 0, 0
        out = _run(["ip", "netns", "exec", self.ns(host), "cat",
                    "/sys/class/net/eth0/statistics/tx_bytes", "/sys/class/net/eth0/statistics/rx_bytes"]).stdout
        tx, rx = (int(v) for v in out.split())
        return tx, rx


def cleanup_stale() -> None:
    """Remove namespaces left by runs whose process died before it could clean up."""
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit() and not _alive(int(parts[1])):
            _run(["ip", "netns", "del", name], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _self_test(rate: str, megabytes: int) -> int:
    """Send ``megabytes`` from host 1 to host 0 and print the achieved rate and link counters."""
    with ShapedNetwork(2, rate) as net:
        server = subprocess.Popen(net.command(0, [sys.executable, "-c", (
            "import socket,sys\n"
            "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{net.addr(0)}', 29123)); s.listen(1); c,_=s.accept(); n=0\n"
            "while True:\n    b=c.recv(1<<20)\n    if not b: break\n    n+=len(b)\n"
            "print(n)\n")]), stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        t0 = time.perf_counter()
        subprocess.run(net.command(1, [sys.executable, "-c", (
            f"import socket; s=socket.create_connection(('{net.addr(0)}', 29123)); "
            f"s.sendall(bytes({megabytes} << 20)); s.close()")]), check=True)
        received = int(server.communicate(timeout=120)[0])
        elapsed = time.perf_counter() - t0
        tx, _ = net.tx_rx_bytes(1)
        print(f"sent {received / 1e6:.1f} MB in {elapsed:.2f} s = {received * 8 / elapsed / 1e6:.0f} Mbit/s "
              f"(link {rate}, shaped={net.shaped}); host1 eth0 tx_bytes={tx / 1e6:.1f} MB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description="Run one command per emulated host on shaped links.")
    ap.add_argument("--hosts", type=int, default=2, help="number of hosts (nodes; default 2)")
    ap.add_argument("--ranks-per-node", type=int, default=1, help="ranks started on each host (default 1)")
    ap.add_argument("--rate", default="1gbit", help="link rate in tc syntax (e.g. 1gbit, 10gbit); 'none' for unshaped")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link end (netem)")
    ap.add_argument("--self-test", action="store_true", help="measure the shaped throughput between two hosts")
    ap.add_argument("--megabytes", type=int, default=50, help="payload of --self-test")
    ap.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="-- command; {rank}, {node}, {local_rank} and {addr} (the rank's host) are substituted")
    args = ap.parse_args(argv)
    rate = None if args.rate == "none" else args.rate
    if args.self_test:
        return _self_test(rate or "10gbit", args.megabytes)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give a command after --")
    with ShapedNetwork(args.hosts, rate, args.delay_ms, ranks_per_node=args.ranks_per_node) as net:
        L = net.ranks_per_node
        codes = net.run(lambda r: [a.format(rank=r, node=r // L, local_rank=r % L, addr=net.addr(r // L)) for a in cmd])
        for h in range(args.hosts):
            tx, rx = net.tx_rx_bytes(h)
            print(f"[shaped_net] host {h} ({net.addr(h)}): exit {codes[h * L:(h + 1) * L]}, tx {tx:,} B, rx {rx:,} B",
                  file=sys.stderr)
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
