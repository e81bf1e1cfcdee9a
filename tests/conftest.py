import os

import pytest
from hypothesis import HealthCheck, settings

from kernel_backends import activate

# CI profile: deterministic (derandomized) so a red run is reproducible, bounded in time.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def backend(request):
    """The kernel backend under test (see kernel_backends.py); parametrize it indirectly."""
    yield from activate(request.param)


@pytest.fixture
def group_of_one():
    """A 1-rank gloo process group in this process (skips when one is already initialised)."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # no DDP reducer may outlive the group (see ddp_workers._quiesce)
        dist.destroy_process_group()
