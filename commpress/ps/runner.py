"""``run()``: start a parameter-server run on an MPI communicator, from a :class:`Task`.

Every rank calls :func:`run` with the same task and config. Ranks ``0 .. S-1`` serve, the
rest train; at the end the servers send their shards to rank 0, which evaluates the final
model. :func:`reference_train` is the single-process run the sync mode must reproduce. The
roles, checkpoints and results are here; every MPI loop is in :mod:`.mpi_loop`.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint, mpi_loop
from .config import PSConfig, codec_spec
from .errors import ConfigError, PSError
from .faults import Fault, parse_fault
from .preempt import StopAgreement
from .protocol import BROADCAST, DENSE, MsgType, build, segment_parts
from .server import ShardServer
from .sharding import Layout, fingerprint
from .stats import EventLog, gather_stats
from .transport import cuda_aware
from .worker import WorkerNode, WorkerOutcome, WorkerRun, round_steps

EXIT_ABANDONED = 5  #: a dropped worker never exited, so rank 0 had to abort the job


@dataclass
class Task:
    """What to train: plug in your own model, data, loss and optimizer.

    Attributes:
        model: builds the model; called on every rank after ``torch.manual_seed(seed)``, so
            every rank builds the same initial parameters.
        loss: ``loss(model, batch) -> scalar tensor`` (mean over the batch).
        batch: ``batch(worker, workers, step) -> batch``: worker ``worker``'s batch at ``step``,
            a pure function of its arguments (that makes runs reproducible and resumable).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (runs on the servers, over
            the pieces of their shard; element-wise optimizers such as SGD and Adam behave
            exactly as on the whole model).
        evaluate: optional ``evaluate(model) -> {metric: value}``, run on rank 0 at the end.
        merge: optional ``merge([batch, ...]) -> batch`` joining worker batches, used by
            :func:`reference_train` to train on their union.
    """

    model: Callable[[], torch.nn.Module]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    batch: Callable[[int, int, int], Any]
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None
    merge: Callable[[list[Any]], Any] | None = None


@dataclass
class RunResult:
    """What :func:`run` returns on each rank.

    ``params`` is the final flat parameter vector on rank 0 and on every worker that finished
    (None elsewhere); ``metrics`` is ``task.evaluate``'s output on rank 0; ``stats`` holds the
    totals over all servers on rank 0 (the server's own counters on other servers, the
    worker's byte counts on workers).
    """

    role: str
    rank: int
    index: int
    layout: Layout
    params: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    seconds: float = 0.0
    stopped: str | None = None
    abandoned: list[int] = field(default_factory=list)
    #: the step every rank stopped after on a SIGTERM (:mod:`.preempt`), or None
    preempted: int | None = None

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the final parameters into ``model`` (same architecture) and return it."""
        if self.params is None:
            raise PSError(f"rank {self.rank} holds no final parameters")
        self.layout.load(model, self.params)
        return model


@dataclass(frozen=True)
class StepView:
    """What an ``on_step`` callback of :func:`run` sees on one rank after a step (read, never write).

    ``step`` counts completed steps. A worker's view comes once the servers' replies of its step
    were applied: ``params`` is its flat parameter vector (what its model computes with). A
    server's view comes once its progress (sync: its step; async/ssp: the slowest live
    worker's clock) advanced, after the replies went out: ``params`` is its shard of the
    parameters and, in sync mode, ``replica`` the shard as every worker holds it after that
    reply (with a compressing pull codec it trails ``params`` by what the codec has not sent
    yet). ``layout`` says which part of the flat vector each shard is. The tensors are the
    run's own: a callback that changes them changes the training.
    """

    role: str
    index: int
    step: int
    params: torch.Tensor
    layout: Layout
    replica: torch.Tensor | None = None


StepHook = Callable[[StepView], None]


def _log(rank: int, text: str) -> None:
    print(f"[commpress.ps rank {rank}] {text}", file=sys.stderr, flush=True)


def run(
    task: Task,
    config: PSConfig | None = None,
    comm: Any = None,
    *,
    abort_on_error: bool = True,
    on_step: StepHook | None = None,
) -> RunResult:
    """Run a parameter-server training on ``comm`` (default ``MPI.COMM_WORLD``); call on every rank.

    Fatal errors (a worker timing out in sync mode, a protocol breach by a server, a bad
    configuration) are printed naming the rank and, with ``abort_on_error``, end the whole
    job with ``comm.Abort(code)``: a rank that simply raised would leave the others waiting.

    ``on_step(view)`` (a :class:`StepView`) runs on this rank after each step, between
    messages, for monitoring (memory, digests of the parameters): it adds no message to the
    run and must not send on ``comm``.
    """
    cfg = config or PSConfig()
    world = comm if comm is not None else mpi_loop.world()
    rank = world.Get_rank()
    try:
        cfg.validate()
        with mpi_loop.private(world) as comm_dup:
            return _run(task, cfg, comm_dup, on_step)
    except Exception as exc:
        if not abort_on_error:
            raise
        code = exc.exit_code if isinstance(exc, PSError) else 1
        kind = "" if isinstance(exc, PSError) else f"{type(exc).__name__}: "
        _log(rank, f"error: {kind}{exc}")
        mpi_loop.abort(world, code)
        raise  # not reached: Abort ends the process


def _faults(cfg: PSConfig) -> list[Fault]:
    return [f if isinstance(f, Fault) else parse_fault(str(f)) for f in cfg.faults]


def _run(task: Task, cfg: PSConfig, comm: Any, on_step: StepHook | None = None) -> RunResult:
    size, rank = comm.Get_size(), comm.Get_rank()
    S = cfg.servers
    W = size - S
    if W < 1:
        raise ConfigError(f"{size} rank(s) for {S} server(s): start at least {S + 1} ranks (mpirun -n {S + 1} ...)")
    torch.manual_seed(cfg.seed)
    model = task.model()
    layout = Layout.from_model(model, S, cfg.min_compress)
    fp = fingerprint(layout.describe(), cfg.describe(), W)
    meta = {"world": size, "servers": S, "workers": W, "mode": cfg.mode, "fingerprint": fp,
            "codec": codec_spec(cfg.push_codec()), "pull_codec": codec_spec(cfg.reply_codec())}
    ckpt_dir = cfg.checkpoint
    resume_step: int | None = None
    if ckpt_dir:
        has_meta = os.path.exists(os.path.join(ckpt_dir, "meta.json"))
        saved = checkpoint.steps_by_rank(ckpt_dir)
        if cfg.resume:
            if has_meta:
                checkpoint.check_meta(ckpt_dir, meta)
            if cfg.mode == "sync":
                resume_step = checkpoint.latest_complete(ckpt_dir, size)
                if resume_step is None and saved:
                    raise ConfigError(f"{ckpt_dir} holds checkpoints, but no step that all {size} ranks saved")
            else:
                resume_step = checkpoint.latest_own(ckpt_dir, rank)
            if rank == 0:
                _log(rank, f"resuming from step {resume_step}" if resume_step is not None
                     else f"no checkpoint in {ckpt_dir}: starting from step 0")
        elif saved and rank == 0:  # rank 0 checks before it serves: no rank of this run saved yet
            raise ConfigError(f"{ckpt_dir} already holds checkpoints: pass --resume (resume=True) or use an empty directory")
        if rank == 0 and not has_meta:
            checkpoint.write_meta(ckpt_dir, meta)

    def save(step: int, state: dict[str, Any]) -> None:
        assert ckpt_dir is not None
        checkpoint.save(ckpt_dir, rank, step, state)

    t0 = time.monotonic()
    stop = StopAgreement(comm) if cfg.preemption else None
    try:
        if rank < S:
            result = _serve(task, cfg, comm, layout, model, rank, W, fp, resume_step, save if ckpt_dir else None, t0, stop,
                            on_step)
        else:
            result = _work(task, cfg, comm, layout, model, rank - S, W, fp, resume_step, save if ckpt_dir else None, t0,
                           stop, on_step)
    finally:
        if stop is not None:
            stop.close()
    if stop is not None and stop.stop_step is not None:
        result.preempted = stop.stop_step
        if rank == 0:
            _log(rank, f"preempted: every rank stopped after step {stop.stop_step}"
                 + (f"; checkpoint in {ckpt_dir} (continue with --resume)" if ckpt_dir
                    else "; nothing saved (no --checkpoint directory)"))
    return result


def _serve(task: Task, cfg: PSConfig, comm: Any, layout: Layout, model: torch.nn.Module, s: int, W: int,
           fp: int, resume_step: int | None, save: Callable[[int, dict[str, Any]], None] | None,
           t0: float, stop: StopAgreement | None = None, on_step: StepHook | None = None) -> RunResult:
    flat = layout.flatten(p for _, p in model.named_parameters() if p.requires_grad)
    shard = layout.shards[s]
    log = EventLog(cfg.log_dir, s)
    # workers that hand MPI device buffers cannot checksum them; every other push must carry a CRC
    device_buffers = torch.device(cfg.device).type == "cuda" and cuda_aware(cfg.cuda_aware)
    # local_steps: the task's optimizer runs the workers' inner steps, the servers the outer one
    optimizer = cfg.outer_optimizer() if cfg.local_steps else task.optimizer
    server = ShardServer(layout, s, cfg, W, flat[shard.start : shard.stop], optimizer,
                         fingerprint=fp, log=log, require_crc=not device_buffers)
    if resume_step is not None and cfg.checkpoint:
        server.load_state_dict(checkpoint.load(cfg.checkpoint, comm.Get_rank(), resume_step, like=server.state_dict()))
    bar = None
    if s == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=server.progress(), desc=f"commpress.ps {cfg.mode}",
                   unit="step", file=sys.stderr, mininterval=0.25, dynamic_ncols=True)
    def view(step: int) -> None:
        assert on_step is not None  # replica: sync mode's copy of what every worker holds of the shard
        on_step(StepView("server", s, step, server.x, layout, server.replica.get(BROADCAST)))

    try:
        abandoned = mpi_loop.serve(comm, server, bar=bar, save=save, stop=stop, on_step=view if on_step else None)
    finally:
        if bar is not None:
            bar.close()
        log.close()
    own = server.stats.as_dict()
    result = RunResult("server", comm.Get_rank(), s, layout, stats=own, steps_done=server.progress(),
                       seconds=time.monotonic() - t0, abandoned=abandoned)
    # final shards and stats to rank 0
    shard_msg = build(MsgType.SHARD, shard=s, worker=0, step=server.progress(),
                      parts=segment_parts([DENSE.encode(server.x[shard.local(seg)]) for seg in shard.segments]))
    stats_msg = build(MsgType.STATS, shard=s, worker=0, step=server.progress(),
                      parts=[json.dumps(own).encode()])
    if s != 0:
        mpi_loop.send_final(comm, s, [shard_msg, stats_msg], 2 * cfg.timeout + 10)
        return result
    full = torch.empty(layout.numel, dtype=layout.dtype)
    full[shard.start : shard.stop] = server.x
    all_stats = [own, *mpi_loop.gather_final(comm, layout, full, 2 * cfg.timeout + 10)]
    result.params = full
    result.stats = gather_stats(all_stats)
    result.stats["per_server"] = all_stats
    result.abandoned = sorted(set(abandoned))
    if task.evaluate is not None:
        layout.load(model, full)
        model.eval()
        with torch.no_grad():
            result.metrics = {k: float(v) for k, v in task.evaluate(model).items()}
    return result


