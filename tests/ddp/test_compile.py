"""``torch.compile`` over a DDP model with commpress's hook (2 gloo ranks; worker in tests/ddp_workers.py).

Compiled DDP (dynamo's DDPOptimizer splits the graph at bucket boundaries) must still call the
communication hook once per bucket and step, and keep every rank's parameters identical.
"""

from __future__ import annotations

import ddp_workers as w


def test_torch_compile_keeps_the_hook_and_ranks_identical() -> None:
    w.launch(w.worker_compile, 2, 6, timeout=400.0)
