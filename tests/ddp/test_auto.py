"""``codec="auto"``: the cost model (numbers in, decision out), the policy's hysteresis, 2-rank runs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import commpress
import commpress.ddp
from commpress.comm.costmodel import (
    DeviceCost,
    Entry,
    Link,
    NodeLinks,
    best,
    calibrate_device,
    compressed_plan,
    fit_link,
    predict,
    predict_hierarchical,
    share_entries,
    wire_time,
)
from commpress.ddp.auto import AutoPolicy, BucketChoice
from commpress.wire.frame import FrameLayout

import auto_workers
import ddp_workers as w

CPU = DeviceCost(encode_s=5e-9, decode_s=1e-9, pass_s=0.3e-9, cast_s=1e-9)
BIG = (Entry(16_777_216, True), Entry(4096, False))  # the 17M MLP's big bucket: a matrix and a bias


def test_link_formulas() -> None:
    link = Link(1e-4, 1e-9)
    assert link.allreduce(1e6, 4) == pytest.approx(6e-4 + 1.5e-3)
    assert link.allgather(1e6, 4) == pytest.approx(3e-4 + 3e-3)
    assert link.alltoall(1e6, 4) == pytest.approx(3e-4 + 0.75e-3)
    assert link.allreduce(1e6, 1) == 0.0
    assert Link.from_gbit(1.0).beta == pytest.approx(8e-9)
    assert Link.from_gbit(10.0).gbit == pytest.approx(10.0)
    with pytest.raises(commpress.CodecError, match="alpha"):
        Link(-1.0, 0.0)
    with pytest.raises(commpress.CodecError, match="encode_s"):
        DeviceCost(math.nan, 0, 0, 0)


def test_fit_link_recovers_alpha_beta() -> None:
    truth = Link(2e-4, 8e-10)
    sizes = [4096.0, 1 << 20, 1 << 23]
    for n in (2, 4):
        fitted = fit_link(sizes, [truth.allreduce(b, n) for b in sizes], n)
        assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
        assert fitted.beta == pytest.approx(truth.beta, rel=1e-6)
    # noise-free latency-only data: no negative bandwidth
    flat = fit_link(sizes, [1e-3, 1e-3, 1e-3], 2)
    assert flat.alpha >= 0 and flat.beta >= 0
    assert flat.allreduce(1 << 23, 2) == pytest.approx(1e-3)
    # the order of the points does not matter
    assert fit_link(sizes[::-1], [truth.allreduce(b, 4) for b in sizes[::-1]], 4) == fitted
    with pytest.raises(commpress.CodecError, match="points"):
        fit_link([1.0], [1.0], 2)


def test_fit_link_reads_the_largest_sizes_rate_through_a_burst() -> None:
    """A token bucket's burst sends its first bytes free: the mid sizes read faster than the link.

    The fitted link must predict a large bucket (67 MB) at the link's real rate, within 2%, where a
    fit through every point (the burst as extra bandwidth) would read it faster.
    """
    truth, burst = Link(3e-4, 8e-9), float(1 << 20)  # 1 Gbit/s, 1 MB free per collective
    sizes = [4096.0, 1 << 20, 1 << 23, 1 << 25]
    for n in (2, 4):
        def shaped(b: float, n: int = n) -> float:
            return 2 * (n - 1) * truth.alpha + max(2 * (n - 1) / n * b - burst, 0.0) * truth.beta

        fitted = fit_link(sizes, [shaped(b) for b in sizes], n)
        big = 67_289_128
        assert fitted.allreduce(big, n) == pytest.approx(shaped(big), rel=0.02)


def test_compressed_plan_bytes_match_the_algorithms_frames() -> None:
    topk = commpress.codecs.get("topk", ratio=0.01)
    entries = (Entry(10_000, True), Entry(100, False))
    frame = FrameLayout([(0, topk, 10_000), (1, commpress.codecs.get("none"), 100)], torch.float32).nbytes
    plan = compressed_plan(entries, topk, "allgather", 4)
    assert plan["allgather"] == frame and plan["decodes"] == 4 and plan["alltoall"] == 0
    sign = commpress.codecs.get("sign")
    two = compressed_plan(entries, sign, "twophase", 4)
    assert two["alltoall"] > 0 and two["allgather"] < two["alltoall"] and two["decodes"] == 2
    rk = commpress.codecs.get("randomk", ratio=0.01, scaled=False)
    assert compressed_plan(entries, rk, "allreduce", 4)["allreduce"] == 4 * (100 + 100)
    # a cast codec all-reduces the whole buffer in its dtype (the dense entries too)
    assert compressed_plan(entries, commpress.codecs.get("bf16"), "allreduce", 4)["allreduce"] == 2 * 10_100
    with pytest.raises(commpress.CodecError, match="algorithms"):
        compressed_plan(entries, topk, "magic", 2)


def test_predict_chooses_by_link_speed() -> None:
    topk = commpress.codecs.get("topk", ratio=0.01)
    fast = predict(BIG, 2, Link.from_gbit(400), CPU, topk, "allgather")
    slow = predict(BIG, 2, Link.from_gbit(1), CPU, topk, "allgather")
    assert best(fast) == "dense" and best(slow) == "compressed"
    # dense is exactly the ring all-reduce plus one pass
    numel = sum(e.numel for e in BIG)
    assert fast["dense"] == pytest.approx(Link.from_gbit(400).allreduce(4 * numel, 2) + CPU.pass_s * numel)
    # a codec too slow to encode and a cheap cast: fp16 wins at 10 Gbit/s
    slow_codec = DeviceCost(encode_s=50e-9, decode_s=10e-9, pass_s=0.3e-9, cast_s=0.5e-9)
    assert best(predict(BIG, 2, Link.from_gbit(10), slow_codec, topk, "allgather")) == "fp16"
    # bf16 buckets have no fp16 option; ties go to the earlier option
    assert "fp16" not in predict(BIG, 2, Link.from_gbit(10), CPU, topk, "allgather", torch.bfloat16)
    assert best({"dense": 1.0, "fp16": 1.0, "compressed": 1.0}) == "dense"


def test_predict_hierarchical_prices_three_links() -> None:
    """Dense and fp16 run flat on the whole group's link; compressed pays the node's two dense stages on
    the node's link and the codec on 1/L of the buffer among the nodes on the cross-node link."""
    topk = commpress.codecs.get("topk", ratio=0.01)
    numel = sum(e.numel for e in BIG)
    free = DeviceCost(0.0, 0.0, 0.0, 0.0)
    net = Link.from_gbit(1)
    nvlink, loopback = Link.from_gbit(1000), Link.from_gbit(8)
    shares = share_entries(BIG, 4)
    assert sum(e.numel for e in shares) == pytest.approx(numel / 4, abs=4) and [e.compressed for e in shares] == [True, False]
    # nothing but the wire: compressed = all_to_all + the share's all-gather among 2 nodes + the
    # all_gather in the node of the 2 nodes' top-k frames (fewer bytes than the dense share)
    out = predict_hierarchical(BIG, 2, 4, NodeLinks(net, nvlink, net), free, topk, "allgather")
    plan = compressed_plan(shares, topk, "allgather", 2)
    share_wire = wire_time(net, plan, 2)
    assert 2 * plan["allgather"] < 0.1 * 4 * sum(e.numel for e in shares)
    intra = nvlink.alltoall(4 * numel, 4) + nvlink.allgather(2 * plan["allgather"], 4)
    assert out["compressed"] == pytest.approx(share_wire + intra)
    # 8-bit QSGD across 8 nodes: 8 frames of ~1 byte per element outweigh the share: it gathers dense
    qsgd8 = commpress.codecs.get("qsgd", bits=8)
    q = predict_hierarchical(BIG, 8, 4, NodeLinks(net, nvlink, net), free, qsgd8, "allgather")
    q_shares = share_entries(BIG, 4, qsgd8.block_alignment())
    q_wire = wire_time(net, compressed_plan(q_shares, qsgd8, "allgather", 8), 8)
    q_intra = nvlink.alltoall(4 * numel, 4) + nvlink.allgather(4 * sum(e.numel for e in q_shares), 4)
    assert q["compressed"] == pytest.approx(q_wire + q_intra)
    assert out["dense"] == pytest.approx(net.allreduce(4 * numel, 8))  # flat over all 8 ranks
    # across nodes the share costs about 1/L of what a flat 8-rank all-gather of the whole costs
    flat = predict(BIG, 8, net, free, topk, "allgather")["compressed"]
    assert out["compressed"] < 0.2 * flat
    # a slow network: compress; a fast one: flat dense; slow links inside the node count against the hierarchy
    assert best(predict_hierarchical(BIG, 2, 4, NodeLinks(net, nvlink, net), CPU, topk, "allgather")) == "compressed"
    fast = Link.from_gbit(400)
    assert best(predict_hierarchical(BIG, 2, 4, NodeLinks(fast, nvlink, fast), CPU, topk, "allgather")) == "dense"
    slow_node = predict_hierarchical(BIG, 2, 4, NodeLinks(net, loopback, net), CPU, topk, "allgather")
    fast_node = predict_hierarchical(BIG, 2, 4, NodeLinks(net, nvlink, net), CPU, topk, "allgather")
    assert slow_node["compressed"] > fast_node["compressed"] + 0.05 and slow_node["dense"] == fast_node["dense"]


