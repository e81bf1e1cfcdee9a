"""Coverage-guided fuzzing of what the parameter server runs on received bytes (#12).

The target runs the receive path of :func:`commpress.ps.mpi_loop.serve` without MPI: the
transport's size limit (:meth:`ShardServer.max_message`, enforced by ``Inbox.receive``), then
:meth:`ShardServer.handle` (``parse_header``, the state checks, ``parse_segments`` of the
push's ``FrameLayout`` payload, ``decode_segments``, the optimizer step and the reply), and
the worker's side of it, :meth:`WorkerNode.apply` (its :class:`ShardChannel`) on a reply. Each input builds a
fresh server of one of several setups (codec x mode x dtype x worker count x CRC policy), lets
some workers join with valid PULLs, then delivers:

* raw mode (first byte 0 mod 4: to the server, 1: to a worker): the rest of the input as one
  message (bytes 1..3 choose the setup, shard, joined workers, sender and step);
* structured mode (2, 3): a sequence of valid PULL/PUSH/BYE messages of that setup (made by a
  real :class:`WorkerNode`) or of replies the server just sent, each with header fields set to
  chosen values and payload bytes overwritten with extreme floats or raw bytes; ``nbytes`` and
  the CRC-32 are recomputed (unless the input says not to), so mutations get past them.

Findings: any exception but :class:`~commpress.ps.errors.ProtocolError` (the only one ``serve``
catches: anything else stops the server), a rejected message that changed the server's state
(``handle`` promises that nothing but counters change), an accepted message that leaves
non-finite parameters, a reply that fails ``parse_header``, an RSS over ``--rss-mb``, an input
slower than ``--timeout``.

    # CI budget (tests/test_fuzz.py runs this for ~10 s)
    python scripts/fuzz_ps.py --seconds 10
    # the long run of issue #12 (1,000,000 inputs)
    python scripts/fuzz_ps.py --runs 1000000
    # rewrite the seed corpus (valid messages of every setup, raw mode, plus structured seeds)
    python scripts/fuzz_ps.py --make-corpus

Options, corpus handling, timing and reports: the shared harness, ``scripts/fuzz_common.py``.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import sys
import zlib
from typing import Any

import fuzz_common

#: (push codec, mode, dtype, workers, require_crc)
SETUPS = [
    ("topk:ratio=0.25", "sync", "float32", 2, True),
    ("qsgd:bits=4", "async", "float32", 1, True),
    ("sign", "ssp", "float32", 2, True),
    ("qsgd:coding=gamma", "sync", "float32", 1, False),
    ("fp16", "async", "float64", 2, True),
    ("randomk:ratio=0.25", "sync", "bfloat16", 2, True),
    ("none", "ssp", "float16", 1, True),
    ("sign:block_size=8", "async", "float32", 2, False),
]
SERVERS = 2
STEPS = 3
SEED = 5
#: values worth trying in a header field of each width
EDGE_INTS = [0, 1, 2, 3, 7, 8, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 62, (1 << 64) - 1]
#: width in bits of the integer fields of ``protocol.HEADER`` (magic and value are not integers)
FIELD_BITS = [0, 8, 8, 16, 32, 32, 64, 64, 32, 32, 0]
EDGE_FLOATS = [0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 1e308, 5e-324, -1e30]


class Setup:
    """One server configuration with a real worker to make valid messages for it."""

    def __init__(self, spec: str, mode: str, dtype: str, workers: int, require_crc: bool) -> None:
        import torch

        from commpress.ps import PSConfig
        from commpress.ps.sharding import Layout, fingerprint
        from commpress.ps.worker import WorkerNode

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.cfg = PSConfig(servers=SERVERS, mode=mode, codec=spec, steps=STEPS, seed=SEED, staleness=1,
                            progress=False, max_drift=0.5)
        self.cfg.validate()
        self.W, self.require_crc = workers, require_crc
        torch.manual_seed(SEED)
        self.layout = Layout.from_model(self.model(), SERVERS, min_compress=16)
        self.fp = fingerprint(self.layout.describe(), self.cfg.describe(), workers)
        torch.manual_seed(SEED)
        self.initial = self.layout.flatten(self.model().parameters())
        self.nodes = []
        for w in range(workers):
            torch.manual_seed(SEED)
            self.nodes.append(WorkerNode(self.layout, w, self.cfg, self.model(), fingerprint=self.fp))
        g = torch.Generator().manual_seed(SEED)
        #: valid messages by (kind, worker, step, shard): PULL, BYE, PUSH and SKIP (a non-finite push)
        self.msgs: dict[tuple[str, int, int, int], bytes] = {}
        for w, node in enumerate(self.nodes):
            for step in range(STEPS + 1):
                for kind, made in (("PULL", node.pull(step)), ("BYE", node.bye(step))):
                    for s, m in made:
                        self.msgs[kind, w, step, s] = m.numpy().tobytes()
                if step == STEPS:
                    continue
                grad = torch.randn(self.layout.numel, generator=g).to(self.dtype)
                for s, m in node.push(step, grad, loss=1.5):
                    self.msgs["PUSH", w, step, s] = m.numpy().tobytes()
                bad = grad.clone()
                bad[0] = float("nan")
                for s, m in node.push(step, bad, loss=float("nan")):
                    self.msgs["SKIP", w, step, s] = m.numpy().tobytes()

    def model(self) -> Any:
        """A small model: two >= 2-D weights (compressed) and two biases (dense)."""
        torch = self.torch
        return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(self.dtype)

    def server(self, shard: int) -> Any:
        """A fresh server of ``shard`` (SGD with momentum, so the optimizer has state)."""
        from commpress.ps.server import ShardServer

        torch = self.torch
        sh = self.layout.shards[shard]
        return ShardServer(
            self.layout, shard, self.cfg, self.W, self.initial[sh.start : sh.stop],
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            fingerprint=self.fp, now=lambda: 1000.0, require_crc=self.require_crc,
        )

    def expected_step(self, server: Any, worker: int) -> int:
        """The step ``server`` expects ``worker``'s next push for."""
        return server.step if self.cfg.mode == "sync" else server.clock[worker]


