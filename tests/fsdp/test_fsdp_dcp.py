"""``FSDPCompressionState`` in ``torch.distributed.checkpoint`` (tests/fsdp_dcp_workers.py): gloo on CPU.

A top-k run with error feedback and the user's SGD momentum saved with ``dcp.save`` next to the
model and optimizer resumes in fresh processes bit for bit; another codec is refused with an error
naming it. At another world size (a file per rank, or DCP with ``state.dcp(checkpoint_id=...)``)
what is global loads and the per-rank residuals and velocities are dropped with one warning.
"""

from __future__ import annotations

from pathlib import Path

import fsdp_dcp_workers as dw
import torch

import commpress.codecs
import commpress.fsdp
from commpress.fsdp.dcp import HEADER_NBYTES, _decode_header, _encode_header

import ddp_workers as w


def test_header_round_trips_and_refuses_garbage() -> None:
    header = {"dcp_format": 1, "codec": {"name": "topk", "ratio": 0.1}, "seed": (1 << 64) - 1, "guard": [0, 1, 2, 0.25]}
    t = _encode_header(header)
    assert t.dtype == torch.uint8 and t.shape == (HEADER_NBYTES,)
    assert _decode_header(t) == header
    for bad, match in ((t[:10], "uint8 tensor"), (torch.full((HEADER_NBYTES,), 255, dtype=torch.uint8), "not valid JSON"),
                       (_encode_header({"dcp_format": 2}), "format 2")):
        try:
            _decode_header(bad)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"accepted {match}")
    # every codec's config survives the header's JSON (a list for a tuple would read as another codec)
    for codec in (commpress.codecs.get("topk", ratio=0.1), commpress.codecs.get("randomk", k=7, scaled=True),
                  *(commpress.codecs.get(n) for n in ("none", "fp16", "bf16", "sign", "qsgd", "int8", "int4"))):
        back = _decode_header(_encode_header({"dcp_format": 1, "codec": codec.config()}))["codec"]
        assert commpress.codecs.from_config(back) == codec, codec


def test_dcp_resume_is_bit_exact_in_fresh_processes(tmp_path: Path) -> None:
    """K steps, dcp.save, N steps; fresh processes dcp.load and run the N steps: the same parameters
    on every rank, the residuals and velocities back (float32 residuals with ``model.state_dict()``,
    int8 ones with torch's ``get_state_dict``, AdamW's compressed momentum, the last one loaded through
    ``state.dcp(checkpoint_id=...)``); a sign state and a header naming another rank refuse it; a
    1-rank group gets DCP's error with a bare ``state.dcp()`` and, naming the checkpoint, what is global."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path)
    w.launch(dw.worker_save, 2, ckpt, out, timeout=120)
    w.launch(dw.worker_resume, 2, ckpt, out, timeout=120)
    w.launch(dw.worker_other_world, 1, ckpt, timeout=60)


def test_resume_at_another_world_size_keeps_what_is_global_and_drops_per_rank_state(tmp_path: Path) -> None:
    """Saved at 2 ranks (files and DCP), loaded at 3: config, step, seed, call counts and guard kept, residuals and
    velocities dropped with one warning naming their counts and norms, ``residual_dtype="auto"`` sized for 3 ranks,
    training goes on; at 2 ranks another rank's state is still refused (the 2 -> 1 DCP case: the test above)."""
    w.launch(dw.worker_resize_save, 2, str(tmp_path), timeout=60)
    w.launch(dw.worker_resize_load, 3, str(tmp_path), timeout=90)


def test_state_is_not_itself_the_dcp_form() -> None:
    """The per-rank file form stays the state's own ``state_dict``; ``dcp()`` is the Stateful for DCP."""
    from torch.distributed.checkpoint.stateful import Stateful

    assert issubclass(commpress.fsdp.DCPState, Stateful)
    assert hasattr(commpress.fsdp.FSDPCompressionState, "dcp")


def test_dcp_dedups_same_named_entries_across_ranks() -> None:
    """The trap the ``rank{r}_of_{n}`` namespace avoids: DCP's save planner keeps one copy of an
    entry two ranks name alike (here rank 1's differing residual), so rank 1 would read rank 0's."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    def plans(per_rank: list[dict[str, object]]) -> list[set[str]]:
        out = []
        for rank, sd in enumerate(per_rank):
            planner = DefaultSavePlanner()
            planner.set_up_planner(sd, is_coordinator=rank == 0)
            out.append(planner.create_local_plan())
        return [{item.index.fqn for item in p.items} for p in dedup_save_plans(out)]

    same_names = [{"commpress": {"rank": r, "residuals": {"h1.weight#2": torch.full((4,), float(r))}}} for r in range(2)]
    kept = plans(same_names)
    assert "commpress.residuals.h1.weight#2" in kept[0] ^ kept[1]  # written by one rank only
    namespaced = [{"commpress": {f"rank{r}_of_2": {"residuals": {"h1.weight#2": torch.full((4,), float(r))}}}}
                  for r in range(2)]
    kept = plans(namespaced)
    assert kept == [{f"commpress.rank{r}_of_2.residuals.h1.weight#2"} for r in range(2)]
