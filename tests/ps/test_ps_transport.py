"""MPI transport tests written against a communicator ``COMM``.

They pass serially (``COMM`` has one rank: every message goes to oneself) and on a ring of
K ranks: ``mpirun -n K python tests/ps/test_ps_transport.py`` runs them without pytest's
start-up cost (tests/test_ps_mpi.py does), ``mpirun -n K python -m pytest ...`` works too.
"""

import time

import numpy as np
import pytest
import torch

MPI = pytest.importorskip("mpi4py.MPI")

from commpress.ps import ProtocolError, transport  # noqa: E402
from commpress.ps.protocol import TO_SERVER, MsgType, build, parse_header  # noqa: E402
from commpress.ps.transport import Inbox, Outbox, cuda_aware, to_mpi  # noqa: E402

COMM = MPI.COMM_WORLD


@pytest.fixture
def comm():
    c = COMM.Dup()
    yield c
    c.Barrier()
    c.Free()


def _ring(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    return (r + 1) % n, (r - 1) % n


def test_messages_travel_as_byte_buffers(comm):
    dest, src = _ring(comm)
    out = Outbox(comm)
    payload = bytes(range(256)) * 4
    out.post(dest, build(MsgType.PUSH, shard=0, worker=comm.Get_rank(), step=7, parts=[payload]))
    got = Inbox(comm, 4096).wait([src], time.monotonic() + 30)
    assert got is not None and got[0] == src
    head = parse_header(got[1], src, TO_SERVER)
    assert (head.worker, head.step, head.nbytes) == (src, 7, len(payload))
    assert got[1][48:].tobytes() == payload
    assert out.flush(time.monotonic() + 30)


def test_oversized_message_is_consumed_and_rejected(comm):
    dest, src = _ring(comm)
    out = Outbox(comm)
    out.post(dest, np.zeros(10_000, dtype=np.uint8))
    out.post(dest, build(MsgType.BYE, shard=0, worker=0, step=1))
    inbox = Inbox(comm, 1000)
    deadline = time.monotonic() + 30
    while (sender := inbox.probe(src)) is None:
        assert time.monotonic() < deadline
    with pytest.raises(ProtocolError, match="oversized message: 10000 bytes") as info:
        inbox.receive(sender)
    assert info.value.sender == src
    got = inbox.wait([src], time.monotonic() + 30)  # the next message is intact
    assert got is not None and parse_header(got[1], src, TO_SERVER).type == MsgType.BYE
    assert out.flush(time.monotonic() + 30)


def test_wait_has_a_deadline(comm):
    t0 = time.monotonic()
    assert Inbox(comm, 100, tag=4242).wait([comm.Get_rank()], time.monotonic() + 0.05) is None
    assert time.monotonic() - t0 < 5


def test_host_buffers_are_zero_copy_views():
    t = torch.arange(16, dtype=torch.uint8)
    view = to_mpi(t, device_buffers=False)
    view[0] = 99
    assert t[0] == 99
    assert cuda_aware("no") is False


def test_open_mpi_says_whether_it_is_cuda_aware():
    answer = transport.mpix_cuda_support()
    if MPI.Get_library_version().startswith("Open MPI"):
        assert isinstance(answer, bool)  # the pip wheel of Open MPI: False
    else:
        assert answer in (None, False, True)


class _FakeMPI:
    def __init__(self, answer):
        self.answer = answer

    def Query_cuda_support(self):  # noqa: N802 - mpi4py's spelling
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_cuda_aware_auto_asks_mpi(monkeypatch):
    monkeypatch.setattr(transport, "_cupy", lambda: object())  # as if CuPy were installed
    assert cuda_aware("yes") is True and cuda_aware("no") is False
    for answer, want in ((True, True), (False, False), (RuntimeError("no extension"), False)):
        monkeypatch.setattr(transport, "mpi", lambda a=answer: _FakeMPI(a))
        assert cuda_aware("auto") is want
    # an mpi4py without Query_cuda_support: Open MPI's MPIX query decides
    monkeypatch.setattr(transport, "mpi", lambda: object())
    for answer in (True, False, None):
        monkeypatch.setattr(transport, "mpix_cuda_support", lambda a=answer: a)
        assert cuda_aware("auto") is bool(answer)
    monkeypatch.setattr(transport, "_cupy", lambda: None)  # device buffers need CuPy
    assert cuda_aware("yes") is False


def test_device_buffers_without_a_device_tensor_stay_host_views():
    t = torch.arange(8, dtype=torch.uint8)
    view = to_mpi(t, device_buffers=True)  # CPU tensors never go through CuPy
    assert isinstance(view, np.ndarray) and np.shares_memory(view, t.numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_go_as_host_copies_or_device_buffers(comm):
    t = torch.arange(64, dtype=torch.uint8, device="cuda")
    host = to_mpi(t, device_buffers=False)
    assert isinstance(host, np.ndarray) and host.tolist() == list(range(64))
    cupy = pytest.importorskip("cupy")
    dev = to_mpi(t, device_buffers=True)
    assert isinstance(dev, cupy.ndarray) and int(dev[5]) == 5
    assert dev.data.ptr == t.data_ptr()  # the device buffer itself, no copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_buffers_travel(comm):
    # staged through host memory, or handed to MPI as device memory when it is CUDA-aware
    dest, src = _ring(comm)
    aware = cuda_aware("auto")
    out = Outbox(comm, device_buffers=aware)
    msg = build(MsgType.PUSH, shard=0, worker=comm.Get_rank(), step=3, parts=[bytes(range(200))])
    out.post(dest, msg.cuda())
    got = Inbox(comm, 4096).wait([src], time.monotonic() + 30)
    assert got is not None and got[1][48:].tobytes() == bytes(range(200))
    assert out.flush(time.monotonic() + 30)


def _main() -> None:
    for test in (
        test_messages_travel_as_byte_buffers,
        test_oversized_message_is_consumed_and_rejected,
        test_wait_has_a_deadline,
    ):
        c = COMM.Dup()
        test(c)
        c.Barrier()
        c.Free()
    test_host_buffers_are_zero_copy_views()
    print(f"rank {COMM.Get_rank()}/{COMM.Get_size()}: transport tests passed", flush=True)


if __name__ == "__main__":
    _main()
