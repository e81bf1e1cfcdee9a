"""The harness every coverage-guided fuzz target of issue #12 shares (``scripts/fuzz_*.py``).

A target script supplies a name, a ``make_target()`` returning the callable that checks one
input (it raises on a finding: an exception other than the documented ones, a non-finite
result...) and a ``make_corpus(directory)`` writing its seed inputs; :func:`main` does the rest:

* options: ``--runs`` / ``--seconds`` (budget), ``--rss-mb`` (libFuzzer's RSS limit, default
  1024), ``--timeout`` (seconds one input may take), ``--max-len``, ``--keep`` (grow the kept
  corpus ``tests/fuzz_corpus/<name>``, else new inputs go to a temporary directory),
  ``--artifacts``, ``--make-corpus`` (rewrite the seed corpus), ``--slow-ms`` and ``--replay``;
* instrumentation of ``commpress`` (the modules the target imports, not numba-compiled ones);
* a warm-up over the seed corpus before anything is measured (first calls compile kernels);
* timing of every input: a ``#fuzz_<name> slowest input so far`` line whenever one is the
  slowest yet, a copy of any input slower than ``--slow-ms`` under the artifacts directory
  (``slow-<ms>-<sha1>``) and a ``#fuzz_<name> inputs N accepted M slowest X ms`` summary at
  every power of two from 16384 inputs and at ``--runs``;
* ``--replay FILE...``: run saved inputs ``--repeat`` times each and print their times, to tell
  scheduler noise (only the first run slow) from a really slow input (every run slow);
* ``--leak-check N``: run ``N`` inputs made by mutating the seed corpus with a fixed PRNG,
  without libFuzzer, and print the RSS every ``N/10`` inputs. libFuzzer itself grows (its
  in-memory corpus of every new input, its feature tables), so the RSS of a long fuzzing run
  mixes the target's memory with the fuzzer's; this run has only the target's.

libFuzzer's own status lines and final stats give inputs run, inputs/s (``exec/s``),
coverage (``cov``: instrumented edges reached; ``ft``: features) and peak RSS.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_ROOT = os.path.join(ROOT, "tests", "fuzz_corpus")
#: numba compiles varlen's loops from their bytecode: instrumented bytecode would not compile
NOT_INSTRUMENTED = ("commpress.varlen", "commpress.spec.varlen")


class Timed:
    """Wraps a target: counts and times every input, reports and keeps the slow ones."""

    def __init__(self, name: str, target: Callable[[bytes], Any], *, slow_ms: float, artifacts: str,
                 runs: int = 0) -> None:
        self.name, self.target = name, target
        self.slow_ms, self.artifacts, self.runs = slow_ms, artifacts, runs
        self.reset()

    def reset(self) -> None:
        """Forget the warm-up: counters and the slowest time start again."""
        self.inputs = 0
        self.slowest = 0.0
        if hasattr(self.target, "accepted"):
            self.target.accepted = 0

    def summary(self) -> str:
        """One line: inputs run, inputs that passed validation, slowest input."""
        accepted = getattr(self.target, "accepted", "-")
        return f"#fuzz_{self.name} inputs {self.inputs} accepted {accepted} slowest {self.slowest * 1e3:.1f} ms"

    def __call__(self, data: bytes) -> None:
        """Run the target on ``data`` and time it."""
        t0 = time.perf_counter()
        self.target(data)
        dt = time.perf_counter() - t0
        self.inputs += 1
        if dt > self.slowest:
            self.slowest = dt
            print(f"#fuzz_{self.name} slowest input so far: {dt * 1e3:.1f} ms ({len(data)} bytes)",
                  file=sys.stderr, flush=True)
        if dt * 1e3 > self.slow_ms:
            path = os.path.join(self.artifacts, f"slow-{dt * 1e3:.0f}ms-{hashlib.sha1(data).hexdigest()[:16]}")
            with open(path, "wb") as f:
                f.write(data)
            print(f"#fuzz_{self.name} input slower than {self.slow_ms:g} ms kept: {path}", file=sys.stderr, flush=True)
        n = self.inputs
        if (n >= 1 << 14 and n & (n - 1) == 0) or n == self.runs:
            print(self.summary(), file=sys.stderr, flush=True)


def read_corpus(directory: str) -> list[bytes]:
    """Every file of ``directory`` (sorted by name)."""
    out = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out.append(f.read())
    return out


def replay(timed: Timed, paths: Sequence[str], repeat: int) -> None:
    """Run each saved input ``repeat`` times; print its times (first, median, max)."""
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            timed.target(data)
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"{path}: {len(data)} bytes, first {times[0]:.2f} ms, median {statistics.median(times):.2f} ms, "
              f"max {max(times):.2f} ms over {repeat} runs")


def rss_mb() -> float:
    """This process's resident set (``VmRSS``), MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def mutate(data: bytes, rng: random.Random, max_len: int) -> bytes:
    """A libFuzzer-like mutation: flip, overwrite, insert or cut bytes (deterministic for a seeded ``rng``)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(4)
        if op == 0 and out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 2 and len(out) < max_len:
            at = rng.randrange(len(out) + 1)
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif out:
            del out[rng.randrange(len(out)):]
    return bytes(out[:max_len])


def leak_check(target: Callable[[bytes], Any], seeds: Sequence[bytes], inputs: int, max_len: int) -> None:
    """Run ``inputs`` mutated seeds through ``target`` (findings are printed, not raised); print the RSS growth."""
    rng = random.Random(0)
    every = max(1, inputs // 10)
    findings = 0
    first = rss_mb()
    print(f"leak check: {inputs} inputs; RSS {first:.1f} MB after the warm-up", flush=True)
    t0 = time.monotonic()
    for i in range(1, inputs + 1):
        try:
            target(mutate(rng.choice(seeds), rng, max_len))
        except Exception as exc:  # a finding: counted, the check goes on
            findings += 1
            if findings <= 3:
                print(f"  finding at input {i}: {type(exc).__name__}: {exc}", flush=True)
        if i % every == 0:
            print(f"  {i} inputs: RSS {rss_mb():.1f} MB ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"leak check: RSS {first:.1f} -> {rss_mb():.1f} MB over {inputs} inputs; {findings} findings", flush=True)


def main(
    name: str,
    doc: str,
    make_target: Callable[[], Callable[[bytes], Any]],
    make_corpus: Callable[[str], int],
    *,
    max_len: int = 4096,
    instrument: Sequence[str] = ("commpress",),
) -> int:
    """Parse the options, set up corpus and artifacts, and fuzz ``make_target()`` with libFuzzer."""
    corpus = os.path.join(CORPUS_ROOT, name)
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--runs", type=int, default=0, help="number of inputs (0: no limit)")
    p.add_argument("--seconds", type=int, default=0, help="time budget in seconds (0: no limit)")
    p.add_argument("--rss-mb", type=int, default=1024, help="RSS limit (libFuzzer -rss_limit_mb)")
    p.add_argument("--timeout", type=int, default=1, help="seconds one input may take (libFuzzer -timeout)")
    p.add_argument("--max-len", type=int, default=max_len, help="largest input in bytes")
    p.add_argument("--keep", action="store_true", help=f"add new interesting inputs to {corpus}")
    p.add_argument("--artifacts", default=None, help="where crashing and slow inputs go (default: a temp dir)")
    p.add_argument("--slow-ms", type=float, default=100.0, help="keep inputs slower than this (ms)")
    p.add_argument("--make-corpus", action="store_true", help="rewrite the seed corpus and exit")
    p.add_argument("--replay", nargs="+", metavar="FILE", help="time these saved inputs instead of fuzzing")
    p.add_argument("--repeat", type=int, default=5, help="runs of each --replay input")
    p.add_argument("--leak-check", type=int, default=0, metavar="N",
                   help="run N mutated seed inputs without libFuzzer and print the RSS (the target's own growth)")
    p.add_argument("libfuzzer", nargs="*", help="extra libFuzzer flags (after --)")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    if args.make_corpus:
        shutil.rmtree(corpus, ignore_errors=True)
        os.makedirs(corpus)
        print(f"wrote {make_corpus(corpus)} seed inputs to {corpus}")
        return 0
    import atheris

    with atheris.instrument_imports(include=list(instrument), exclude=list(NOT_INSTRUMENTED)):
        target = make_target()
    work = tempfile.mkdtemp(prefix=f"fuzz_{name}.")
    artifacts = os.path.abspath(args.artifacts or work)
    os.makedirs(artifacts, exist_ok=True)
    timed = Timed(name, target, slow_ms=args.slow_ms, artifacts=artifacts, runs=args.runs)
    for data in read_corpus(corpus):  # warm-up outside the measured inputs (kernels compile on first use)
        target(data)
    if args.replay:
        replay(timed, args.replay, args.repeat)
        return 0
    if args.leak_check:
        leak_check(target, read_corpus(corpus), args.leak_check, args.max_len)
        return 0
    dirs = [corpus] if args.keep else [os.path.join(work, "corpus"), corpus]
    os.makedirs(dirs[0], exist_ok=True)
    flags = [f"-rss_limit_mb={args.rss_mb}", f"-timeout={args.timeout}", f"-max_len={args.max_len}",
             f"-artifact_prefix={artifacts}/", "-print_final_stats=1"]
    if args.runs:
        flags.append(f"-runs={args.runs}")
    if args.seconds:
        flags.append(f"-max_total_time={args.seconds}")
    timed.reset()
    atheris.Setup([sys.argv[0], *flags, *args.libfuzzer, *dirs], timed)
    atheris.Fuzz()
    return 0