def snapshot(server: Any) -> tuple:
    """Everything :meth:`ShardServer.handle` may not change when it rejects a message."""
    return (
        server.x.clone(), server.step, list(server.clock), dict(server.pending), set(server.held),
        set(server.joined), set(server.done), dict(server.dropped), list(server.last_heard),
        dict(server.last_loss), {k: v.clone() for k, v in server.replica.items()},
        dict(server.replies_since_resync), server.stats.push_msgs, server.stats.reply_msgs,
    )


def same(a: tuple, b: tuple) -> bool:
    """Snapshots equal (tensors bit-equal)."""
    import torch

    if not torch.equal(a[0], b[0]) or a[10].keys() != b[10].keys():
        return False
    if any(not torch.equal(a[10][k], b[10][k]) for k in a[10]):
        return False
    return a[1:10] + a[11:] == b[1:10] + b[11:]


class Target:
    """The fuzz target: fresh server, joins, then raw or structured messages (see the module doc)."""

    def __init__(self) -> None:
        import torch

        from commpress.ps import protocol
        from commpress.ps.errors import ProtocolError

        torch.set_num_threads(1)
        logging.getLogger("commpress").setLevel(logging.ERROR)  # the skipped-push warnings of the seeds
        self.torch, self.protocol, self.ProtocolError = torch, protocol, ProtocolError
        self.setups = [Setup(*s) for s in SETUPS]
        self.accepted = 0
        self.idle: dict[tuple, Any] = {}  # servers in their start state, by (setup, shard, joined)
        self.idle_replies: dict[tuple, list] = {}  # the replies to their joins
        self.current: tuple | None = None

    # ----- delivery with the checks --------------------------------------------------------
    def to_server(self, setup: Setup, server: Any, sender: int, buf: bytes, replies: list) -> None:
        """Deliver ``buf`` as ``serve`` would; check the outcome."""
        if len(buf) > server.max_message():
            return  # Inbox.receive consumes and rejects it before handle() sees it
        import numpy as np

        before = snapshot(server)
        try:
            out = server.handle(sender, np.frombuffer(bytearray(buf), dtype=np.uint8))
        except self.ProtocolError:
            if not same(before, snapshot(server)):
                raise AssertionError("a rejected message changed the server's state") from None
            return
        self.accepted += 1
        if not bool(self.torch.isfinite(server.x).all()):
            raise AssertionError("an accepted message left non-finite parameters on the server")
        for dest, msg in out:
            data = msg.numpy().tobytes()
            head = self.protocol.parse_header(msg.numpy(), None, self.protocol.TO_WORKER)  # replies must be valid
            replies.append((dest - setup.layout.servers, server.index, head.step, data))

    def to_worker(self, setup: Setup, worker: int, shard: int, step: int, buf: bytes) -> None:
        """Deliver ``buf`` to worker ``worker`` as a reply of server ``shard`` for ``step``."""
        import numpy as np

        node = setup.nodes[worker % setup.W]
        node.flat.copy_(setup.initial)
        try:
            node.apply(shard, np.frombuffer(bytearray(buf), dtype=np.uint8), step)
        except self.ProtocolError:
            return
        self.accepted += 1
        if not bool(self.torch.isfinite(node.flat).all()):
            raise AssertionError("an accepted reply left non-finite parameters on the worker")

    # ----- the two modes -------------------------------------------------------------------
    def start(self, setup: Setup, shard: int, joined: int, replies: list) -> Any:
        """A server of ``shard`` with the first ``joined`` workers joined at step 0.

        A server that has only rejected messages since its joins is in its start state
        (``to_server`` checks that rejections change nothing), so it is reused; building one and
        answering the PULLs costs more than most inputs.
        """
        key = (id(setup), shard, joined)
        server = self.idle.pop(key, None)
        if server is not None:
            replies.extend(self.idle_replies[key])
        else:
            server = setup.server(shard)
            for w in range(min(joined, setup.W)):
                self.to_server(setup, server, SERVERS + w, setup.msgs["PULL", w, 0, shard], replies)
            self.idle_replies[key] = list(replies)
        self.current = (key, server, self.accepted)
        return server

    def release(self) -> None:
        """Keep the server of this input for the next ones if nothing was accepted since its joins."""
        if self.current is not None:
            key, server, accepted = self.current
            if self.accepted == accepted:
                self.idle[key] = server
            self.current = None

    def raw(self, data: bytes) -> None:
        """Raw mode: bytes 1..3 choose setup, shard, joins, sender and step; the rest is the message."""
        if len(data) < 4:
            return
        setup = self.setups[data[1] % len(self.setups)]
        shard, joined = data[2] % SERVERS, data[2] // SERVERS % (setup.W + 1)
        replies: list = []
        if data[0] % 4 == 0:
            server = self.start(setup, shard, joined, replies)
            sender = SERVERS + data[3] % setup.W if data[3] < 250 else data[3] - 250
            self.to_server(setup, server, sender, data[4:], replies)
        else:
            self.to_worker(setup, data[3], shard, data[3] // 8 % (STEPS + 1), data[4:])

    def mutate(self, fdp: Any, buf: bytes) -> bytes:
        """Set header fields and overwrite payload bytes as ``fdp`` says; fix nbytes and CRC unless told not to."""
        proto = self.protocol
        fields = list(proto.HEADER.unpack_from(buf.ljust(proto.HEADER_NBYTES, b"\0")))
        payload = bytearray(buf[proto.HEADER_NBYTES :])
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            i = fdp.ConsumeIntInRange(0, len(fields) - 1)
            if i == 0:
                fields[0] = fdp.ConsumeBytes(4).ljust(4, b"\0")
            elif i == 10:
                fields[10] = EDGE_FLOATS[fdp.ConsumeIntInRange(0, len(EDGE_FLOATS) - 1)] if fdp.ConsumeBool() \
                    else fdp.ConsumeFloat()
            else:
                top = (1 << FIELD_BITS[i]) - 1
                how = fdp.ConsumeIntInRange(0, 2)
                if how == 0:
                    value = fields[i] + fdp.ConsumeIntInRange(-2, 2)
                elif how == 1:
                    value = EDGE_INTS[fdp.ConsumeIntInRange(0, len(EDGE_INTS) - 1)]
                else:
                    value = fdp.ConsumeIntInRange(0, top)
                fields[i] = min(max(value, 0), top)
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            how = fdp.ConsumeIntInRange(0, 3)
            if how == 0 and payload:  # an extreme float of some width at any offset
                width = (2, 4, 8)[fdp.ConsumeIntInRange(0, 2)]
                off = fdp.ConsumeIntInRange(0, max(0, len(payload) - width))
                value = EDGE_FLOATS[fdp.ConsumeIntInRange(0, len(EDGE_FLOATS) - 1)] if fdp.ConsumeBool() \
                    else fdp.ConsumeFloat()
                try:
                    patch = struct.pack({2: "<e", 4: "<f", 8: "<d"}[width], value)
                except (OverflowError, struct.error):
                    patch = struct.pack({2: "<e", 4: "<f", 8: "<d"}[width], float("inf"))
                payload[off : off + width] = patch
            elif how == 1 and payload:
                off = fdp.ConsumeIntInRange(0, len(payload) - 1)
                patch = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
                payload[off : off + len(patch)] = patch
            elif how == 2:  # truncate
                del payload[len(payload) - fdp.ConsumeIntInRange(0, min(len(payload), 16)) :]
            else:  # append
                payload += fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 16))
        if fdp.ConsumeIntInRange(0, 7):
            fields[7] = len(payload)
        if fdp.ConsumeIntInRange(0, 7):
            fields[8] = zlib.crc32(payload)
        return proto.HEADER.pack(*fields) + bytes(payload)

    def structured(self, data: bytes) -> None:
        """Structured mode: a sequence of mutated valid messages to a server and its workers."""
        import atheris

        fdp = atheris.FuzzedDataProvider(data[1:])
        setup = self.setups[fdp.ConsumeIntInRange(0, len(self.setups) - 1)]
        shard = fdp.ConsumeIntInRange(0, SERVERS - 1)
        replies: list = []
        server = self.start(setup, shard, fdp.ConsumeIntInRange(0, setup.W), replies)
        for _ in range(fdp.ConsumeIntInRange(1, 6)):
            w = fdp.ConsumeIntInRange(0, setup.W - 1)
            kind = fdp.ConsumeIntInRange(0, 4)
            if kind == 4:  # a reply the server sent, to the worker
                if not replies:
                    continue
                dest, s, step, buf = replies[fdp.ConsumeIntInRange(0, len(replies) - 1)]
                self.to_worker(setup, dest, s, step, self.mutate(fdp, buf))
                continue
            step = setup.expected_step(server, w) + fdp.ConsumeIntInRange(-1, 1)
            step = min(max(step, 0), STEPS - 1 if kind >= 2 else STEPS)
            name = ("PULL", "BYE", "PUSH", "SKIP")[kind]
            buf = setup.msgs[name, w, step, shard]
            sender = SERVERS + w if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeIntInRange(0, 5)
            self.to_server(setup, server, sender, self.mutate(fdp, buf) if fdp.ConsumeIntInRange(0, 3) else buf, replies)

    def __call__(self, data: bytes) -> None:
        """Raw (first byte 0/1 mod 4) or structured (2/3) mode."""
        if not data:
            return
        try:
            if data[0] % 4 < 2:
                self.raw(data)
            else:
                self.structured(data)
        finally:
            self.release()


