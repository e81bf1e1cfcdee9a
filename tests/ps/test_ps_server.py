"""Serial tests of the server and worker logic, driven without MPI (messages passed by hand).

These are the parameter server's semantics on one process: sync == single-process training,
rejection of hostile messages without side effects, the drift bound, timeouts on a fake
clock, the ssp bound, checkpoint round trips. tests/test_ps_mpi.py runs the same under mpirun.
"""

import math

import numpy as np
import pytest
import torch

from commpress.ps import ConfigError, Fault, ProtocolError, PSConfig, WorkerTimeout, reference_train
from commpress.ps import checkpoint as ckpt
from commpress.ps.demos import digits_task
from commpress.ps.faults import before_push
from commpress.ps.protocol import BROADCAST, MsgType, build
from commpress.ps.server import ShardServer
from commpress.ps.sharding import Layout, fingerprint
from commpress.ps.stats import gather_stats
from commpress.ps.worker import WorkerNode, WorkerRun, round_steps

torch.set_num_threads(1)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Cluster:
    """S servers and W workers in one process; replies are queued per worker."""

    def __init__(self, cfg, workers=2, task=None, clock=None):
        self.task = task or digits_task(hidden=32, seed=cfg.seed)
        self.cfg, self.W, self.S = cfg, workers, cfg.servers
        self.clock = clock or Clock()
        torch.manual_seed(cfg.seed)
        model = self.task.model()
        self.layout = Layout.from_model(model, self.S, 64)
        self.fp = fingerprint(self.layout.describe(), cfg.describe(), workers)
        flat = self.layout.flatten(model.parameters())
        self.events = []
        optimizer = cfg.outer_optimizer() if cfg.local_steps else self.task.optimizer  # as runner._serve
        self.servers = [
            ShardServer(self.layout, s, cfg, workers, flat[sh.start : sh.stop], optimizer,
                        fingerprint=self.fp, now=self.clock, log=self.events.append)
            for s, sh in enumerate(self.layout.shards)
        ]
        self.nodes = []
        for w in range(workers):
            torch.manual_seed(cfg.seed)
            self.nodes.append(WorkerNode(self.layout, w, cfg, self.task.model(), fingerprint=self.fp,
                                         inner_optimizer=self.task.optimizer if cfg.local_steps else None))
        self.queue = {w: [] for w in range(workers)}

    def send(self, w, msgs):
        for s, msg in msgs:
            self.route(s, self.servers[s].handle(self.S + w, msg.numpy() if isinstance(msg, torch.Tensor) else msg))

    def route(self, s, out):
        for dest, reply in out:
            self.queue[dest - self.S].append((s, reply))

    def deliver(self, w, step):
        stops = [self.nodes[w].apply(s, r.numpy(), step) for s, r in self.queue[w]]
        self.queue[w].clear()
        return stops

    def start(self, step=0):
        for w in range(self.W):
            self.send(w, self.nodes[w].pull(step))
            assert self.deliver(w, step) == [None] * self.S

    def push(self, w, t):
        node, H = self.nodes[w], self.cfg.local_steps
        if H:  # DiLoCo's outer-step servers: H inner steps, then the pseudo-gradient
            loss, grad = node.local_round(self.task.loss, [self.task.batch(w, self.W, i) for i in round_steps(t, H)])
        else:
            loss, grad = node.compute(self.task.loss, self.task.batch(w, self.W, t))
        msgs = node.push(t, grad, loss)
        self.send(w, msgs)
        return msgs

    def sync_step(self, t):
        for w in range(self.W):
            self.push(w, t)
        for w in range(self.W):
            assert len(self.queue[w]) == self.S
            self.deliver(w, t)

    def params(self):
        return torch.cat([s.x for s in self.servers])


