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
