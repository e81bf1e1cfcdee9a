"""Workers for FSDP's exact embedding-like parameters (tests/fsdp/test_fsdp_quality.py; gloo on CPU).

A tiny byte-LM-shaped model: an embedding table, two sharded MLP blocks, and an output projection
onto the vocabulary (untied, or tied to the embedding). Each worker asserts on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import commpress.fsdp

from ddp_workers import assert_all_ranks

VOCAB, DIM, HIDDEN, CONTEXT = 64, 32, 128, 16


class TinyLM(nn.Module):
    """Embedding -> 2 residual MLP blocks -> a vocabulary projection (``tied``: the embedding's weight)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make_lm(tied: bool) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(tied)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def lm_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zipf-like bytes (a few frequent tokens, a long tail), next-token targets."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    probs = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    seq = torch.multinomial(probs, 8 * (CONTEXT + 1), replacement=True, generator=g).view(8, CONTEXT + 1)
    return seq[:, :-1], seq[:, 1:]


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def _one_backward(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    x, y = lm_batch(rank, 0)
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    return _local_grads(model)


def worker_exact_embeddings(rank: int, world: int) -> None:
    """Embedding-like parameters are planned exact and reduced exactly: FSDP's own gradient, bit for bit.

    Step 0 from the same initialisation: every gradient FSDP computes is the same with and without
    commpress, so the reduced shards of the embedding and the output projection must equal plain
    FSDP's exactly, while the blocks' (sign-compressed) shards must not; ``exact_embeddings=False``
    compresses them again (the DDP rule alone).
    """
    for tied in (False, True):
        reference = _one_backward(make_lm(tied), rank)
        vocab = ["embed.weight"] if tied else ["embed.weight", "head.weight"]
        blocks = [n for n in reference if n.startswith("blocks.") and reference[n].dim() == 2]
        for given, codec, opts in ((True, "sign", {}), (True, "qsgd", {"bits": 2}), (None, "topk", {"ratio": 0.01}),
                                   (False, "sign", {}), (None, "sign", {})):
            exact = given if given is not None else codec != "sign"  # the default: exact but for sign
            model = make_lm(tied)
            state = commpress.fsdp.register(model, codec, warmup_steps=0, optimizer=None, exact_embeddings=given,
                                            param_codec="int8", **opts)
            planned = {p.name: p.compressed for m in state.modules for p in m.params}
            gathered = {n: c for plan in state.allgather.plans.values()  # type: ignore[union-attr]
                        for n, c in zip(plan.names, plan.compressed)}
            where = f"{codec} tied={tied} exact_embeddings={exact}"
            assert_all_ranks(all(planned[n] is not exact for n in vocab), f"{where}: vocabulary params planned {planned}")
            assert_all_ranks(all(gathered[n] is not exact for n in vocab), f"{where}: gathered {gathered}")
            assert_all_ranks(all(planned[n] and gathered[n] for n in blocks), f"{where}: blocks not compressed")
            # the int8 all-gather changes the blocks' forward: gather them exactly for step 0's comparison
            model2 = make_lm(tied)
            state2 = commpress.fsdp.register(model2, codec, warmup_steps=0, optimizer=None, exact_embeddings=given,
                                             param_codec="none", **opts)
            grads = _one_backward(model2, rank)
            same = all(torch.equal(grads[n], reference[n]) for n in vocab)
            assert_all_ranks(same is exact, f"{where}: vocabulary gradients equal to FSDP's: {same}")
            assert_all_ranks(not all(torch.equal(grads[n], reference[n]) for n in blocks),
                             f"{where}: the blocks were not compressed")
            del state, state2


__all__ = ["TinyLM", "worker_exact_embeddings"]