def test_fp16_against_dense_follows_the_measured_difference_whatever_the_link_fit() -> None:
    """The cast cost is set from the dense and fp16 all-reduces timed side by side: the model's fp16-minus-dense
    gap is the measured one, scaled with size, under any link fit (a misread link no longer picks fp16)."""
    from commpress.comm.costmodel import cast_cost, exact_options

    n, cal, big = 4, 1 << 21, 16_822_282
    t_dense, t_cast = 0.020, 0.023  # fp16 measured 3 ms slower at 2M elements
    gaps = []
    for link in (Link.from_gbit(5.4, 1e-3), Link.from_gbit(7.0, 0.9e-3), Link.from_gbit(1.0)):
        cost = dataclasses.replace(CPU, cast_s=cast_cost(t_cast, t_dense, link, cal, n))
        at_cal = exact_options(cal, n, link, cost, torch.float32)
        assert at_cal["fp16"] - at_cal["dense"] == pytest.approx(t_cast - t_dense - CPU.pass_s * cal)
        at_big = exact_options(big, n, link, cost, torch.float32)
        gaps.append(at_big["fp16"] - at_big["dense"])
        assert best(at_big) == "dense"
    assert gaps == pytest.approx([gaps[0]] * 3) and gaps[0] == pytest.approx((t_cast - t_dense - CPU.pass_s * cal) * big / cal)
    # measured faster: fp16 wins at every size; a cast costing less than nothing is clamped at 0
    fast = dataclasses.replace(CPU, cast_s=cast_cost(0.010, 0.020, Link.from_gbit(7.0), cal, n))
    assert best(exact_options(big, n, Link.from_gbit(7.0), fast, torch.float32)) == "fp16"
    assert cast_cost(0.0, 1.0, Link.from_gbit(7.0), cal, n) == 0.0


