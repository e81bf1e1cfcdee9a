"""``param_codec=`` left out: the parameter all-gather follows the gradient codec (issue #25).

A compressing codec (``register(model, "topk")``) installs int8 forward + ``"backward": "reuse"``
(bit for bit the explicit setting, fewer all-gather bytes than FSDP's, logged at registration);
``none`` and the casts keep FSDP's all-gather (``none``: plain FSDP bit for bit);
``param_codec="none"`` / ``None`` are gradient-only; a gradient-only checkpoint loads into the
default and back (tests/fsdp_allgather_workers.py ``worker_defaults``, one launch of 2 ranks).
"""

from __future__ import annotations

import pytest
import torch

import commpress.fsdp
from commpress import codecs
from commpress.errors import CodecError
from commpress.fsdp.allgather import (
    COMPRESSING_DEFAULT,
    DEFAULT,
    default_param_codec,
    resolve_param_codec,
)

import ddp_workers as w
import fsdp_allgather_workers as aw

EXACT = {"none", "fp16", "bf16"}


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "int8", "int4"])
def test_the_default_follows_whether_the_codec_compresses(name: str) -> None:
    codec = codecs.get(name, **({"ratio": 0.01} if name in ("topk", "randomk") else {}))
    value, defaulted, why = default_param_codec(DEFAULT, codec)
    assert defaulted
    if name in EXACT:
        assert value is None and "FSDP's own all-gather" in why and f"codec {name!r} does not compress" in why
    else:
        assert value == COMPRESSING_DEFAULT and why == (
            f"param_codec defaulted to int8/reuse because codec {name!r} compresses; "
            "pass param_codec='none' for gradient-only")
        resolved = resolve_param_codec(value)
        assert resolved is not None and resolved[1] and resolved[0]["forward"] == codecs.get("int8")
    for given in (None, "none", "int4"):  # given: as it is, whatever the codec
        assert default_param_codec(given, codec)[:2] == (given, False)


def test_the_sentinel_is_resolved_before_use() -> None:
    with pytest.raises(CodecError, match="resolve it with default_param_codec"):
        resolve_param_codec(DEFAULT)


@pytest.mark.parametrize("value", [None, "none", {"forward": "int8", "backward": "reuse"}])
def test_auto_refuses_any_given_param_codec(value: object) -> None:
    # the default is accepted: every register(model, "auto") in tests/fsdp/test_fsdp_auto.py leaves it out
    with pytest.raises(CodecError, match="takes no param_codec="):
        commpress.fsdp.register(torch.nn.Linear(2, 2), "auto", param_codec=value)


def test_defaults_on_two_ranks() -> None:
    w.launch(aw.worker_defaults, 2, timeout=180)