def _cfg(**kw):
    base = dict(servers=2, steps=12, seed=0, progress=False)
    base.update(kw)
    cfg = PSConfig(**base)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_none_equals_single_process_training_on_the_union(optimizer):
    cfg = _cfg(codec="none")
    c = Cluster(cfg, workers=3, task=digits_task(hidden=32, optimizer=optimizer))
    c.start()
    for t in range(cfg.steps):
        c.sync_step(t)
    ref = reference_train(c.task, 3, cfg.steps, seed=cfg.seed)
    torch.testing.assert_close(c.params(), ref, rtol=1e-5, atol=1e-6)
    for node in c.nodes:  # pull codec none: workers hold the server's parameters exactly
        assert torch.equal(node.flat, c.params())


@pytest.mark.parametrize("optimizer, outer", [("sgd", {}), ("adam", {}),
                                              ("adam", {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True})])
def test_local_steps_sync_none_equals_single_process_diloco(optimizer, outer):
    # DiLoCo's outer-step servers: H=3 inner steps of the task's optimizer per sync, the outer SGD on the mean
    cfg = _cfg(codec="none", steps=4, local_steps=3, **outer)
    c = Cluster(cfg, workers=3, task=digits_task(hidden=32, optimizer=optimizer))
    c.start()
    for t in range(cfg.steps):
        c.sync_step(t)
    ref = reference_train(c.task, 3, cfg.steps, seed=cfg.seed, config=cfg)
    torch.testing.assert_close(c.params(), ref, rtol=1e-5, atol=1e-6)
    plain = reference_train(c.task, 3, cfg.steps * cfg.local_steps, seed=cfg.seed)  # per-step data parallel
    assert not torch.allclose(ref, plain, rtol=1e-3, atol=1e-4)  # the local steps are not a no-op
    for node in c.nodes:
        assert torch.equal(node.flat, c.params())
        assert node.inner is not None and node.inner.state  # the inner optimizer keeps its state across syncs


def test_local_steps_options_are_checked():
    for bad, match in [({"local_steps": -1}, "local_steps"), ({"local_steps": 2, "outer_lr": float("nan")}, "outer_lr"),
                       ({"local_steps": 2, "outer_momentum": 1.0}, "outer_momentum"),
                       ({"local_steps": 2, "outer_nesterov": True}, "outer_nesterov")]:
        with pytest.raises(ConfigError, match=match):
            _cfg(**bad)
    # a gradient-pushing run's fingerprint does not move with the (unused) outer options
    assert _cfg().describe() == _cfg(outer_lr=0.5).describe() != _cfg(local_steps=2).describe()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("codec", ["topk:ratio=0.1", "sign", "qsgd:bits=4", "fp16"])
def test_worker_copy_equals_server_replica_bitwise(mode, codec):
    cfg = _cfg(codec=codec, mode=mode, max_drift=0.05)
    c = Cluster(cfg)
    c.start()
    for t in range(8):
        c.sync_step(t)
        for w, node in enumerate(c.nodes):
            for s, sv in enumerate(c.servers):
                sh = c.layout.shards[s]
                key = BROADCAST if mode == "sync" else w
                assert torch.equal(node.flat[sh.start : sh.stop], sv.replica[key])


def test_drift_stays_within_max_drift_even_for_a_non_contractive_pull_codec():
    cfg = _cfg(codec="topk:ratio=0.1", pull_codec="randomk:ratio=0.05", max_drift=0.002, steps=30)
    c = Cluster(cfg)
    c.start()
    for t in range(cfg.steps):
        c.sync_step(t)
        for sv in c.servers:
            x, r = sv.x, sv.replica[BROADCAST]
            assert float(torch.linalg.vector_norm(x - r)) <= 0.002 * float(torch.linalg.vector_norm(x)) * (1 + 1e-6)
    assert sum(sv.stats.resyncs for sv in c.servers) > 0


