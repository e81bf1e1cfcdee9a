"""Coverage-guided fuzzing of every checkpoint loader (#12).

Loaders and the errors they document (``ValueError``; :class:`ConfigError` and
:class:`CodecError` derive from it):

* the parameter server's files: :func:`commpress.ps.checkpoint.load` (40-byte header, sha256,
  ``torch.load(weights_only=True)``, plausibility and ``like`` checks), then
  :meth:`ShardServer.load_state_dict` / :meth:`WorkerNode.load_state_dict`, as
  ``commpress.ps.runner`` resumes;
* :meth:`commpress.ddp.CompressionState.load_state_dict` (one rank, a gloo group of one);
* :meth:`commpress.feedback.ErrorFeedback.load_state_dict`.

Modes (first byte mod 6; the second picks the saved state to start from):

0. a whole checkpoint file, raw (header and digest included);
1. a checkpoint body (the ``torch.save`` bytes) with a valid header and digest, so byte
   mutations reach ``torch.load`` and the checks after it;
2. a real server/worker state dict with a few entries replaced, deleted or added (NaN, Inf and
   huge tensors, other dtypes and shapes, huge or negative ints, wrong types...), then saved
   with a valid digest and loaded;
3. and 4. the same object mutations fed to ``ErrorFeedback`` / ``CompressionState``;
5. ``torch.load(weights_only=True)`` of mutated bytes of a real saved DDP or error-feedback
   state, then its loader (what ``state.load_state_dict(torch.load(f))`` does).

Findings: any other exception, or a load that succeeds with something non-finite or
implausible in the loaded state (values beyond ``MAX_PLAUSIBLE_ABS``, negative counters, a
clock of the wrong length...), an RSS over ``--rss-mb``, an input slower than ``--timeout``.

    # CI budget (tests/test_fuzz.py runs this for ~10 s)
    python scripts/fuzz_checkpoint.py --seconds 10
    # the long run of issue #12 (1,000,000 inputs)
    python scripts/fuzz_checkpoint.py --runs 1000000
    # rewrite the seed corpus (the real saved states, one per mode and base)
    python scripts/fuzz_checkpoint.py --make-corpus

Options, corpus handling, timing and reports: the shared harness, ``scripts/fuzz_common.py``.
"""

from __future__ import annotations

import io
import logging
import os
import random
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import fuzz_common

STEP = 1
MODES = 6


