"""Multi-rank workers for tests/test_ddp_optim.py: the optimizer path of commpress.ddp.register."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress.ddp
import commpress.optim

from ddp_workers import (
    assert_all_ranks,
    assert_same_across_ranks,
    batch,
    flat_params,
    make_ddp,
    train_step,
)


def digits_split(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: 1400 training images split over ranks, 397 held out."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1400][rank::world], y[:1400][rank::world], x[1400:], y[1400:]


def train_digits(rank: int, world: int, codec: str | None, opts: dict, epochs: int, optim: dict,
                 pass_optimizer: bool = True) -> float:
    """Held-out accuracy of the digits MLP trained with the user's SGD, as a user registers it
    (``pass_optimizer=False``: without ``optimizer=``, the optimizer found at its first step)."""
    xtr, ytr, xte, yte = digits_split(rank, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=1)
    opt = torch.optim.AdamW(ddp.parameters(), **optim) if "betas" in optim else torch.optim.SGD(ddp.parameters(), **optim)
    if codec is not None:
        commpress.ddp.register(ddp, codec, **({"optimizer": opt} if pass_optimizer else {}), **opts)
    for _ in range(epochs):
        for i in range(0, len(xtr), 35):
            loss = nn.functional.cross_entropy(ddp(xtr[i : i + 35]), ytr[i : i + 35])
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert_same_across_ranks(ddp, f"{codec} {opts}")
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def worker_tracks_dense(rank: int, world: int, out: str, sgd_epochs: int, adamw_epochs: int) -> None:
    """Dense vs every biased codec with the user's SGD momentum (plain and Nesterov) and AdamW."""
    results = {}
    for optim in ({"lr": 0.1, "momentum": 0.9}, {"lr": 0.05, "momentum": 0.9, "nesterov": True},
                  {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01}):
        tag = "adamw" if "betas" in optim else "nesterov" if optim.get("nesterov") else "momentum"
        epochs = adamw_epochs if tag == "adamw" else sgd_epochs
        results[f"dense/{tag}"] = train_digits(rank, world, None, {}, epochs, optim)
        for codec, opts in (("topk", {"ratio": 0.01}), ("sign", {})):
            results[f"{codec}/{tag}"] = train_digits(rank, world, codec, opts, epochs, optim)
        if tag == "momentum":  # registered as PyTorch's hooks are, without optimizer=
            results[f"sign-found/{tag}"] = train_digits(rank, world, "sign", {}, epochs, optim, pass_optimizer=False)
    if rank == 0:
        torch.save(results, Path(out, "acc.pt"))


