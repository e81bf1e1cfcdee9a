"""The DDP communication hook: compress each bucket per parameter, reduce, decode in place."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations and
# compares them with the real objects (``dist.GradBucket``), not with strings.

import time

import torch
import torch.distributed as dist

from .. import comm
from .state import CompressionState


def hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one DDP gradient bucket with commpress; register with ``register_comm_hook``.

    Steps, for each bucket DDP hands over (in bucket-index order, the same on every rank):

    1. map the bucket's parameters to their names and plans (cached per bucket layout, so
       DDP's bucket rebuild after step 1 is harmless); with ``momentum``, replace each
       gradient by its local velocity (momentum correction);
    2. during warm-up (``state.step < state.warmup_steps``): a plain dense all-reduce;
       otherwise derive each parameter's seed from ``(state.seed, step, parameter index)``;
    3. with ``codec="auto"`` (:mod:`commpress.ddp.auto`), reduce the bucket dense or as fp16
       instead when that is the bucket's current choice (flushing residuals on a switch);
       otherwise run the codec's collective algorithm (:func:`commpress.comm.run`): error
       feedback and encoding happen here, on DDP's thread, and every collective is issued
       from here in order; the returned future decodes the average into ``bucket.buffer()``;
    4. every few steps, measure residual vs input norms for the divergence guard
       (:mod:`commpress.optim.guard`); after the last bucket, let it decide and advance ``state.step``.

    A failure on this rank (bytes it cannot decode, an error in the steps above) is posted to
    every rank (:class:`commpress.comm.faults.FaultChannel`): every rank raises
    :class:`~commpress.errors.RankFailedError` naming this rank, the step and the bucket
    within milliseconds, and keeps raising at every later step.

    Example::

        state = commpress.ddp.CompressionState(ddp_model, "sign", block_size=256)
        ddp_model.register_comm_hook(state, commpress.ddp.hook)
    """
    # the futures and waits of these collectives are failable by the channel; a failure is posted
    with state.faults.guarded(f"step {state.step}, bucket {bucket.index()}"):
        return _reduce(state, bucket, bucket.buffer())


def _reduce(state: CompressionState, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Steps 1-4 of :func:`hook` for one bucket; the future its collectives complete."""
    plan = state.bucket_plan(bucket.parameters(), buffer.numel())
    state.before_bucket()
    warmup_codec = state.warmup_codec_now()
    dense = warmup_codec is None and state.dense_step()
    option = None
    if state.auto is not None and warmup_codec is None and not dense:
        option = state.auto.choose(plan, bucket.index())
        if option == "compressed" and state.momentum_in_optimizer:
            option = "dense"  # decided mid-step: it compresses once the hook has the momentum back
    compressing = warmup_codec is None and not dense and option in (None, "compressed")
    if state.keeping_first_gradients:  # no optimizer= yet: its first step's local gradients start the velocities
        state.keep_first_gradients(plan, buffer)
    if state.momentum_rules and not state.momentum_in_optimizer:
        state.apply_momentum(plan, buffer, compressing=compressing)
    if state.modes:  # the user's own optimizer modes (commpress.optim.OptimizerMode)
        state.apply_modes(plan, buffer, compressing)
    if warmup_codec is not None:  # warm-up through an unbiased codec: no residuals to keep or flush
        seeds = [state.param_seed(p) for p in plan.params]
        assert state.warmup_impl is not None  # bound with the warm-up codec (hierarchical on several nodes)
        fut = comm.run(state.warmup_impl, buffer, plan.slots(warmup_codec, seeds, None),
                       group=state.process_group, stats=state.counters)
    elif dense:
        state.flush_residuals(plan, buffer)  # a guard's dense step sends what was held back
        fut = comm.allreduce_mean(buffer, group=state.process_group, stats=state.counters)
    elif state.auto is not None and option != "compressed":
        fut = state.auto.reduce(plan, buffer, option or "dense")
    else:
        start = time.perf_counter()
        measured = state.guard.due(state.step)
        input_sq = state.norms_sq(plan, buffer) if measured else 0.0
        seeds = [state.param_seed(p) for p in plan.params]
        slots = plan.slots(state.codec, seeds, state.feedback)
        fut = comm.run(
            state.algorithm_impl, buffer, slots, group=state.process_group,
            server_feedback=state.server_feedback, stats=state.counters,
        )
        if measured:  # the encode above updated the residuals
            state.guard.add(state.norms_sq(plan, None), input_sq)
        if state.momentum_rules:
            state.mask_momentum(plan)
        if state.auto is not None:
            fut = state.auto.timed(plan, "compressed", start, fut)
    if bucket.is_last():
        state.end_step(buffer.device)
    return fut
