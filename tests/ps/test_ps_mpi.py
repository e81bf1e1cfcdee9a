"""The parameter server under mpirun (3-5 ranks on this machine), through its command line.

Each test is one ``mpirun -n K --oversubscribe python -m commpress.ps ...`` launch with a hard
timeout; the root-run variables are set so it works in containers. Skipped when the venv has
no ``mpirun``. The serial twins of these checks are in tests/test_ps_server.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from commpress.ps import reference_train
from commpress.ps.demos import digits_task

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       # scripts run as files see scripts/ first on sys.path, not the checkout: import this tree's package
       "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}

pytestmark = pytest.mark.skipif(not os.path.exists(MPIRUN), reason="mpirun not installed in the venv")


def mpirun(n, *args, script=("-m", "commpress.ps"), timeout=180):
    """Run a job; on timeout kill mpirun and every rank (own process group) and fail."""
    cmd = [MPIRUN, "-n", str(n), "--oversubscribe", sys.executable, *script, *args]
    t0 = time.monotonic()
    with subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"mpirun did not finish within {timeout} s: {' '.join(cmd)}\n{err[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    proc.elapsed = time.monotonic() - t0
    return proc


def ps(n, *args, timeout=180):
    return mpirun(n, "--no-progress", "--json", *args, timeout=timeout)


def report(proc):
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sync_none_equals_single_process_and_rejects_hostile_messages(tmp_path):
    faults = ["corrupt:worker=0,step=2", "truncate:worker=0,step=3", "wrongshard:worker=1,step=4",
              "spoof:worker=1,step=5", "badwire:worker=0,step=6", "garbage:worker=1,step=7",
              "oversize:worker=0,step=8"]
    out = tmp_path / "final.pt"
    proc = ps(4, "--servers", "2", "--steps", "30", "--out", str(out), *[a for f in faults for a in ("--fault", f)])
    rep = report(proc)
    assert rep["rejected"] == len(faults)
    for rank, what in [(2, "crc32"), (2, "needs exactly"), (3, "shard: message for shard 0"),
                       (3, "header says worker 2"), (2, "segment 0: magic"), (3, "magic"), (2, "oversized")]:
        assert re.search(rf"rejected a message from rank {rank}: .*{re.escape(what)}", proc.stderr), what
    final = torch.load(out, weights_only=True)["params"]
    ref = reference_train(digits_task(), workers=2, steps=30)
    torch.testing.assert_close(final, ref, rtol=1e-5, atol=1e-6)


def test_local_steps_make_outer_step_servers(tmp_path):
    # DiLoCo over the parameter server: H=5 inner steps per sync, Nesterov outer SGD on 2 server shards
    from commpress.ps import PSConfig

    outer = ["--local-steps", "5", "--outer-lr", "0.7", "--outer-momentum", "0.9", "--outer-nesterov"]
    out = tmp_path / "final.pt"
    rep = report(ps(3, "--servers", "2", "--steps", "8", "--out", str(out), *outer))
    assert rep["local_steps"] == 5 and rep["steps"] == 8
    cfg = PSConfig(servers=2, steps=8, local_steps=5, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)
    ref = reference_train(digits_task(), workers=1, steps=8, config=cfg)
    torch.testing.assert_close(torch.load(out, weights_only=True)["params"], ref, rtol=1e-5, atol=1e-6)
    # compressed pseudo-gradients (4-bit QSGD with error feedback), the 8-bit pull local_steps takes for "same"
    rep = report(ps(3, "--local-steps", "10", "--steps", "30", "--codec", "qsgd:bits=4"))
    assert rep["pull_codec"].startswith("qsgd:bits=8") and rep["resyncs"] <= 3, rep
    assert rep["push_bytes_per_step_per_worker"] < rep["dense_bytes_per_step_per_worker"] / 6, rep
    assert rep["metrics"]["test_accuracy"] > 95.0, rep


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path):
    ck = tmp_path / "ck"
    common = ["--servers", "2", "--codec", "topk:ratio=0.1", "--pull-codec", "sign", "--max-drift", "0.05",
              "--checkpoint", str(ck), "--checkpoint-every", "4"]
    full = report(ps(4, *common, "--steps", "16", "--out", str(tmp_path / "a.pt")))
    names = sorted(os.listdir(ck))
    assert "meta.json" in names and sum("step000000012" in n for n in names) == 4
    for n in names:  # simulate a crash after step 12: drop the newer files
        if "step000000016" in n:
            os.remove(ck / n)
    proc = ps(4, *common, "--steps", "16", "--resume", "--out", str(tmp_path / "b.pt"))
    resumed = report(proc)
    assert "resuming from step 12" in proc.stderr
    a = torch.load(tmp_path / "a.pt", weights_only=True)["params"]
    b = torch.load(tmp_path / "b.pt", weights_only=True)["params"]
    assert torch.equal(a, b)
    assert resumed["metrics"] == full["metrics"]


@pytest.mark.timeout(450)
def test_codecs_converge_and_ssp_respects_its_bound(tmp_path):
    rows_file = tmp_path / "rows.json"
    proc = mpirun(3, "--steps", "300", "--json", str(rows_file), "--staleness", "2",
                  script=(os.path.join(ROOT, "scripts", "ps_convergence.py"),), timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(rows_file.read_text())
    acc = {(r["mode"], r["codec"].split(":")[0]): r["metrics"]["test_accuracy"] for r in rows}
    base = acc[("sync", "none")]
    assert base > 95.0
    sync = {c: a for (m, c), a in acc.items() if m == "sync"}
    assert set(sync) == {"none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd"}
    for codec, a in sync.items():
        assert a >= base - 2.0, f"{codec}: {a:.2f}% vs uncompressed {base:.2f}%"
    for (mode, codec), a in acc.items():
        if mode != "sync":
            assert a >= base - 3.0, f"{mode} {codec}: {a:.2f}%"
    for r in rows:
        if r["mode"] == "ssp":
            assert r["lead"] <= 2 and r["max_ahead"] <= 2
            assert r["lead"] == 2  # the straggler made the bound bite
        if r["codec"] != "none" and r["mode"] == "sync":
            assert r["push_bytes_per_step_per_worker"] < r["dense_bytes_per_step_per_worker"] / 1.9


def test_soak_prints_the_table_and_its_verdict():
    """scripts/soak_ps.py at tiny size: a row per recording step, replicas identical, nothing grows; a differing digest says NO."""
    proc = mpirun(4, "--steps", "40", "--every", "10", "--warmup", "10",
                  script=(os.path.join(ROOT, "scripts", "soak_ps.py"),), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| step | RSS s0 MB | RSS s1 MB | RSS w0 MB | RSS w1 MB | fds | threads | replicas identical |" in out
    rows = re.findall(r"^\| (\d+) \|.*\| (yes|NO) \|$", out, re.M)
    assert rows == [(str(t), "yes") for t in (10, 20, 30, 40)], out
    assert "fd growth [0, 0, 0, 0], thread growth [0, 0, 0, 0]" in out
    assert ("workers' replicas equal the servers' at every row: yes; after the final pull every worker holds "
            "the servers' parameters: yes") in out
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import soak_ps
    finally:
        sys.path.pop(0)
    server0, server1, worker = [10, 1, 2, 3, 7, 0], [10, 1, 2, 3, 0, 8], [10, 1, 2, 3, 7, 8]
    assert soak_ps.table_rows([[server0], [server1], [worker], [worker]], 2)[0].same
    assert not soak_ps.table_rows([[server0], [server1], [worker], [[10, 1, 2, 3, 7, 9]]], 2)[0].same


def test_sync_worker_that_stops_answering_stops_all_ranks_naming_it():
    proc = ps(3, "--steps", "50", "--timeout", "3", "--fault", "hang:worker=1,step=4", timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    m = re.search(r"worker rank 2 \(worker 1\) sent nothing for ([\d.]+) s \(timeout 3 s\).*stopping all ranks",
                  proc.stderr)
    assert m, proc.stderr[-3000:]
    assert 3.0 <= float(m.group(1)) < 6.0


def test_async_drops_a_silent_worker_and_finishes():
    proc = ps(4, "--mode", "async", "--steps", "60", "--timeout", "3",
              "--fault", "hang:worker=2,step=5,seconds=6", timeout=120)
    rep = report(proc)
    assert rep["dropped_ranks"] == [3]
    assert re.search(r"dropping worker rank 3 \(worker 2\): silent for [3-5]\.\d s", proc.stderr), proc.stderr[-3000:]
    assert "[commpress.ps worker 2] stopping at step 5" in proc.stderr
    assert rep["metrics"]["test_accuracy"] > 80.0


def test_a_worker_that_dies_ends_the_job_naming_its_rank():
    proc = ps(3, "--steps", "50", "--fault", "die:worker=0,step=3", timeout=120)
    assert proc.returncode != 0
    assert "[commpress.ps rank 1] error: fault injected: worker 0 dies at step 3" in proc.stderr


def test_bytelm_demo_runs():
    rep = report(ps(3, "--demo", "bytelm", "--steps", "6", "--codec", "qsgd:bits=8"))
    assert 4.0 < rep["metrics"]["valid_bits_per_byte"] < 9.0
    assert rep["push_bytes_per_step_per_worker"] < rep["dense_bytes_per_step_per_worker"] / 3


def test_transport_tests_pass_under_mpirun():
    proc = mpirun(3, script=(os.path.join(ROOT, "tests", "ps", "test_ps_transport.py"),), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("transport tests passed") == 3


def test_cli_errors_without_mpirun():
    help_ = subprocess.run([sys.executable, "-m", "commpress.ps", "--help"], capture_output=True, text=True, env=ENV)
    assert help_.returncode == 0 and "--staleness" in help_.stdout and "mpirun" in help_.stdout
    bad = subprocess.run([sys.executable, "-m", "commpress.ps", "--codec", "topk"], capture_output=True, text=True, env=ENV)
    assert bad.returncode == 2 and "give exactly one of ratio or k" in bad.stderr
    alone = subprocess.run([sys.executable, "-m", "commpress.ps", "--steps", "1", "--no-progress"],
                           capture_output=True, text=True, env=ENV, timeout=120)
    assert alone.returncode == 2 and "start at least 2 ranks" in alone.stderr
    # red-team 2b: a negative batch size trained on silently (exit 0, 20.8%); now a clear option error
    for flag, value in (("--batch-size", "-5"), ("--batch-size", "0"), ("--lr", "nan"), ("--lr", "-1")):
        neg = subprocess.run([sys.executable, "-m", "commpress.ps", flag, value], capture_output=True, text=True, env=ENV)
        assert neg.returncode == 2 and f"{flag} must be" in neg.stderr, (flag, value, neg.stderr)


def test_sigterm_on_one_worker_stops_every_rank_at_one_step_with_a_checkpoint_and_resumes_exactly(tmp_path):
    """Preemption (:mod:`commpress.ps.preempt`): exit 143 on every rank, one complete checkpoint, --resume exact."""
    ck = tmp_path / "ck"
    common = ["--servers", "2", "--codec", "topk:ratio=0.1", "--pull-codec", "sign", "--max-drift", "0.05",
              "--checkpoint", str(ck), "--steps", "16"]
    proc = ps(4, *common, "--fault", "sigterm:worker=1,step=5")
    assert proc.returncode == 143, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    assert "got signal 15" in proc.stderr and "preempted: every rank stopped after step" in proc.stderr
    stop = int(re.search(r"every rank stopped after step (\d+)", proc.stderr).group(1))
    assert 5 < stop < 16
    assert sorted(n for n in os.listdir(ck) if n.endswith(".pt")) == [
        f"rank{r:05d}-step{stop:09d}.pt" for r in range(4)]  # every rank saved that one step, nothing else
    resumed = ps(4, *common, "--resume", "--out", str(tmp_path / "b.pt"))
    report(resumed)
    assert f"resuming from step {stop}" in resumed.stderr
    full = report(ps(4, *common[:-4], "--steps", "16", "--out", str(tmp_path / "a.pt")))
    a = torch.load(tmp_path / "a.pt", weights_only=True)["params"]
    b = torch.load(tmp_path / "b.pt", weights_only=True)["params"]
    assert torch.equal(a, b), "the preempted and resumed run differs from the uninterrupted one"
    assert full["steps"] == 16