def test_calibrate_device_single_process() -> None:
    cost = calibrate_device(commpress.codecs.get("topk", ratio=0.01), feedback=True, masking=True, numel=1 << 14)
    assert cost.encode_s > 0 and cost.decode_s > 0 and cost.pass_s > 0 and cost.cast_s > 0 and cost.mask_s > 0
    assert cost.momentum_s == 0.0  # the hook applies no momentum: nothing to time
    owned = calibrate_device(commpress.codecs.get("topk", ratio=0.01), feedback=True, momentum=True, numel=1 << 14)
    assert owned.momentum_s > 0


def test_the_hooks_momentum_is_paid_by_the_compressed_option_only() -> None:
    """While every bucket is dense or fp16 the optimizer applies its momentum again (no hook cost)."""
    topk = commpress.codecs.get("topk", ratio=0.01)
    link = Link.from_gbit(10)
    plain = predict(BIG, 2, link, CPU, topk, "allgather")
    owned = predict(BIG, 2, link, dataclasses.replace(CPU, momentum_s=0.5e-9), topk, "allgather")
    numel = sum(e.numel for e in BIG)
    assert owned["compressed"] == pytest.approx(plain["compressed"] + numel * 0.5e-9)
    assert owned["dense"] == plain["dense"] and owned["fp16"] == plain["fp16"]


def test_path_factor_never_scales_below_the_codec_alone() -> None:
    from commpress.comm.costmodel import path_factor

    assert path_factor(0.030, 0.010, 0.010) == pytest.approx(2.0)  # the path did 2x the codec's work
    # a slow link: the wire is nearly all of the path, its error must not shrink the CPU part
    assert path_factor(0.300, 0.298, 0.015) == 1.0
    assert path_factor(0.100, 0.200, 0.015) == 1.0  # wire over-predicted
    assert path_factor(0.100, 0.010, 0.0) == 1.0 and path_factor(math.nan, 0.0, 1.0) == 1.0


def _bucket(predicted: dict[str, float], option: str) -> BucketChoice:
    return BucketChoice(0, BIG, dict(predicted), option, "first")


def test_hysteresis_margin_and_backoff() -> None:
    policy = AutoPolicy(margin=0.1)
    b = _bucket({"dense": 1.0, "fp16": 0.95, "compressed": 2.0}, "dense")
    assert not policy.decide(b) and b.option == "dense"  # 5% faster: inside the margin
    b.predicted["fp16"] = 0.85
    assert policy.decide(b) and b.option == "fp16" and b.switches == 1 and "margin" in b.reason
    # back again needs 20% now (the margin doubles per switch): 15% is not enough
    b.predicted.update(dense=0.85 * 0.85)
    assert not policy.decide(b) and b.option == "fp16"
    b.predicted.update(dense=0.85 * 0.75)
    assert policy.decide(b) and b.option == "dense" and b.switches == 2
    # the margin stops at 50%
    b.switches = 10
    b.predicted.update(compressed=0.2 * b.predicted["dense"])
    assert policy.decide(b) and b.option == "compressed"