def _work(task: Task, cfg: PSConfig, comm: Any, layout: Layout, model: torch.nn.Module, w: int, W: int,
          fp: int, resume_step: int | None, save: Callable[[int, dict[str, Any]], None] | None,
          t0: float, stop: StopAgreement | None = None, on_step: StepHook | None = None) -> RunResult:
    try:
        device = torch.device(cfg.device)
    except RuntimeError as exc:
        raise ConfigError(f"device {cfg.device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"worker {w}: device {cfg.device!r} requested but CUDA is not available")
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else w % max(torch.cuda.device_count(), 1))
    model = model.to(device)
    device_buffers = device.type == "cuda" and cuda_aware(cfg.cuda_aware)
    node = WorkerNode(layout, w, cfg, model, fingerprint=fp, checksum=not device_buffers,
                      inner_optimizer=task.optimizer if cfg.local_steps else None)
    start = 0
    if resume_step is not None and cfg.checkpoint:
        node.load_state_dict(checkpoint.load(cfg.checkpoint, comm.Get_rank(), resume_step, like=node.state_dict()))
        start = resume_step

    def view(step: int) -> None:
        assert on_step is not None
        on_step(StepView("worker", w, step, node.flat, layout))

    run = WorkerRun(node, loss=task.loss, batch=task.batch, workers=W, start=start, faults=_faults(cfg), save=save,
                    on_step=view if on_step else None)
    outcome: WorkerOutcome = mpi_loop.work(comm, run, device_buffers=device_buffers, stop=stop)
    finished = outcome.stopped is None and not outcome.vanished
    return RunResult(
        "worker", comm.Get_rank(), w, layout,
        params=node.flat.detach().cpu().clone() if finished else None,
        stats={"push_bytes": node.push_bytes, "reply_bytes": node.reply_bytes,
               "skipped_steps": node.skipped_steps, "device_buffers": device_buffers},
        steps_done=outcome.steps_done, seconds=time.monotonic() - t0, stopped=outcome.stopped,
    )