def test_contractive_pull_codec_obeys_the_error_feedback_recursion():
    # d' <= sqrt(1 - delta) * (d + ||step||) with delta = k/d for top-k; guard disabled.
    cfg = _cfg(codec="none", pull_codec="topk:ratio=0.1", max_drift=float("inf"), min_compress=1, steps=25)
    c = Cluster(cfg)
    c.start()
    sv = c.servers[0]
    seg = [s for s in c.layout.shards[0].segments if s.compress]
    assert seg
    delta = min(c.servers[0].pull_codec.delta(s.numel) for s in seg)  # dense segments: delta = 1
    d_prev, x_prev = 0.0, sv.x.clone()
    for t in range(cfg.steps):
        c.sync_step(t)
        d = float(torch.linalg.vector_norm(sv.x - sv.replica[BROADCAST]))
        step = float(torch.linalg.vector_norm(sv.x - x_prev))
        assert d <= math.sqrt(1 - delta) * (d_prev + step) + 1e-6  # per segment, summed by Minkowski
        d_prev, x_prev = d, sv.x.clone()
    assert sv.stats.resyncs == 0 and d_prev > 0


@pytest.mark.parametrize("kind", ["corrupt", "truncate", "wrongshard", "spoof", "badwire", "garbage", "oversize"])
def test_hostile_messages_are_rejected_without_side_effects(kind):
    cfg = _cfg(codec="topk:ratio=0.1")
    c = Cluster(cfg)
    c.start()
    c.sync_step(0)
    before = [(sv.x.clone(), dict(sv.pending), list(sv.clock), sv.step) for sv in c.servers]
    node = c.nodes[0]
    loss, grad = node.compute(c.task.loss, c.task.batch(0, 2, 1))
    honest = node.push(1, grad, loss)
    sent = []
    before_push(Fault(kind, 0), 1, honest, lambda dest, buf: sent.append((dest, buf)))
    assert sent
    for dest, buf in sent:
        if kind == "oversize":
            assert len(buf) > c.servers[dest].max_message()  # the transport refuses it (test_ps_transport)
            continue
        with pytest.raises(ProtocolError) as info:
            c.servers[dest].handle(c.S + 0, buf)
        assert info.value.sender == c.S
    for sv, (x, pending, clock, step) in zip(c.servers, before):
        assert torch.equal(sv.x, x) and sv.pending == pending and sv.clock == clock and sv.step == step
    # the honest messages still go through and training continues identically
    c.send(0, honest)
    c.push(1, 1)
    c.deliver(0, 1)
    c.deliver(1, 1)
    assert all(sv.step == 2 for sv in c.servers)


def test_protocol_breaches_by_a_worker_are_rejected():
    cfg = _cfg(codec="none")
    c = Cluster(cfg)
    sv = c.servers[0]
    early = build(MsgType.PUSH, shard=0, worker=0, step=0).numpy()
    with pytest.raises(ProtocolError, match="before the worker's first PULL"):
        sv.handle(c.S, early)
    with pytest.raises(ProtocolError, match="not a worker"):
        sv.handle(1, early)
    c.start()
    msgs = c.push(0, 0)
    with pytest.raises(ProtocolError, match="duplicate"):
        c.send(0, msgs[:1])
    loss, grad = c.nodes[1].compute(c.task.loss, c.task.batch(1, 2, 0))
    with pytest.raises(ProtocolError, match="expected step 0"):
        c.send(1, c.nodes[1].push(5, grad, loss)[:1])
    bad_fp = build(MsgType.PULL, shard=0, worker=1, step=0, parts=[b"\0" * 8]).numpy()
    with pytest.raises(ProtocolError, match="fingerprint"):  # a joined worker: rejected
        sv.handle(c.S + 1, bad_fp)
    with pytest.raises(ProtocolError, match="PULL at step 3"):
        sv.handle(c.S + 1, build(MsgType.PULL, shard=0, worker=1, step=3, parts=[c.fp.to_bytes(8, "little")]).numpy())
    # a worker joining with another setup or from another step: rejected and named, never fatal
    # (issue 12 item 5: these used to raise ConfigError and end the server)
    fresh = Cluster(cfg)
    with pytest.raises(ProtocolError, match=f"from rank {fresh.S + 1}: fingerprint: .*different model") as info:
        fresh.servers[0].handle(fresh.S + 1, bad_fp)
    assert info.value.sender == fresh.S + 1
    late = build(MsgType.PULL, shard=0, worker=1, step=4, parts=[fresh.fp.to_bytes(8, "little")]).numpy()
    with pytest.raises(ProtocolError, match="starts at step 4"):
        fresh.servers[0].handle(fresh.S + 1, late)
    assert not fresh.servers[0].joined
    fresh.start()  # the honest workers still join and train
    fresh.sync_step(0)
    assert all(sv.step == 1 for sv in fresh.servers)


