"""Error feedback: nothing lost, non-finite policy, checkpoints."""

import io
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress import CodecError, ErrorFeedback, codecs, wire

from strategies import CODEC_CONFIGS, make_codec


@pytest.mark.parametrize("cid", list(CODEC_CONFIGS))
@given(steps=st.integers(1, 12), n=st.integers(1, 300), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
@settings(max_examples=20)
def test_nothing_is_lost(cid, steps, n, seed, dtype):
    """sum_t decode(packet_t) + e_T == sum_t g_t, to float tolerance."""
    ef = ErrorFeedback(make_codec(cid))
    g = torch.Generator().manual_seed(seed)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        grad = torch.randn(n, generator=g).to(dtype)
        total += grad.double()
        packet = ef.compress("w", grad, seed=t)
        sent += ef.codec.decode(packet).double()
    scale = float(total.abs().max()) + 1.0
    err = float((sent + ef.residual("w").double() - total).abs().max())
    assert err <= 1e-5 * steps * scale  # residuals are float32: rounding only


def test_residual_is_what_was_dropped():
    ef = ErrorFeedback(codecs.get("topk", k=1))
    packet = ef.compress("w", torch.tensor([1.0, -3.0, 2.0]))
    assert ef.codec.decode(packet).tolist() == [0.0, -3.0, 0.0]
    assert ef.residual("w").tolist() == [1.0, 0.0, 2.0]
    packet = ef.compress("w", torch.tensor([0.5, 0.0, 0.0]))  # c = [1.5, 0, 2]: sends the 2
    assert ef.codec.decode(packet).tolist() == [0.0, 0.0, 2.0]
    assert ef.residual("w").tolist() == [1.5, 0.0, 0.0]


def test_keys_are_independent_and_shapes_kept():
    ef = ErrorFeedback(codecs.get("sign"))
    ef.compress("a", torch.randn(3, 4))
    ef.compress("b", torch.randn(5))
    assert ef.residual("a").shape == (3, 4) and ef.residual("b").shape == (5,)
    assert sorted(ef.keys()) == ["a", "b"] and len(ef) == 2


def test_half_precision_residual_kept_in_float32():
    ef = ErrorFeedback(codecs.get("none"))
    ef.compress("w", torch.tensor([1.0, 2.0], dtype=torch.float16))
    assert ef.residual("w").dtype == torch.float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_step_skipped_and_reported(bad, caplog):
    ef = ErrorFeedback(codecs.get("topk", k=1))
    ef.compress("w", torch.tensor([1.0, -3.0, 2.0]))
    before = ef.residual("w").clone()
    with caplog.at_level(logging.WARNING, logger="commpress"):
        assert ef.compress("w", torch.tensor([bad, 0.0, 0.0])) is None
    assert torch.equal(ef.residual("w"), before)
    assert ef.nonfinite_steps == 1 and ef.nonfinite_counts == {"w": 1}
    assert "non-finite gradient for 'w'" in caplog.text
    # the next finite step proceeds from the untouched residual
    assert ef.compress("w", torch.zeros(3)) is not None


def test_fp16_overflow_of_grad_plus_residual_is_non_finite():
    ef = ErrorFeedback(codecs.get("topk", k=1))
    ef.compress("w", torch.tensor([60000.0, 0.0, 65000.0], dtype=torch.float16))  # keeps [2]: residual[0] = 60000
    assert ef.compress("w", torch.tensor([60000.0, 0.0, 0.0], dtype=torch.float16)) is None


def test_shape_changes_and_undeclared_keys_rejected():
    ef = ErrorFeedback(codecs.get("sign"), shapes={"w": (2, 2)})
    with pytest.raises(CodecError, match="not declared"):
        ef.compress("v", torch.randn(2, 2))
    with pytest.raises(CodecError, match="declared"):
        ef.compress("w", torch.randn(4))
    free = ErrorFeedback(codecs.get("sign"))
    free.compress("w", torch.randn(4))
    with pytest.raises(CodecError, match="reset"):
        free.compress("w", torch.randn(5))
    free.reset("w")
    free.compress("w", torch.randn(5))


def test_state_dict_round_trip_through_weights_only_load():
    ef = ErrorFeedback(codecs.get("qsgd", bits=4), shapes={"a": (10,), "b": (2, 3)})
    for t in range(3):
        ef.compress("a", torch.randn(10), seed=t)
        ef.compress("b", torch.randn(2, 3), seed=t)
    ef.compress("a", torch.full((10,), float("nan")))
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = ErrorFeedback(codecs.get("qsgd", bits=4), shapes={"a": (10,), "b": (2, 3)})
    fresh.load_state_dict(state)
    assert torch.equal(fresh.residual("a"), ef.residual("a")) and torch.equal(fresh.residual("b"), ef.residual("b"))
    assert fresh.nonfinite_steps == 1
    # identical continuation
    g = torch.randn(10)
    assert torch.equal(ef.codec.decode(ef.compress("a", g, seed=9)), fresh.codec.decode(fresh.compress("a", g, seed=9)))


def test_load_state_dict_validates_everything():
    ef = ErrorFeedback(codecs.get("topk", ratio=0.1), shapes={"w": (4,)})
    ef.compress("w", torch.randn(4))
    good = ef.state_dict()
    with pytest.raises(CodecError, match="codec mismatch"):
        ErrorFeedback(codecs.get("topk", ratio=0.2)).load_state_dict(good)
    with pytest.raises(ValueError, match="shape"):
        ErrorFeedback(codecs.get("topk", ratio=0.1), shapes={"w": (5,)}).load_state_dict(good)
    with pytest.raises(ValueError, match="not a declared key"):
        ErrorFeedback(codecs.get("topk", ratio=0.1), shapes={"v": (4,)}).load_state_dict(good)
    with pytest.raises(ValueError, match="missing"):
        ef.load_state_dict({"format": 1})
    with pytest.raises(ValueError, match="NaN"):
        ef.load_state_dict({**good, "residuals": {"w": torch.full((4,), float("nan"))}})
    with pytest.raises(ValueError, match="dtype"):
        ef.load_state_dict({**good, "residuals": {"w": torch.zeros(4, dtype=torch.int64)}})
    with pytest.raises(ValueError, match="format"):
        ef.load_state_dict({**good, "format": 99})
    # a failed load changed nothing
    assert torch.equal(ef.residual("w"), good["residuals"]["w"])


def test_set_residual_replaces_and_forgets():
    ef = ErrorFeedback(codecs.get("topk", k=1), shapes={"w": (3,)})
    ef.compress("w", torch.tensor([1.0, -3.0, 2.0]))
    ef.set_residual("w", torch.zeros(3))
    assert ef.residual("w").tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(CodecError, match="shape"):
        ef.set_residual("w", torch.zeros(4))
    with pytest.raises(CodecError, match="float32"):
        ef.set_residual("w", torch.zeros(3, dtype=torch.int32))
    ef.set_residual("w", None)
    assert ef.residual("w") is None


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "randomk:ratio=0.1", "randomk:ratio=0.1,scaled=False"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sparse_residual_update_equals_the_dense_one(spec, dtype):
    # the error-feedback update of sparse codecs subtracts only what was sent: same bits as
    # subtracting the dense decoded tensor, signed zeros included
    codec = codecs.from_spec(spec)
    rdt = torch.float64 if dtype == torch.float64 else torch.float32
    bits = torch.int64 if rdt == torch.float64 else torch.int32
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    packet = codec.encode(x, seed=3)
    c = x.to(rdt) + torch.randn(1000, generator=torch.Generator().manual_seed(2), dtype=rdt) * 1e-3
    c[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0], dtype=rdt)
    want = c.clone().sub_(codec.decode(packet).to(rdt))
    got = c.clone()
    codec._subtract_decoded(packet, got)
    assert torch.equal(got.view(bits), want.view(bits))