def test_auto_options_are_checked() -> None:
    with pytest.raises(commpress.CodecError, match="auto_codec"):
        AutoPolicy.from_options({"auto_codec": "fp16"})
    with pytest.raises(commpress.CodecError, match="auto_interval"):
        AutoPolicy.from_options({"auto_interval": 0})
    with pytest.raises(commpress.CodecError, match="auto_margin"):
        AutoPolicy.from_options({"auto_margin": 1.5})
    with pytest.raises(commpress.CodecError, match="auto_link"):
        AutoPolicy.from_options({"auto_link": (1e-4, 1e-9)})
    options = {"auto_codec": "topk", "ratio": 0.01, "auto_interval": 7}
    name, policy = AutoPolicy.from_options(options)
    assert name == "topk" and policy.interval == 7 and options == {"ratio": 0.01}
    model = torch.nn.Linear(64, 64)
    with pytest.raises(commpress.CodecError, match="ratio"):
        commpress.ddp.CompressionState(model, "auto", auto_codec="topk", ratio=2.0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        commpress.ddp.CompressionState(model, "auto")


def test_default_candidate_follows_who_owns_the_momentum() -> None:
    """Top-k or sign only where the hook will own the momentum, by bytes; QSGD elsewhere."""
    from commpress.ddp.candidate import default_candidate, wire_bytes_per_element

    params = [torch.nn.Parameter(torch.zeros(4))]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # top-k's all-gather sends (n-1) frames: fewer bytes than sign at 2 ranks, more from 4
    topk, sign = commpress.codecs.get("topk", ratio=0.01), commpress.codecs.get("sign")
    assert wire_bytes_per_element(topk, 2) < wire_bytes_per_element(sign, 2)
    assert wire_bytes_per_element(topk, 4) > wire_bytes_per_element(sign, 4)
    assert default_candidate(sgd, world_size=2)[:2] == ("topk", {"ratio": 0.01})
    assert default_candidate(sgd, world_size=4)[:2] == ("sign", {})
    assert default_candidate(torch.optim.AdamW(params, lr=1e-3), world_size=8)[0] == "sign"
    assert default_candidate(None, momentum=0.9, world_size=2)[0] == "topk"
    # across nodes (the hierarchy's share) QSGD, whatever the optimizer
    assert default_candidate(sgd, world_size=2, hierarchical=True)[:2] == ("qsgd", {})
    assert default_candidate(None, world_size=4, hierarchical=True)[0] == "qsgd"
    none, _, why = default_candidate(None)
    assert none == "qsgd" and "optimizer=" in why
    assert default_candidate(torch.optim.Adam(params, amsgrad=True))[0] == "qsgd"  # runs unchanged
    assert default_candidate(torch.optim.Adagrad(params))[0] == "qsgd"
    # RMSprop's momentum acts on its normalized step: not SGD's, never moved into the hook
    assert default_candidate(torch.optim.RMSprop(params, momentum=0.9))[0] == "qsgd"
    # no auto_codec: the optimizer and world size decide (the candidate's parameters are added);
    # codec parameters without it stay QSGD's
    options: dict = {}
    assert AutoPolicy.from_options(options, sgd, world_size=2)[0] == "topk" and options == {"ratio": 0.01}
    assert AutoPolicy.from_options({}, None)[0] == "qsgd"
    options = {"bits": 2}
    assert AutoPolicy.from_options(options, sgd)[0] == "qsgd" and options == {"bits": 2}
    options = {"auto_interval": 7}  # auto's own options are not codec parameters
    name, policy = AutoPolicy.from_options(options, sgd, world_size=4)
    assert name == "sign" and policy.interval == 7 and options == {}


def test_auto_two_ranks() -> None:
    """Calibrated on loopback: same choices and parameters everywhere; a forced slow link
    compresses, a fast one goes dense and flushes the residuals, and stays there."""
    w.launch(auto_workers.worker_both, 2, 8)


def test_first_decision_starts_from_dense() -> None:
    policy = AutoPolicy(margin=0.1)
    close = _bucket({"dense": 1.0, "fp16": 0.95, "compressed": 0.93}, "dense")
    assert not policy.decide(close, first=True) and close.option == "dense"
    clear = _bucket({"dense": 1.0, "fp16": 0.95, "compressed": 0.3}, "dense")
    assert policy.decide(clear, first=True) and clear.option == "compressed" and clear.switches == 0