def test_a_bye_cannot_stop_a_sync_server():
    """Issue 12 item 5: a BYE at step 0 (before or after joining) used to end the run (exit 1)."""
    cfg = _cfg(codec="topk:ratio=0.1", timeout=5.0)
    c = Cluster(cfg)
    sv = c.servers[0]
    bye = build(MsgType.BYE, shard=0, worker=1, step=0).numpy()
    with pytest.raises(ProtocolError, match="BYE before the worker's first PULL"):
        sv.handle(c.S + 1, bye)
    c.start()
    with pytest.raises(ProtocolError, match="BYE at step 0 of 12: sync mode cannot continue"):
        sv.handle(c.S + 1, bye)
    assert not sv.done
    c.sync_step(0)  # the run goes on
    c.sync_step(1)
    assert all(s.step == 2 for s in c.servers)
    c.push(0, 2)  # ...and if worker 1 really left, its silence ends the run with what happened
    c.clock.t += 6.0
    with pytest.raises(WorkerTimeout, match=r"last rejected message: BYE at step 0: BYE at step 0 of 12"):
        sv.check()


def test_a_bye_in_async_mode_ends_only_that_worker():
    cfg = _cfg(mode="async", servers=1)
    c = Cluster(cfg)
    c.start()
    c.send(1, c.nodes[1].bye(0))
    assert c.servers[0].done == {1}
    c.push(0, 0)
    assert c.deliver(0, 0) == [None]


def test_a_nan_loss_does_not_kill_a_sync_run():
    """Issue 12 item 2: the skip push carried the NaN loss in the header's value and was rejected."""
    cfg = _cfg(codec="topk:ratio=0.1", servers=2)
    c = Cluster(cfg)
    c.start()
    node = c.nodes[0]
    _, grad = node.compute(c.task.loss, c.task.batch(0, 2, 0))
    grad[0] = float("nan")
    msgs = node.push(0, grad, float("nan"))
    c.send(0, msgs)  # accepted: no ProtocolError
    c.push(1, 0)
    c.deliver(0, 0)
    c.deliver(1, 0)
    assert all(sv.step == 1 and sv.stats.skipped_pushes == 1 for sv in c.servers)
    assert not any(sv.stats.rejected for sv in c.servers)
    _, grad = node.compute(c.task.loss, c.task.batch(0, 2, 1))
    c.send(0, node.push(1, grad, float("inf")))  # a finite gradient with a non-finite loss
    c.push(1, 1)
    c.deliver(0, 1)
    c.deliver(1, 1)
    assert all(sv.step == 2 for sv in c.servers) and torch.isfinite(c.params()).all()
    with pytest.raises(ValueError, match="value must be finite"):
        build(MsgType.PUSH, shard=0, worker=0, step=0, value=float("nan"))