def test_save_and_rollback_restore_the_residual_without_reallocating():
    ef = ErrorFeedback(codecs.get("sign"))
    with pytest.raises(CodecError, match="without a save"):
        ef.rollback("w")
    ef.save("w")  # no residual yet: rolling back forgets the one the step created
    ef.set_residual("w", torch.ones(8))
    ef.rollback("w")
    assert ef.residual("w") is None
    ef.set_residual("w", torch.arange(8.0))
    ef.save("w")
    ef.residual("w").mul_(-1)  # a fused kernel updates in place
    ef.rollback("w")
    assert torch.equal(ef.residual("w"), torch.arange(8.0))
    buffers = {ef.residual("w").data_ptr(), ef._spare["w"].data_ptr()}
    for _ in range(3):  # the two buffers take turns: no new allocation
        ef.save("w")
        ef.residual("w").add_(1)
        ef.rollback("w")
        assert {ef.residual("w").data_ptr(), ef._spare["w"].data_ptr()} == buffers
    assert torch.equal(ef.residual("w"), torch.arange(8.0))


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "sign", "randomk:ratio=0.2,scaled=False"])
def test_save_rollback_and_buffer_reuse_keep_the_residuals_exact(spec):
    # the same steps with and without save()/rollback() around them: identical residuals, and
    # a rolled-back step leaves exactly the residual from before it
    plain = ErrorFeedback(codecs.from_spec(spec))
    saving = ErrorFeedback(codecs.from_spec(spec))
    g = torch.Generator().manual_seed(5)
    for step in range(8):
        grad = torch.randn(300, generator=g)
        before = None if saving.residual("w") is None else saving.residual("w").clone()
        saving.save("w")
        packet = saving.compress("w", grad, seed=step)
        if step % 3 == 2:  # void this step
            saving.rollback("w")
            got = saving.residual("w")
            assert (got is None and before is None) or torch.equal(got, before)
            continue
        want = plain.compress("w", grad, seed=step)
        assert torch.equal(wire.to_bytes(packet), wire.to_bytes(want))
        assert torch.equal(saving.residual("w"), plain.residual("w"))


def test_check_loaded_tensor_names_the_entry():
    from commpress.checks import MAX_PLAUSIBLE_ABS, check_loaded_tensor

    assert MAX_PLAUSIBLE_ABS == 1e15

    check_loaded_tensor(torch.zeros(3), "residual 'w'", numel=3)
    check_loaded_tensor(torch.zeros(0, dtype=torch.float64), "residual 'w'")
    cases = [
        ([1.0], {"numel": 2}, "residual 'w' has 1 elements, expected 2"),
        (torch.zeros(2, dtype=torch.float16), {}, "residual 'w' has dtype torch.float16, expected float32 or float64"),
        (torch.tensor([float("nan")]), {}, "residual 'w' contains NaN or Inf"),
        (torch.tensor([1e30]), {}, "residual 'w' holds 1e\\+30, beyond the plausible magnitude 1e\\+15"),
    ]
    for value, kwargs, message in cases:
        t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        with pytest.raises(ValueError, match=message):
            check_loaded_tensor(t, "residual 'w'", **kwargs)
    with pytest.raises(ValueError, match="must be a tensor"):
        check_loaded_tensor([1.0], "residual 'w'")