def finish(result: RunResult, comm: Any = None) -> None:
    """End the job when a dropped worker never exited (it would keep ``mpirun`` waiting).

    Call after :func:`run` on every rank; on rank 0 with abandoned workers it prints their ranks
    and aborts with :data:`EXIT_ABANDONED` (training itself completed).
    """
    if result.rank == 0 and result.abandoned:
        _log(0, f"dropped worker rank(s) {result.abandoned} never exited; aborting the job to release them "
                f"(training completed; exit code {EXIT_ABANDONED})")
        mpi_loop.abort(comm or mpi_loop.world(), EXIT_ABANDONED)


def reference_train(task: Task, workers: int, steps: int, seed: int = 0, config: PSConfig | None = None) -> torch.Tensor:
    """Single-process training on the union of the workers' batches; returns the flat parameters.

    Uses ``task.merge`` to join batches when given, else averages the workers' losses (the
    same thing for equal batch sizes). Sync mode with codec ``none`` reproduces this. With a
    ``config`` of ``local_steps`` H: DiLoCo in one process (every worker's H inner steps from the
    same parameters, the outer optimizer on the mean of their pseudo-gradients), which sync mode
    with codec ``none`` reproduces.
    """
    if config is not None and config.local_steps:
        return _reference_local(task, workers, steps, seed, config)
    torch.manual_seed(seed)
    model = task.model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = task.optimizer(params)
    for t in range(steps):
        batches = [task.batch(w, workers, t) for w in range(workers)]
        opt.zero_grad(set_to_none=True)
        if task.merge is not None:
            loss = task.loss(model, task.merge(batches))
        else:
            loss = sum((task.loss(model, b) for b in batches), torch.zeros(())) / workers
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def _reference_local(task: Task, workers: int, steps: int, seed: int, cfg: PSConfig) -> torch.Tensor:
    """:func:`reference_train` with ``local_steps``: the workers' inner optimizers keep their state across syncs."""
    torch.manual_seed(seed)
    models = [task.model()]
    models += [copy.deepcopy(models[0]) for _ in range(workers - 1)]
    inner = [task.optimizer([p for p in m.parameters() if p.requires_grad]) for m in models]
    layout = Layout.from_model(models[0], cfg.servers, cfg.min_compress)
    x = torch.nn.Parameter(flat_of(models[0]))
    outer = cfg.outer_optimizer()([x])
    for t in range(steps):
        deltas = []
        for w, (model, opt) in enumerate(zip(models, inner)):
            layout.load(model, x.detach())  # every worker starts the sync from the servers' parameters
            for i in round_steps(t, cfg.local_steps):
                opt.zero_grad(set_to_none=True)
                task.loss(model, task.batch(w, workers, i)).backward()
                opt.step()
            deltas.append(x.detach() - flat_of(model))
        total = deltas[0].clone()
        for d in deltas[1:]:
            total.add_(d)  # in worker order, as the servers sum
        x.grad = total.div_(workers)
        outer.step()
    return x.detach().clone()


def flat_of(model: torch.nn.Module) -> torch.Tensor:
    """The trainable parameters of ``model`` as one flat tensor (layout order)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


__all__ = ["EXIT_ABANDONED", "RunResult", "StepHook", "StepView", "Task", "finish", "flat_of", "reference_train", "run"]