def test_local_steps_non_finite_round_is_skipped_and_the_inner_state_cleared():
    cfg = _cfg(codec="qsgd:bits=4", servers=1, local_steps=3, steps=3)
    c = Cluster(cfg, task=digits_task(hidden=32, optimizer="adam"))
    c.start()
    c.sync_step(0)
    node, task = c.nodes[0], c.task
    poisoned = task.batch(0, 2, 3)
    poisoned = (poisoned[0].clone().fill_(float("nan")), *poisoned[1:])  # the round's first batch
    _, delta = node.local_round(task.loss, [poisoned, task.batch(0, 2, 4), task.batch(0, 2, 5)])
    assert not torch.isfinite(delta).all() and not node.inner.state  # the NaN moments are gone
    assert torch.isfinite(node.flat).all()  # back at the replica
    c.send(0, node.push(1, delta, float("nan")))
    c.push(1, 1)
    c.deliver(0, 1)
    c.deliver(1, 1)
    assert c.servers[0].stats.skipped_pushes == 1 and c.servers[0].step == 2
    c.sync_step(2)  # the next round trains again from the servers' parameters
    assert c.servers[0].stats.skipped_pushes == 1 and torch.isfinite(c.params()).all()
    assert all(torch.isfinite(v).all() for st in node.inner.state.values() for v in st.values())


def test_non_finite_gradient_is_skipped_and_averaged_out():
    cfg = _cfg(codec="topk:ratio=0.1", servers=1)
    c = Cluster(cfg)
    c.start()
    node = c.nodes[0]
    _, grad = node.compute(c.task.loss, c.task.batch(0, 2, 0))
    grad[3] = float("nan")
    residuals = {k: node.ef.residual(k) for k in node.ef.keys()}
    c.send(0, node.push(0, grad, 0.0))
    assert node.ef.nonfinite_steps == 0 and {k: node.ef.residual(k) for k in node.ef.keys()} == residuals
    c.push(1, 0)
    c.deliver(0, 0)
    c.deliver(1, 0)
    assert c.servers[0].stats.skipped_pushes == 1 and c.servers[0].step == 1
    assert torch.isfinite(c.params()).all()


def test_sync_timeout_names_the_silent_worker():
    cfg = _cfg(timeout=5.0)
    c = Cluster(cfg)
    c.start()
    c.push(0, 0)
    c.clock.t += 4.0
    assert c.servers[0].check() == []
    c.clock.t += 2.0
    with pytest.raises(WorkerTimeout, match=f"worker rank {c.S + 1} .*sync mode") as info:
        c.servers[0].check()
    assert info.value.rank == c.S + 1


def test_silence_clock_restarts_when_a_step_completes():
    cfg = _cfg(timeout=5.0)
    c = Cluster(cfg)
    c.start()
    c.push(0, 0)
    c.clock.t += 4.5  # worker 0 waits for worker 1 for a long time...
    c.push(1, 0)
    c.deliver(0, 0)
    c.deliver(1, 0)
    c.clock.t += 4.5  # ...then both get 4.5 s for the next step: nobody is late
    assert c.servers[0].check() == []


def test_async_drops_a_silent_worker_and_keeps_going():
    cfg = _cfg(mode="async", timeout=5.0, servers=1)
    c = Cluster(cfg)
    c.start()
    for t in range(3):
        c.push(0, t)
        c.push(1, t)
        c.deliver(0, t)
        c.deliver(1, t)
    c.clock.t += 6.0
    c.push(0, 3)
    c.deliver(0, 3)
    out = c.servers[0].check()
    assert [d for d, _ in out] == [c.S + 1]  # STOP to the dropped worker
    c.route(0, out)
    assert c.servers[0].dropped and c.servers[0].stats.dropped == [c.S + 1]
    assert c.deliver(1, 3)[0].startswith("dropped")
    c.push(0, 4)  # the others are not held back
    c.deliver(0, 4)
    c.push(1, 3)  # the dropped worker comes back: told to stop, nothing applied
    assert c.deliver(1, 3)[0].startswith("worker 1")
    c.send(1, c.nodes[1].bye(3))
    assert 1 in c.servers[0].done