def tree_paths(value: Any, where: tuple = ()) -> list[tuple]:
    """Paths (key tuples) of every entry of nested dicts and lists, containers included."""
    out = [where]
    if isinstance(value, Mapping):
        for k, v in value.items():
            out += tree_paths(v, (*where, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += tree_paths(v, (*where, i))
    return out


def copy_tree(value: Any) -> Any:
    """A copy of the containers (tensors shared: mutations replace them, never write into them)."""
    if isinstance(value, Mapping):
        return {k: copy_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [copy_tree(v) for v in value]
    return value


class Mutator:
    """Replaces, deletes or adds entries of a state dict as a FuzzedDataProvider says."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def value(self, fdp: Any, old: Any) -> Any:
        """A replacement for ``old``: an edge value, or a variant of the tensor it was."""
        torch = self.torch
        plain = [None, True, False, -1, 0, 1, 3, 1 << 62, 1 << 63, 1 << 64, -(1 << 70), 0.5, -0.0,
                 float("nan"), float("inf"), float("-inf"), 1e300, 1e16, "", "x", "topk", [], {},
                 [0, 0, 0, 0], [0.9, 0.0, False], {"name": "topk"}]
        if isinstance(old, torch.Tensor) and fdp.ConsumeBool():
            how = fdp.ConsumeIntInRange(0, 6)
            if how == 0 and old.numel():  # one element set to an extreme value
                t = old.clone().reshape(-1)
                v = [float("nan"), float("inf"), -float("inf"), 1e20, 3.0e38, -1e300][fdp.ConsumeIntInRange(0, 5)] \
                    if t.is_floating_point() else [-1, 1 << 62, -(1 << 62)][fdp.ConsumeIntInRange(0, 2)]
                t[fdp.ConsumeIntInRange(0, t.numel() - 1)] = torch.tensor(v).to(t.dtype)  # overflows to inf
                return t.reshape(old.shape)
            if how == 1:  # another dtype
                dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.float32, torch.int64, torch.uint8,
                          torch.bool, torch.complex64]
                return old.to(dtypes[fdp.ConsumeIntInRange(0, len(dtypes) - 1)])
            if how == 2:  # another shape
                return old.reshape(-1)[: fdp.ConsumeIntInRange(0, max(old.numel() - 1, 0))]
            if how == 3:
                return old.reshape(1, -1) if old.dim() == 1 else old.reshape(-1)
            if how == 4:
                return torch.empty(0, dtype=old.dtype)
            if how == 5:
                return torch.tensor(fdp.ConsumeFloat())
            return old * [1e10, -1e20, 0.0, 1e300][fdp.ConsumeIntInRange(0, 3)]
        return plain[fdp.ConsumeIntInRange(0, len(plain) - 1)]

    def mutate(self, fdp: Any, state: Any) -> Any:
        """A mutated copy of ``state`` (1 to 3 changes)."""
        state = copy_tree(state)
        for _ in range(fdp.ConsumeIntInRange(1, 3)):
            paths = tree_paths(state)
            path = paths[fdp.ConsumeIntInRange(0, len(paths) - 1)]
            if not path:
                continue
            parent = state
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            how = fdp.ConsumeIntInRange(0, 5)
            if how == 0:  # delete
                del parent[key]
            elif how == 1 and isinstance(parent, dict):  # add a sibling
                parent[fdp.ConsumeUnicodeNoSurrogates(6) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-2, 9)] = \
                    self.value(fdp, parent[key])
            else:
                parent[key] = self.value(fdp, parent[key])
        return state


def check_feedback(ef: Any, torch: Any, limit: float) -> None:
    """A loaded error-feedback memory: finite, plausible residuals of declared shapes; counters >= 0."""
    for key in list(ef.keys()):
        r = ef.residual(key)
        if not isinstance(key, str) or r.dtype not in (torch.float32, torch.float64):
            raise AssertionError(f"loaded residual {key!r} of dtype {r.dtype}")
        if r.numel() and not (bool(torch.isfinite(r).all()) and float(r.abs().max()) <= limit):
            raise AssertionError(f"loaded residual {key!r} is not finite or beyond {limit:g}")
        if ef.shapes is not None and r.shape != ef.shapes.get(key):
            raise AssertionError(f"loaded residual {key!r} has shape {tuple(r.shape)}, declared {ef.shapes.get(key)}")
    counts = ef.nonfinite_counts
    if not (isinstance(ef.nonfinite_steps, int) and ef.nonfinite_steps >= 0
            and all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in counts.items())):
        raise AssertionError(f"loaded skip counters are not ints >= 0: {ef.nonfinite_steps!r} {counts!r:.200}")


class Target:
    """The fuzz target: every checkpoint loader, from bytes or from mutated state dicts."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from fuzz_ps import SERVERS, Setup

        import commpress
        from commpress.errors import ConfigError
        from commpress.feedback import MAX_PLAUSIBLE_ABS, ErrorFeedback
        from commpress.ps import checkpoint

        torch.set_num_threads(1)
        logging.getLogger("commpress").setLevel(logging.ERROR)
        self.torch, self.checkpoint, self.ConfigError = torch, checkpoint, ConfigError
        self.limit = MAX_PLAUSIBLE_ABS
        self.mutator = Mutator(torch)
        self.accepted = 0
        self.dir = tempfile.mkdtemp(prefix="fuzz_checkpoint.", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        # the parameter server: a server whose optimizer has momentum state, and a worker with residuals
        self.ps = Setup("topk:ratio=0.25", "async", "float32", 1, True)
        server = self.ps.server(0)
        server.handle(SERVERS, _array(self.ps.msgs["PULL", 0, 0, 0]))
        server.handle(SERVERS, _array(self.ps.msgs["PUSH", 0, 0, 0]))
        worker = self.ps.nodes[0]
        #: (rank, state, like): rank 0 is server 0, rank SERVERS worker 0
        self.ps_states = [(0, server.state_dict(), server.state_dict()), (SERVERS, worker.state_dict(), worker.state_dict())]
        # DDP: one rank in a gloo group of one; residuals and velocities filled as a step would
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        self.ddp = []
        for spec, kw in (("topk", {"ratio": 0.25, "momentum": 0.9}), ("sign", {}), ("qsgd", {"error_feedback": True})):
            model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
            state = commpress.ddp.CompressionState(model, spec, min_numel=16, **kw)
            for fb in (state.feedback, state.server_feedback):
                if fb is not None:
                    for key, shape in (fb.shapes or {}).items():
                        fb.compress(key, torch.randn(shape, generator=g))
            for name, plan in state.plans.items():
                if state.momentum and plan.compressed:
                    state.velocity[name] = torch.randn(plan.numel, generator=g)
            self.ddp.append((state, state.state_dict()))
        # error feedback alone: declared shapes, and free keys
        self.efs = []
        for shapes in ({"a": (5,), "b.weight": (3, 4)}, None):
            ef = ErrorFeedback(commpress.codecs.get("topk", ratio=0.3), shapes)
            for key, shape in {"a": (5,), "b.weight": (3, 4)}.items():
                ef.compress(key, torch.randn(shape, generator=g) * 3)
            self.efs.append((ef, ef.state_dict()))
        self.server_like = self.ps_states[0][2]

    # ----- the loaders with their checks ---------------------------------------------------
    def write(self, rank: int, data: bytes) -> None:
        """Make ``data`` the checkpoint file of ``rank`` at ``STEP``."""
        with open(self.checkpoint.path_for(self.dir, rank, STEP), "wb") as f:
            f.write(data)

    def file_for(self, body: bytes) -> bytes:
        """A checkpoint file around ``body`` with a valid header and digest."""
        from commpress import checkpoint as files

        return files.frame(body, magic=self.checkpoint.MAGIC, fmt=self.checkpoint.FORMAT)

    def load_ps(self, which: int) -> None:
        """Resume as the runner does: ``checkpoint.load(..., like=own state)``, then the rank's loader."""
        rank, _, like = self.ps_states[which]
        try:
            state = self.checkpoint.load(self.dir, rank, STEP, like=like)
        except self.ConfigError:
            return
        if which == 0:
            owner = self.ps.server(0)
        else:
            owner = self.fresh_worker()
        try:
            owner.load_state_dict(state)
        except ValueError:
            return
        self.accepted += 1
        torch = self.torch
        if which == 0:
            x = owner.x
            if not (bool(torch.isfinite(x).all()) and float(x.abs().max()) <= self.limit):
                raise AssertionError("loaded server shard is not finite or implausible")
            # counters: ints of 64 bits (checkpoint.validate's bound), one clock per worker
            if not (isinstance(owner.step, int) and len(owner.clock) == owner.W
                    and all(isinstance(c, int) and -(1 << 63) <= c < 1 << 64 for c in owner.clock)):
                raise AssertionError(f"loaded server step/clock implausible: {owner.step!r} {owner.clock!r:.200}")
        else:
            if owner.ef is not None:
                check_feedback(owner.ef, torch, self.limit)
            if not (isinstance(owner.skipped_steps, int) and -(1 << 63) <= owner.skipped_steps < 1 << 64):
                raise AssertionError(f"loaded skipped_steps {owner.skipped_steps!r}")

    def fresh_worker(self) -> Any:
        """A worker of the parameter-server setup with an empty memory."""
        from commpress.ps.worker import WorkerNode

        torch = self.torch
        torch.manual_seed(0)
        return WorkerNode(self.ps.layout, 0, self.ps.cfg, self.ps.model(), fingerprint=self.ps.fp)

    def _accepts(self, target: Any, state: Any) -> bool:
        """``target.load_state_dict(state)``: False on the documented ``ValueError``, else counted."""
        try:
            target.load_state_dict(state)
        except ValueError:
            return False
        self.accepted += 1
        return True

    def load_ef(self, which: int, state: Any) -> None:
        """``ErrorFeedback.load_state_dict``; then the memory must be plausible."""
        ef, base = self.efs[which]
        if not self._accepts(ef, state):
            return
        check_feedback(ef, self.torch, self.limit)
        ef.load_state_dict(base)

    def load_ddp(self, which: int, state: Any) -> None:
        """``CompressionState.load_state_dict``; then everything it holds must be plausible."""
        torch = self.torch
        st, base = self.ddp[which]
        if not self._accepts(st, state):
            return
        if not (isinstance(st.step, int) and 0 <= st.step < 1 << 62 and isinstance(st.seed, int) and 0 <= st.seed < 1 << 64):
            raise AssertionError(f"loaded step/seed implausible: {st.step!r} {st.seed!r}")
        for name, v in st.velocity.items():
            if v.numel() and not (bool(torch.isfinite(v).all()) and float(v.abs().max()) <= self.limit):
                raise AssertionError(f"loaded velocity {name!r} not finite or implausible")
        for fb in (st.feedback, st.server_feedback):
            if fb is not None:
                check_feedback(fb, torch, self.limit)
        stats = st._stats.as_dict()
        if not all(isinstance(v, (int, float)) and 0 <= v < float("inf") for v in stats.values()):
            raise AssertionError(f"loaded statistics implausible: {stats!r:.300}")
        guard = st.guard.state()
        if not (all(isinstance(v, int) and v >= 0 for v in guard[:3]) and 0 <= guard[3] < float("inf")):
            raise AssertionError(f"loaded guard state implausible: {guard!r}")
        if not 0 <= st._stats_from_step <= st.step:
            raise AssertionError(f"loaded stats_from_step {st._stats_from_step!r} outside [0, step]")
        st.load_state_dict(base)

    # ----- modes ---------------------------------------------------------------------------
    def __call__(self, data: bytes) -> None:
        """Dispatch on the mode byte (see the module docstring)."""
        if len(data) < 2:
            return
        mode, pick, rest = data[0] % MODES, data[1], data[2:]
        torch = self.torch
        if mode == 0:
            self.write(self.ps_states[pick % 2][0], rest)
            self.load_ps(pick % 2)
        elif mode == 1:
            self.write(self.ps_states[pick % 2][0], self.file_for(rest))
            self.load_ps(pick % 2)
        elif mode in (2, 3, 4):
            import atheris

            fdp = atheris.FuzzedDataProvider(rest)
            if mode == 2:
                rank, state, _ = self.ps_states[pick % 2]
                full = {"format": self.checkpoint.FORMAT, "rank": rank, "step": STEP, **state}
                buf = io.BytesIO()
                torch.save(self.mutator.mutate(fdp, full), buf)
                self.write(rank, self.file_for(buf.getvalue()))
                self.load_ps(pick % 2)
            elif mode == 3:
                self.load_ef(pick % len(self.efs), self.mutator.mutate(fdp, self.efs[pick % len(self.efs)][1]))
            else:
                self.load_ddp(pick % len(self.ddp), self.mutator.mutate(fdp, self.ddp[pick % len(self.ddp)][1]))
        else:
            try:
                state = torch.load(io.BytesIO(rest), weights_only=True)
            except Exception:  # noqa: BLE001 - torch.load's own errors are the caller's to handle
                return
            if pick % 2:
                self.load_ef((pick // 2) % len(self.efs), state)
            else:
                self.load_ddp((pick // 2) % len(self.ddp), state)


def _array(buf: bytes) -> Any:
    import numpy as np

    return np.frombuffer(bytearray(buf), dtype=np.uint8)


def make_corpus(directory: str) -> int:
    """Seeds: the real saved states in every mode, and random bytes for the mutation modes."""
    import torch

    target = Target()
    count = 0

    def put(name: str, data: bytes) -> None:
        nonlocal count
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
        count += 1

    for i, (rank, state, _) in enumerate(target.ps_states):
        buf = io.BytesIO()
        torch.save({"format": target.checkpoint.FORMAT, "rank": rank, "step": STEP, **state}, buf)
        put(f"ps-file-{i}", bytes([0, i]) + target.file_for(buf.getvalue()))
        put(f"ps-body-{i}", bytes([1, i]) + buf.getvalue())
    for i, (_, base) in enumerate(target.efs):
        buf = io.BytesIO()
        torch.save(base, buf)
        put(f"ef-bytes-{i}", bytes([5, 1 + 2 * i]) + buf.getvalue())
    for i, (_, base) in enumerate(target.ddp):
        buf = io.BytesIO()
        torch.save(base, buf)
        put(f"ddp-bytes-{i}", bytes([5, 2 * i]) + buf.getvalue())
    rng = random.Random(12)
    for mode in (2, 3, 4):
        for i in range(8):
            put(f"mutate-{mode}-{i}", bytes([mode, i]) + bytes(rng.randrange(256) for _ in range(rng.randrange(8, 64))))
    return count


def main() -> int:
    """Fuzz the checkpoint loaders with the shared harness (:mod:`fuzz_common`)."""
    return fuzz_common.main("checkpoint", __doc__ or "", Target, make_corpus, max_len=16384)


if __name__ == "__main__":
    sys.exit(main())
