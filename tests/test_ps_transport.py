"""MPI transport tests written against a communicator ``COMM``.

They pass serially (``COMM`` has one rank: every message goes to oneself) and on a ring of
K ranks: ``mpirun -n K python tests/test_ps_transport.py`` runs them without pytest's
start-up cost (tests/test_ps_mpi.py does), ``mpirun -n K python -m pytest ...`` works too.
"""

import time

import numpy as np
import pytest
import torch

MPI = pytest.importorskip("mpi4py.MPI")

from commpress.ps import ProtocolError  # noqa: E402
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_go_as_host_copies_or_device_buffers(comm):
    t = torch.arange(64, dtype=torch.uint8, device="cuda")
    host = to_mpi(t, device_buffers=False)
    assert isinstance(host, np.ndarray) and host.tolist() == list(range(64))
    cupy = pytest.importorskip("cupy")
    dev = to_mpi(t, device_buffers=True)
    assert isinstance(dev, cupy.ndarray) and int(dev[5]) == 5


def _main() -> None:
    for test in (test_messages_travel_as_byte_buffers, test_oversized_message_is_consumed_and_rejected,
                 test_wait_has_a_deadline):
        c = COMM.Dup()
        test(c)
        c.Barrier()
        c.Free()
    test_host_buffers_are_zero_copy_views()
    print(f"rank {COMM.Get_rank()}/{COMM.Get_size()}: transport tests passed", flush=True)


if __name__ == "__main__":
    _main()