def test_ssp_never_lets_a_worker_lead_by_more_than_k():
    K = 1
    cfg = _cfg(mode="ssp", staleness=K, servers=1, steps=10)
    c = Cluster(cfg, workers=3)
    c.start()
    sv = c.servers[0]
    next_step = [0, 0, 0]
    rng = np.random.default_rng(0)
    for _ in range(40):  # random arrival order; a worker only pushes once its reply arrived
        ready = [w for w in range(3) if next_step[w] < cfg.steps and w not in sv.held]
        if not ready:
            break
        w = int(rng.choice(ready, p=None if len(ready) < 3 else [0.6, 0.3, 0.1]))
        c.push(w, next_step[w])
        for v in range(3):
            if c.queue[v]:
                c.deliver(v, next_step[v])
                next_step[v] += 1
    leads = [e["ahead"] for e in c.events if e["event"] == "reply"]
    assert leads and max(leads) <= K and sv.stats.max_ahead <= K
    assert max(leads) == K  # the bound was reached, so it was actually enforced


@pytest.mark.parametrize("local_steps", [0, 2])
def test_server_state_roundtrip_continues_identically(tmp_path, local_steps):
    # local_steps: the workers' inner optimizer (SGD momentum here) is in their checkpoints too
    cfg = _cfg(codec="topk:ratio=0.1", pull_codec="sign", max_drift=0.05, local_steps=local_steps)
    a = Cluster(cfg)
    a.start()
    for t in range(4):
        a.sync_step(t)
    for s, sv in enumerate(a.servers):
        ckpt.save(str(tmp_path), s, 4, sv.state_dict())
    for w, node in enumerate(a.nodes):
        ckpt.save(str(tmp_path), a.S + w, 4, node.state_dict())
    assert ckpt.latest_complete(str(tmp_path), a.S + a.W) == 4
    for t in range(4, 8):
        a.sync_step(t)
    b = Cluster(cfg)
    for s, sv in enumerate(b.servers):
        sv.load_state_dict(ckpt.load(str(tmp_path), s, 4))
    for w, node in enumerate(b.nodes):
        node.load_state_dict(ckpt.load(str(tmp_path), b.S + w, 4))
    b.start(4)
    for t in range(4, 8):
        b.sync_step(t)
    assert torch.equal(a.params(), b.params())
    for na, nb in zip(a.nodes, b.nodes):
        assert torch.equal(na.flat, nb.flat)


def test_checkpoint_files(tmp_path):
    d = str(tmp_path)
    for step in (2, 4, 6):
        ckpt.save(d, 0, step, {"x": torch.ones(3)})
    assert ckpt.steps_by_rank(d) == {0: [4, 6]}  # two newest kept
    ckpt.save(d, 1, 4, {"x": torch.ones(3)})
    assert ckpt.latest_complete(d, 2) == 4 and ckpt.latest_complete(d, 3) is None
    assert torch.equal(ckpt.load(d, 0, 6)["x"], torch.ones(3))
    ckpt.write_meta(d, {"world": 3, "fingerprint": 7})
    ckpt.check_meta(d, {"world": 3, "fingerprint": 7})
    with pytest.raises(ConfigError, match="fingerprint"):
        ckpt.check_meta(d, {"world": 3, "fingerprint": 8})
    with open(ckpt.path_for(d, 2, 1), "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read"):
        ckpt.load(d, 2, 1)