def make_corpus(directory: str) -> int:
    """Raw-mode seeds (every valid message of every setup) and random structured seeds."""
    target = Target()
    count = 0
    for i, setup in enumerate(target.setups):
        for (kind, w, step, shard), buf in sorted(setup.msgs.items()):
            if step > 1:
                continue
            joined = 0 if kind == "PULL" else setup.W
            head = bytes([0, i, shard + SERVERS * joined, w])
            with open(os.path.join(directory, f"server-{i}-{kind}-w{w}-s{step}-shard{shard}"), "wb") as f:
                f.write(head + buf)
            count += 1
        replies: list = []
        for shard in range(SERVERS):  # replies: PARAMS after the joins, UPDATE/PARAMS after the pushes
            server = target.start(setup, shard, setup.W, replies)
            for w in range(setup.W):
                target.to_server(setup, server, SERVERS + w, setup.msgs["PUSH", w, 0, shard], replies)
        for j, (dest, s, step, buf) in enumerate(replies):
            with open(os.path.join(directory, f"worker-{i}-{j}"), "wb") as f:
                f.write(bytes([1, i, s, dest + 8 * step]) + buf)
            count += 1
    rng = random.Random(12)
    for i in range(24):
        with open(os.path.join(directory, f"structured-{i}"), "wb") as f:
            f.write(bytes([2]) + bytes(rng.randrange(256) for _ in range(rng.randrange(16, 200))))
        count += 1
    return count


def main() -> int:
    """Fuzz the parameter server's receive path with the shared harness (:mod:`fuzz_common`)."""
    return fuzz_common.main("ps", __doc__ or "", Target, make_corpus, max_len=4096)


if __name__ == "__main__":
    sys.exit(main())
