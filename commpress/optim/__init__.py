"""Optimizer modes owned by no adapter: DDP, FSDP and local-step training compose the same objects.

Each mode works on parameter names and tensor views (never buckets or shards) and keeps its own
checkpoint form and statistics; the divergence guard (:mod:`.guard`) is the template.

- :mod:`.discovery`: the optimizer found at its first step when none is passed (:class:`OptimizerDiscovery`);
- :mod:`.momentum`: DGC momentum correction and masking (:class:`MomentumCorrection`, :class:`MomentumRule`);
- :mod:`.sgd`: the user's SGD momentum moved into the hook and handed back (:class:`SGDHandover`);
- :mod:`.adam`: Adam/AdamW with compressed momentum and frozen variance (:class:`FrozenVarianceAdam`);
- :mod:`.warmup`: dense or unbiased warm-up steps (:class:`Warmup`);
- :mod:`.guard`: residual-to-input watch with dense fallback steps (:class:`DivergenceGuard`);
- :mod:`.choice`: which of them drives the user's optimizer (:func:`optimizer_mode`);
- :mod:`.base`: the contract of a mode a user adds (:class:`OptimizerMode`, ``modes=[...]``).
"""

from .adam import FrozenVarianceAdam, adam_unsupported, adopt_adam, is_adam_like
from .base import OptimizerMode
from .choice import optimizer_mode
from .discovery import DISCOVER, OptimizerDiscovery
from .guard import DivergenceGuard
from .momentum import (
    MomentumCorrection,
    MomentumRule,
    as_velocity,
    check_rule,
    momentum_as_gain,
)
from .sgd import (
    GROUP_KEY,
    SGDHandover,
    give_back_momentum,
    has_momentum,
    is_sgd_like,
    take_over_momentum,
)
from .warmup import DEFAULT_WARMUP_CODEC, DEFAULT_WARMUP_STEPS, Warmup, resolve_warmup_codec

__all__ = [
    "DISCOVER", "OptimizerDiscovery", "DEFAULT_WARMUP_CODEC", "DEFAULT_WARMUP_STEPS", "DivergenceGuard", "FrozenVarianceAdam", "GROUP_KEY",
    "MomentumCorrection", "MomentumRule", "OptimizerMode", "SGDHandover", "Warmup", "adam_unsupported", "adopt_adam", "as_velocity",
    "check_rule", "give_back_momentum", "has_momentum", "is_adam_like", "is_sgd_like", "optimizer_mode", "resolve_warmup_codec",
    "momentum_as_gain", "take_over_momentum",
]