# ----- plausibility of pushed values (issue 12, failure 6) ----------------------------------------
def _run_with_hostile_worker(cfg, hostile, *, skip_instead=False):
    """3 workers; from step 2 on, worker ``hostile`` flips the exponent's top bit of its largest
    shard-0 gradient value and pushes it through the honest API (valid CRC). With
    ``skip_instead`` it sends a SKIP push to shard 0 instead (what the server should make of it)."""
    from commpress.ps.protocol import FLAG_SKIP

    c = Cluster(cfg, workers=3)
    c.start()
    sh = c.layout.shards[0]
    for t in range(cfg.steps):
        for w in range(c.W):
            node = c.nodes[w]
            loss, grad = node.compute(c.task.loss, c.task.batch(w, c.W, t))
            if w == hostile and t >= 2:
                grad = grad.clone()
                j = int(grad[sh.start : sh.stop].abs().argmax()) + sh.start
                grad.view(torch.int32)[j] ^= 1 << 30  # 1e-2 -> ~3e36, still a finite float32
            msgs = node.push(t, grad, loss)
            if w == hostile and t >= 2 and skip_instead:
                msgs[0] = (0, build(MsgType.PUSH, shard=0, worker=w, step=t, flags=FLAG_SKIP))
            c.send(w, msgs)
        for w in range(c.W):
            c.deliver(w, t)
    return c


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_with_a_flipped_exponent_is_dropped_counted_and_named(mode, caplog):
    # before: the server applied it (the red-team's MPI run: digits accuracy 85.8% -> 20.6%)
    cfg = _cfg(codec="none", mode=mode, steps=8)
    assert cfg.max_push_norm == 1e3  # the default
    with caplog.at_level("WARNING", logger="commpress"):
        c = _run_with_hostile_worker(cfg, hostile=2)
    rank = c.S + 2
    assert c.servers[0].stats.implausible == {rank: 6}  # steps 2..7, on the shard it corrupted
    assert c.servers[1].stats.implausible == {}
    assert gather_stats([sv.stats.as_dict() for sv in c.servers])["implausible"] == 6
    assert f"dropped a push of worker 2 (rank {rank})" in caplog.text and "exceeds 1000 x the running norm" in caplog.text
    assert "PUSH at step 7: norm" in c.servers[0].last_rejected[2]
    # dropped exactly like a skip push: the run goes on with the other workers' gradients
    skipped = _run_with_hostile_worker(cfg, hostile=2, skip_instead=True)
    assert torch.equal(c.params(), skipped.params())
    # without the bound the corrupted value is applied
    off = _run_with_hostile_worker(_cfg(codec="none", mode=mode, steps=8, max_push_norm=0), hostile=2)
    assert off.servers[0].stats.implausible == {}
    assert not bool(torch.isfinite(off.params()).all()) or float((off.params() - c.params()).abs().max()) > 1e6


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("codec", ["none", "topk:ratio=0.1", "sign"])
def test_the_default_push_bound_leaves_an_honest_run_bit_identical(mode, codec):
    runs = []
    for bound in (1e3, 0):
        c = Cluster(_cfg(codec=codec, mode=mode, max_push_norm=bound), workers=3)
        c.start()
        for t in range(c.cfg.steps):
            c.sync_step(t)
        assert all(sv.stats.implausible == {} for sv in c.servers)
        runs.append(c.params())
    assert torch.equal(runs[0], runs[1])


def test_max_push_norm_is_checked_and_reaches_the_cli():
    from commpress.ps.__main__ import build_parser as parser
    from commpress.ps.__main__ import config_from

    for bad in (-1, 0.5, float("inf"), float("nan"), True, "10"):
        with pytest.raises(ConfigError, match="max_push_norm"):
            _cfg(max_push_norm=bad)
    assert config_from(parser().parse_args(["--max-push-norm", "50"])).max_push_norm == 50
    assert config_from(parser().parse_args([])).max_push_norm == 1e3