def worker_dense_equivalence(rank: int, world: int) -> None:
    """With nothing dropped (top-k of everything), the hook's momentum is the optimizer's."""
    for optim in ({"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {"momentum": 0.8, "dampening": 0.5}):
        ref = make_ddp()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, **optim)
        ddp = make_ddp()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, **optim)
        state = commpress.ddp.register(ddp, "topk", optimizer=opt, ratio=1.0, min_numel=0, dense_1d=False)
        assert all(g["momentum"] == 0 and g["commpress_momentum"]["momentum"] == optim["momentum"]
                   for g in opt.param_groups)
        assert len(state.momentum_rules) == len(list(ddp.parameters()))
        for step in range(6):
            train_step(ref, ref_opt, rank, step)
            train_step(ddp, opt, rank, step)
        diff = float((flat_params(ref) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{optim}: hook momentum differs from SGD momentum by {diff}")


def worker_value_blind_gain(rank: int, world: int) -> None:
    """Random-k (value-blind) with nothing dropped: compressed parameters get SGD without
    momentum at ``lr * gain``, dense (1-D) ones keep the hook's velocity, as SGD momentum."""
    for optim in ({"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {"momentum": 0.8, "dampening": 0.5}):
        rule = commpress.optim.MomentumRule(optim["momentum"], optim.get("dampening", 0.0), bool(optim.get("nesterov")))
        ref = make_ddp()
        weights = [p for p in ref.parameters() if p.dim() > 1]
        biases = [p for p in ref.parameters() if p.dim() <= 1]
        ref_opt = torch.optim.SGD([{"params": weights, "lr": 0.05 * rule.gain, "momentum": 0.0},
                                   {"params": biases, "lr": 0.05, **optim}], lr=0.05)
        ddp = make_ddp()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, **optim)
        state = commpress.ddp.register(ddp, "randomk", optimizer=opt, ratio=1.0, min_numel=0, warmup_steps=0)
        for step in range(6):
            train_step(ref, ref_opt, rank, step)
            train_step(ddp, opt, rank, step)
        compressed = {n for n, p in ddp.module.named_parameters() if p.dim() > 1}
        assert_all_ranks(not compressed & set(state.velocity), f"{optim}: a value-blind parameter kept a velocity")
        diff = float((flat_params(ref) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{optim}: random-k's momentum gain differs from SGD at lr*gain by {diff}")


def worker_value_blind_warmup(rank: int, world: int) -> None:
    """Random-k's dense warm-up steps are SGD momentum with a true velocity; at the first
    compressed step the velocity's pending displacement (``rule.pending * u``) joins the
    gain-scaled gradient, and from then on it is SGD at ``lr * gain`` (nothing dropped)."""
    warm = 3
    for optim in ({"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {"momentum": 0.8, "dampening": 0.5}):
        rule = commpress.optim.MomentumRule(optim["momentum"], optim.get("dampening", 0.0), bool(optim.get("nesterov")))
        ref = make_ddp()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, **optim)
        ddp = make_ddp()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, **optim)
        state = commpress.ddp.register(ddp, "randomk", optimizer=opt, ratio=1.0, min_numel=0, warmup_steps=warm,
                                       warmup_codec="dense")
        for step in range(warm):
            train_step(ref, ref_opt, rank, step)
            train_step(ddp, opt, rank, step)
        diff = float((flat_params(ref) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{optim}: random-k's warm-up differs from SGD momentum by {diff}")
        weights = [p for p in ref.parameters() if p.dim() > 1]
        biases = [p for p in ref.parameters() if p.dim() <= 1]
        owed = [ref_opt.state[p]["momentum_buffer"].clone() for p in weights]
        gain_opt = torch.optim.SGD([{"params": weights, "lr": 0.05 * rule.gain, "momentum": 0.0},
                                    {"params": biases, "lr": 0.05, **optim}], lr=0.05)
        for p in biases:
            gain_opt.state[p]["momentum_buffer"] = ref_opt.state[p]["momentum_buffer"]
        for step in range(warm, warm + 3):
            train_step(ref, gain_opt, rank, step)
            train_step(ddp, opt, rank, step)
            if step == warm:  # the first compressed step also moves what the velocities still owe
                with torch.no_grad():
                    for p, u in zip(weights, owed):
                        p.sub_(u, alpha=0.05 * rule.pending)
        compressed = {n for n, p in ddp.module.named_parameters() if p.dim() > 1}
        assert_all_ranks(not compressed & set(state.velocity), f"{optim}: a value-blind parameter kept a velocity")
        diff = float((flat_params(ref) - flat_params(ddp)).abs().max())
        assert_all_ranks(diff < 1e-5, f"{optim}: random-k after its warm-up differs from SGD at lr*gain by {diff}")


@contextlib.contextmanager
def _captured_warnings() -> Iterator[list[str]]:
    """The messages the ``commpress`` logger warns with inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Collect()
    log = logging.getLogger("commpress")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


def worker_momentum_masking(rank: int, world: int) -> None:
    """DGC's masking zeroes the velocity exactly at the entries just sent (where the residual was
    emptied), and nowhere else: top-k with SGD momentum, random-k through Adam's compressed momentum."""
    cases = (
        ("topk", {"ratio": 0.05, "momentum_masking": True}, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
        ("randomk", {"ratio": 0.05, "warmup_steps": 2}, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    )
    for codec, opts, make_opt in cases:
        ddp = make_ddp()
        opt = make_opt(ddp.parameters())
        with _captured_warnings() as warned:
            state = commpress.ddp.register(ddp, codec, optimizer=opt, min_numel=0, **opts)
        # random-k with Adam is allowed, but the user is told it tracks dense poorly
        assert any("prefer \"topk\" with Adam" in m for m in warned) == (codec == "randomk"), (codec, warned)
        assert state.momentum_masking, codec
        for step in range(4):
            train_step(ddp, opt, rank, step)
            checked = 0
            for name, p in ddp.module.named_parameters():
                u, e = state.velocity.get(name), state.feedback.residual(name)
                if p.dim() < 2 or u is None or e is None:
                    continue
                zero_u, emptied = u == 0, e.reshape(-1) == 0
                assert bool(emptied.any()), (codec, name)
                assert torch.equal(zero_u, emptied), f"{codec} step {step} {name}: velocity zero at " \
                    f"{int(zero_u.sum())} entries, residual emptied at {int(emptied.sum())}"
                checked += 1
            assert checked or step < 2, (codec, step)  # Adam's compressed momentum starts after warm-up


def worker_checkpoint(rank: int, world: int, phase: str, outdir: str, half: int) -> None:
    """SGD with Nesterov, then AdamW (its compressed-momentum phase), through one checkpoint each."""
    _checkpoint_case(rank, phase, outdir, half, "sgd",
                     lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True), {})
    _checkpoint_case(rank, phase, outdir, half, "adamw",
                     lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), {"warmup_steps": 3})


def _checkpoint_case(rank: int, phase: str, outdir: str, half: int, tag: str, make_opt, opts: dict) -> None:
    """Optimizer path: save model + optimizer + commpress state, resume in fresh processes, compare.

    The optimizer is restored *before* register in the resume phase (the order users often
    choose): its param groups carry the momentum the hook applies, so nothing depends on order.
    """
    ddp = make_ddp()
    opt = make_opt(ddp.parameters())
    path, final = Path(outdir, f"{tag}_rank{rank}.pt"), Path(outdir, f"{tag}_final_rank{rank}.pt")
    start = 0
    if phase == "resume":
        ckpt = torch.load(path, weights_only=True)
        ddp.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        state = commpress.ddp.register(ddp, "sign", optimizer=opt, **opts)
        state.load_state_dict(ckpt["commpress"])
        start = half
    else:
        state = commpress.ddp.register(ddp, "sign", optimizer=opt, **opts)
    for step in range(start, 2 * half):
        if phase == "full" and step == half:
            torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict(),
                        "commpress": state.state_dict()}, path)
        train_step(ddp, opt, rank, step)
    if phase == "full":
        torch.save(flat_params(ddp), final)
    else:
        expected = torch.load(final, weights_only=True)
        assert_all_ranks(torch.equal(expected, flat_params(ddp)), f"{tag}: resumed optimizer-path run differs")


def worker_register_one_rank(rank: int, world: int, out: str) -> None:
    """``register`` under ``if rank == 0`` must end with an error on every rank, never hang."""
    ddp = make_ddp()
    error = ""
    try:
        if rank == 0:
            commpress.ddp.register(ddp, "topk", ratio=0.1, verify_timeout=3)
        for step in range(3):
            ddp(torch.randn(8, 32)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects which error each rank saw
        error = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(error)
    os._exit(0)  # the process group is broken by design here: no orderly teardown


def worker_guard(rank: int, world: int, out: str) -> None:
    """The divergence guard stays quiet on a healthy run and fires on a constructed unstable one."""
    from commpress.optim import DivergenceGuard

    results = {}
    for case, codec, opts in (
        ("healthy", "topk", {"ratio": 0.1}),
        # top-k keeping 1 of 16384 weights: the residual (of velocities) grows every step until it
        # dwarfs the input
        ("unstable", "topk", {"k": 1}),
    ):
        ddp = make_ddp()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        guard = DivergenceGuard(interval=2, threshold=5.0, dense_steps=3)
        state = commpress.ddp.register(ddp, codec, optimizer=opt, divergence_guard=guard, **opts)
        flushed = True
        for step in range(24):
            fired_before = guard.fired
            train_step(ddp, opt, rank, step)
            if guard.fired > fired_before:  # the next step is dense and must flush every residual
                train_step(ddp, opt, rank, step + 100)
                flushed &= state.norms_sq(next(iter(state._bucket_plans.values())), None) == 0.0
        assert_same_across_ranks(ddp, f"guard {case}")
        results[case] = {**{k: v for k, v in state.stats().items() if k.startswith("guard")}, "flushed": flushed}
    if rank == 0:
        torch.save(results, Path(out, "guard.pt"))


def worker_extensions(rank: int, world: int, out: str) -> None:
    """The example codec and algorithm (tests/example_extensions.py) train like dense."""
    import example_extensions

    example_extensions.install()
    results = {"init": flat_params(make_ddp())}
    for codec, algorithm in (("none", "auto"), ("int8-example", "allgather"), ("int8-example", "twophase"),
                             ("int8-example", "scatter-dense-example"), ("sign", "scatter-dense-example")):
        ddp = make_ddp()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if codec != "none":
            commpress.ddp.register(ddp, codec, optimizer=opt, algorithm=algorithm)
        for step in range(30):
            train_step(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"{codec} {algorithm}")
        results[f"{codec}/{algorithm}"] = flat_params(ddp)
    if rank == 0:
        torch.save(results, Path(out, "ext.pt"))


def worker_warmup_codec(rank: int, world: int) -> None:
    """The warm-up runs through 8-bit QSGD by default, dense when asked, or through the named codec."""
    for choice, expect in (("dense", None), (None, "qsgd"), ("qsgd", "qsgd"), ("qsgd:bits=8", "qsgd")):
        ddp = make_ddp()
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        state = commpress.ddp.register(ddp, "topk", optimizer=opt, ratio=0.01, warmup_codec=choice, warmup_steps=3)
        assert (None if state.warmup_codec is None else state.warmup_codec.name) == expect, (choice, state.warmup_codec)
        for step in range(3):  # all warm-up
            train_step(ddp, opt, rank, step)
        s = state.stats()
        assert_same_across_ranks(ddp, f"warm-up {choice}")
        if choice == "qsgd":  # 4-bit levels + norms: well under a third of the dense bytes
            assert s["bytes_sent"] < s["dense_bytes"] / 3, s
        elif choice is None:  # 8-bit levels + norms: under a third of the dense bytes (4 per element)
            assert s["bytes_sent"] < s["dense_bytes"] / 3, s
        elif choice == "dense":
            assert s["bytes_sent"] == s["dense_bytes"], s


def worker_example_mode(rank: int, world: int) -> None:
    """The example optimizer mode (LocalGradientClip): each rank's gradients clipped before the average."""
    import example_extensions

    max_norm = 0.05
    ref = make_ddp()
    local = copy.deepcopy(ref.module)  # this rank's gradients, before any averaging
    ddp = make_ddp()
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    mode = example_extensions.LocalGradientClip(max_norm)
    state = commpress.ddp.register(ddp, "none", modes=[mode])
    before = flat_params(ddp)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(local(x), y).backward()
    expected = []
    for p in local.parameters():
        g = p.grad.detach().reshape(-1).clone()
        norm = float(torch.linalg.vector_norm(g))
        expected.append(g * (max_norm / norm) if norm > max_norm else g)
    want = torch.cat(expected)
    dist.all_reduce(want)
    want /= world
    train_step(ddp, opt, rank, 0)
    moved = before - flat_params(ddp)
    assert_all_ranks(torch.allclose(moved, want, atol=1e-6), f"clipped average differs by {float((moved - want).abs().max())}")
    assert_all_ranks(mode.clipped > 0 and state.stats()["clip_clipped"] == mode.clipped, "clips not counted")
    saved = state.state_dict()
    assert_all_ranks(saved["modes"] == {"clip": {"clipped": mode.clipped}}, f"mode state not saved: {saved.get('modes')}")
    fresh_mode = example_extensions.LocalGradientClip(max_norm)
    fresh = commpress.ddp.register(make_ddp(), "none", modes=[fresh_mode])
    fresh.load_state_dict(saved)
    assert_all_ranks(fresh_mode.clipped == mode.clipped, "mode state not restored")


def worker_discovery(rank: int, world: int) -> None:
    """Registered without ``optimizer=``: the optimizer stepping the model is found at the first
    bucket, or (built only after the first backward) adopted after its first step; either way the
    run is the run with ``optimizer=``; ``optimizer=None``, a subset optimizer and another model's
    optimizer are left alone."""
    # adopted after its first step: sign + the user's SGD momentum, the optimizer built after the
    # first backward (nothing to find at the first bucket)
    ddp = make_ddp()
    state = commpress.ddp.register(ddp, "sign")
    other = nn.Linear(3, 3)  # another model's optimizer stepping first is not adopted
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other(torch.ones(1, 3)).sum().backward()
    other_opt.step()
    assert state.optimizer is None and state.discovery is not None and state.discovery.pending
    assert other_opt.param_groups[0]["momentum"] == 0.9
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()
    assert state.optimizer is None and state.discovery.pending  # no optimizer of this model existed
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    opt.step()
    assert state.optimizer is opt and not state.discovery.pending
    group = opt.param_groups[0]
    assert group["momentum"] == 0 and group["commpress_momentum"]["momentum"] == 0.9, group
    assert len(state.momentum_rules) == len(list(ddp.parameters()))
    assert all(state.momentum_rules[n].nesterov for n in state.momentum_rules)
    # the first step's momentum buffers are the hook's velocities now, not the optimizer's
    assert not any("momentum_buffer" in opt.state[p] for p in ddp.parameters())
    assert set(state.velocity) == set(state.momentum_rules)
    for step in range(1, 6):
        train_step(ddp, opt, rank, step)
        assert_same_across_ranks(ddp, f"discovered step {step}")
    # a discovered run is the run with optimizer=, bit for bit: found at the first bucket (the
    # optimizer built before training, after or before register; AdamW's warm-up then covers
    # step 0), or adopted after its first step with the velocities started from that step's local
    # gradients, not from the optimizer's buffer of the averaged compressed one
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    for codec, opts, make_opt, when in (
        ("topk", {"ratio": 0.05}, sgd, "first bucket"), ("sign", {}, sgd, "first bucket"),
        ("topk", {"ratio": 0.05}, adamw, "first bucket"), ("sign", {}, adamw, "first bucket"),
        ("topk", {"ratio": 0.05}, sgd, "after its step"), ("sign", {}, sgd, "after its step"),
    ):
        runs = []
        for passed in (True, False):
            ddp = make_ddp()
            opt = make_opt(ddp.parameters()) if passed or when == "first bucket" else None
            state = commpress.ddp.register(ddp, codec, **opts, **({"optimizer": opt} if passed else {}))
            if opt is None:  # built after the first backward: adopted after its first step
                x, y = batch(rank, 0)
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt = make_opt(ddp.parameters())
                opt.step()
            for step in range(0 if when == "first bucket" or passed else 1, 6 + (50 if make_opt is adamw else 0)):
                train_step(ddp, opt, rank, step)
            assert state.optimizer is opt, (codec, when, passed)
            runs.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
        assert_all_ranks(torch.equal(runs[0], runs[1]),
                         f"{codec}, {type(opt).__name__}, adopted at the {when}: the discovered run differs from optimizer=")
    # optimizer=None: the optimizer keeps its momentum
    ddp = make_ddp()
    state = commpress.ddp.register(ddp, "sign", optimizer=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        train_step(ddp, opt, rank, step)
    assert state.discovery is None and not state.momentum_rules and opt.param_groups[0]["momentum"] == 0.9
    # two optimizers over halves of the parameters: named in a warning, both left alone
    ddp = make_ddp()
    state = commpress.ddp.register(ddp, "topk", ratio=0.05)
    params = list(ddp.parameters())
    opts = [torch.optim.SGD(params[::2], lr=0.05, momentum=0.9), torch.optim.SGD(params[1::2], lr=0.05, momentum=0.9)]
    with _captured_warnings() as warned:
        opts[0].zero_grad()
        opts[1].zero_grad()
        x, y = batch(rank, 0)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opts[0].step()
        opts[1].step()
    assert any("steps" in m and "of the" in m and "optimizer=" in m for m in warned), warned
    assert state.optimizer is None and not state.discovery.pending and not state.momentum_rules
    assert all(o.param_groups[0]["momentum"] == 0.9 for o in opts)
    # a bad value is a clear error
    try:
        commpress.ddp.register(make_ddp(), "sign", optimizer="sgd")
    except commpress.CodecError as exc:
        assert "optimizer must be" in str(exc), exc
    else:
        raise AssertionError("optimizer='sgd' was accepted")
