"""commpress parameter server over MPI: sharded servers, compressed push and pull.

Launch with ``mpirun -n N python -m commpress.ps [options]`` (``--help`` lists them). The demos::

    mpirun -n 4 python -m commpress.ps --demo digits --servers 1 --codec topk:ratio=0.05
    mpirun -n 4 python -m commpress.ps --demo bytelm --servers 2 --mode ssp --codec qsgd:bits=8 --steps 300
    mpirun -n 3 python -m commpress.ps --demo digits --local-steps 10 --steps 30 --codec qsgd:bits=4  # DiLoCo: outer-step servers

(as root, add ``--oversubscribe`` and ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``).
From Python, on every rank::

    from commpress import ps

    task = ps.Task(model=make_model, loss=loss_fn, batch=batch_fn,
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    result = ps.run(task, ps.PSConfig(servers=2, mode="ssp", staleness=2, codec="topk:ratio=0.05"))
    if result.rank == 0:
        print(result.metrics, result.stats)
    ps.finish(result)  # ends the job if a dropped worker never exited (it would block mpirun)

The first ``servers`` ranks hold shards of the flat parameter vector (balanced by bytes); the
others are workers. Modules: :mod:`.protocol` (message header and validation),
:mod:`.sharding`; the MPI-free state machines :mod:`.server` (with :mod:`.replies`,
:mod:`.plausibility`, :mod:`.stats`) and :mod:`.worker` over one :mod:`.channel` per shard;
:mod:`.mpi_loop` (every MPI loop) over :mod:`.transport` (the MPI adapter: buffers, requests);
:mod:`.checkpoint`, :mod:`.faults` (testing only), :mod:`.demos`, :mod:`.runner` (``run``).
Importing this package does not start MPI.
"""

from __future__ import annotations

from .config import PSConfig, parse_codec
from .errors import ConfigError, ProtocolError, PSError, ServerTimeout, WorkerTimeout
from .faults import Fault, parse_fault
from .runner import EXIT_ABANDONED, RunResult, StepView, Task, finish, flat_of, reference_train, run
from .sharding import Layout

__all__ = [
    "EXIT_ABANDONED", "ConfigError", "Fault", "Layout", "PSConfig", "PSError", "ProtocolError", "RunResult",
    "ServerTimeout", "StepView", "Task", "WorkerTimeout", "finish", "flat_of", "parse_codec", "parse_fault",
    "reference_train", "run",
]