# ----- workers and servers together: the worker's state machine over its channels ----------------
def _drive(c, runs):
    """Deliver every message in send order between ``c.servers`` and ``runs``; what mpi_loop does, serially."""
    from collections import deque

    queue = deque((dest, c.S + w, msg) for w, run in enumerate(runs) for dest, msg in run.begin())
    rejected = 0
    while queue:
        dest, src, msg = queue.popleft()
        buf = msg.numpy() if isinstance(msg, torch.Tensor) else msg
        if dest < c.S:
            try:
                out = c.servers[dest].handle(src, buf)
            except ProtocolError:
                rejected += 1
                continue
            queue.extend((d, dest, m) for d, m in out)
            continue
        run = runs[dest - c.S]
        run.receive(src, buf)
        if not run.waiting and not run.finished:
            queue.extend((d, dest, m) for d, m in run.advance())
    return rejected


@pytest.mark.parametrize("mode, local_steps", [("sync", 0), ("async", 0), ("ssp", 0), ("sync", 2), ("ssp", 2)])
def test_worker_runs_and_servers_train_together_without_mpi(mode, local_steps):
    cfg = _cfg(codec="topk:ratio=0.1", mode=mode, steps=6, staleness=1, checkpoint_every=4, local_steps=local_steps)
    by_hand = Cluster(cfg)  # the same run, messages passed by hand
    by_hand.start()
    for t in range(cfg.steps):
        by_hand.sync_step(t)
    c = Cluster(cfg)
    saved, seen = [], []

    def on_step(w, step):  # after the replies of a step: the worker's copy is the servers' replica
        seen.append((w, step))
        if mode == "sync":
            for sh, sv in zip(c.layout.shards, c.servers):
                assert torch.equal(c.nodes[w].flat[sh.start : sh.stop], sv.replica[BROADCAST])

    runs = [WorkerRun(node, loss=c.task.loss, batch=c.task.batch, workers=c.W,
                      save=lambda step, state, w=w: saved.append((w, step)),
                      faults=[Fault("corrupt", 1, step=2)] if w == 1 else (),
                      on_step=lambda step, w=w: on_step(w, step))
            for w, node in enumerate(c.nodes)]
    assert _drive(c, runs) == 1  # the corrupt copy; the honest push went through
    assert all(run.finished and run.outcome.stopped is None and run.outcome.steps_done == cfg.steps for run in runs)
    assert all(sv.finished() and sv.progress() == cfg.steps for sv in c.servers)
    assert sorted(saved) == [(0, 4), (0, 6), (1, 4), (1, 6)]
    assert sorted(seen) == [(w, t) for w in range(c.W) for t in range(1, cfg.steps + 1)]
    for node in c.nodes:  # the final PULL: every worker holds the servers' parameters exactly
        assert torch.equal(node.flat, c.params())
    if mode == "sync":  # one order of arrival: bit-identical to the hand-driven run
        assert torch.equal(c.params(), by_hand.params())


def test_a_worker_run_leaves_on_stop_and_says_goodbye():
    cfg = _cfg(codec="none", mode="async", servers=1, timeout=5.0)
    c = Cluster(cfg)
    runs = [WorkerRun(node, loss=c.task.loss, batch=c.task.batch, workers=c.W) for node in c.nodes]
    for w, run in enumerate(runs):
        c.send(w, run.begin())
    for w, run in enumerate(runs):
        for s, reply in c.queue[w]:
            run.receive(s, reply.numpy())
        c.queue[w].clear()
    c.send(0, runs[0].advance())  # worker 0 pushes step 0; worker 1 stays silent
    c.clock.t += 100.0
    c.route(0, c.servers[0].check())  # worker 1 is dropped...
    c.route(0, c.servers[0].check())
    for w, run in enumerate(runs):
        for s, reply in c.queue[w]:
            run.receive(s, reply.numpy())
        c.queue[w].clear()
    assert c.servers[0].dropped.keys() == {0, 1}  # both silent for 100 s
    bye = runs[1].advance()  # ...told to stop, it leaves with a goodbye
    assert runs[1].finished and "dropped by server 0" in runs[1].outcome.stopped
    assert [MsgType(int(m[5])) for _, m in bye] == [MsgType.BYE]
    c.send(1, bye)
    assert 1 in c.servers[0].done
