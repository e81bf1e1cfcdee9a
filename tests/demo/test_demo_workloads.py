"""The shared demo workloads (commpress.demo.workloads) and bench_e2e's time-to-accuracy tables."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from commpress.demo import workloads as wl

ROOT = Path(__file__).resolve().parents[2]


def test_text_reader_windows_and_batches_are_deterministic():
    text = wl.stdlib_text(50_000)
    assert len(text) == 50_000 and text == wl.stdlib_text(50_000)
    data = wl.byte_tensor(text[:100])
    x, y = wl.text_windows(data, torch.tensor([0, 10]), 8)
    assert x.shape == y.shape == (2, 8)
    assert torch.equal(x[1, 1:], y[1, :-1]) and int(y[0, -1]) == text[8]
    tb = wl.TextBatches(context=16, nbytes=100_000, holdout=10_000)
    a, b = tb.batch(3, 1, 4), tb.batch(3, 1, 4)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], tb.batch(3, 0, 4)[0])
    assert tb.heldout(5)[0].shape == (5, 16)
    with pytest.raises(ValueError, match="context"):
        wl.TextBatches(context=0)


def test_digits_split_and_mlp():
    pytest.importorskip("sklearn")
    xtr, ytr, xte, yte = wl.digits_split()
    assert xtr.shape == (1437, 64) and xte.shape == (360, 64) and len(ytr) == 1437 and len(yte) == 360
    assert float(xtr.min()) == 0.0 and float(xtr.max()) == 1.0
    x, y = wl.digits_arrays()
    assert sorted(torch.cat([ytr, yte]).tolist()) == sorted(y.tolist())
    m = wl.digits_mlp(256, 256)
    assert [p.shape for p in m.parameters()][::2] == [(256, 64), (256, 256), (10, 256)]
    with pytest.raises(ValueError, match="hidden"):
        wl.digits_mlp()


def test_byte_lms():
    lm = wl.ByteLM(dim=32, layers=1, context=16, ffn=64)
    assert lm(torch.randint(0, 256, (2, 10))).shape == (2, 10, 256)
    wide = wl.wide_byte_lm()
    assert sum(p.numel() for p in wide.parameters()) >= 10_000_000
    with pytest.raises(ValueError, match="heads"):
        wl.ByteLM(dim=30, heads=4)


def _bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tta_table_reports_time_to_target():
    bench = _bench()

    def run(method, losses, accs, step_s, passed=False):
        curve = [[10 * (i + 1), step_s * 10 * (i + 1), v] for i, v in enumerate(losses)]
        return {"method": method, "curve": curve, "accuracy": accs, "final_loss": losses[-1],
                "final_accuracy": accs[-1], "median_step_s": step_s, "claimed_wire_bytes_per_step": 1e6,
                "optimizer_passed": passed}

    data = {"workload": "digits", "results": [
        run("allreduce", [1.0, 0.5, 0.2], [80.0, 95.0, 97.0], 0.2),
        run("cp-topk:ratio=0.01", [0.9, 0.2, 0.19], [85.0, 96.5, 97.5], 0.1, passed=True),
        run("cp-sign@warmup_steps=5", [2.0, 1.5, 1.0], [50.0, 60.0, 70.0], 0.1),
    ]}
    lines = bench.tta_table(data)
    text = "\n".join(lines)
    assert "0.2040" in lines[0] and "96.00%" in lines[0]
    topk = next(line for line in lines if "topk" in line)
    # reaches loss 0.204 at step 20 (2.0 s; dense at step 30, 6.0 s) and accuracy 96% at step 20
    assert "`optimizer=opt`" in topk and "(defaults)" in topk and "| 2.0 | 0.33x | 2.0 |" in topk
    assert "(tuned: `warmup_steps=5`)" in text and "not reached" in text
    assert lines[3].count("|") == lines[2].count("|")


def test_cluster_table_puts_each_node_link_next_to_the_hook_claim():
    """2 nodes x 2: hierarchical claims its node's ranks' inter-node wire bytes, flat one rank's (the ring's crossing)."""
    bench = _bench()
    data = {"results": [
        {"method": "allreduce", "topology": None, "claimed_wire_bytes_per_step_by_rank": [300.0] * 4,
         "inter_bytes_wire_per_step_by_rank": [0.0] * 4, "measured_wire_bytes_per_step": [310.0, 320.0, 300.0, 300.0]},
        {"method": "cp-topk:ratio=0.01@local_world_size=2", "topology": {"nodes": 2, "local_world_size": 2, "source": "torchrun"},
         "claimed_wire_bytes_per_step_by_rank": [90.0] * 4, "inter_bytes_wire_per_step_by_rank": [50.0, 50.0, 40.0, 40.0],
         "measured_wire_bytes_per_step": [110.0, 110.0, 90.0, 90.0]},
        {"method": "cp-topk", "topology": {"nodes": 4, "local_world_size": 1, "source": "explicit"},
         "claimed_wire_bytes_per_step_by_rank": [30.0] * 4, "inter_bytes_wire_per_step_by_rank": [0.0] * 4,
         "measured_wire_bytes_per_step": [-1.0] * 4},
        # codec="auto" on 2 x 2: some buckets hierarchical (inter 20, intra 60), the rest flat over every rank (300)
        {"method": "cp-auto", "topology": {"nodes": 2, "local_world_size": 2, "source": "torchrun"},
         "claimed_wire_bytes_per_step_by_rank": [380.0] * 4, "inter_bytes_wire_per_step_by_rank": [20.0] * 4,
         "intra_bytes_wire_per_step_by_rank": [60.0] * 4, "measured_wire_bytes_per_step": [340.0] * 4},
    ]}
    lines = bench.cluster_table(data, nodes=2, local=2)
    assert lines[2].endswith("| flat | 300, 300 | 315, 300 | 1.02 |")
    assert lines[3].endswith("| 2 x 2, hierarchical (detected) | 100, 80 | 110, 90 | 1.11 |")
    assert "n/a" in lines[4] and lines[4].endswith("| - |")
    assert lines[5].endswith("| 2 x 2, hierarchical (detected) | 340, 340 | 340, 340 | 1.00 |")


def test_wide_digits_is_the_17m_sgd_workload_with_accuracy():
    pytest.importorskip("sklearn")
    from commpress.demo.runner import Workload

    work = Workload("wide-digits", rank=1, world=2)
    model = work.model()
    assert sum(p.numel() for p in model.parameters()) > 17_000_000
    opt = work.optimizer(model.parameters())
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.9 and work.user_optimizer
    assert work.batch == 64 and len(work.own) == 718  # rank 1's half of the 1437 training images
    loss = work.loss(model, 0)
    assert loss.ndim == 0 and torch.isfinite(loss)
    result = work.evaluate(model)
    assert set(result) == {"loss", "accuracy"} and 0.0 <= result["accuracy"] <= 100.0
    bench = _bench()
    data = {"workload": "wide-digits", "results": [
        {"method": "allreduce", "curve": [[10, 1.0, 0.5]], "accuracy": [90.0], "final_loss": 0.5,
         "final_accuracy": 90.0, "median_step_s": 0.1, "claimed_wire_bytes_per_step": 1e6},
    ]}
    assert "accuracy %" in bench.tta_table(data)[2]


def test_tta_section_of_one_workload_replaces_only_its_own(tmp_path):
    bench = _bench()
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n" + bench.TTA_START + "\nintro\n" + bench.TTA_END + "\n\n## after\n")
    for workload, text in (("lm", "lm v1"), ("wide-digits", "wide v1"), ("lm", "lm v2")):
        start, end = bench.tta_markers(workload)
        bench.write_doc(str(doc), [text], start, end, before=bench.TTA_END)
    out = doc.read_text()
    assert "lm v2" in out and "lm v1" not in out and "wide v1" in out
    # both sections inside the tta block, the rest of the file kept
    assert out.index(bench.TTA_START) < out.index("lm v2") < out.index(bench.TTA_END) < out.index("## after")
    assert out.index("wide v1") < out.index(bench.TTA_END)


def test_advise_validate_reads_the_workload_section_by_its_markers():
    bench = _bench()
    spec = importlib.util.spec_from_file_location("advise_validate", ROOT / "scripts" / "advise_validate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    start, end = bench.tta_markers("lm")
    table = ["2 ranks, 1gbit, 200 steps:", "", "| method | held-out loss | median step (s) |", "|---|---|---|",
             "| PyTorch all-reduce (no hook) | 2.5 | 0.5000 |", "| commpress `sign` + `optimizer=opt` (defaults) | 2.5 | 0.2500 |",
             "| commpress `sign` (tuned: `x=1`) | 2.5 | 0.1000 |", ""]
    doc = "\n".join(["4 ranks, 1gbit:", start, *table, end, "| commpress `topk` | 1 | 9.0 |"])
    assert mod.measured_steps(doc, "lm") == {"dense": 0.5, "sign": 0.25}
    with pytest.raises(SystemExit, match="tta-wide-digits"):
        mod.measured_steps(doc, "wide-digits")
