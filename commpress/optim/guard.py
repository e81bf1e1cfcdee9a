"""The divergence guard (an optimizer mode): watch error feedback, and send dense for a while when it runs away.

Error-feedback instability shows early as residuals growing relative to what is compressed
(the residual holds everything not yet sent; when the compressor drops more than the optimizer
can absorb, it grows step after step). Every ``interval`` compressed steps the hook measures,
on every rank, ``ratio = ||residuals|| / ||compressor input||`` over the compressed parameters
(two norm passes, nothing else; the input norm is the larger of the current one and a slow
average of the past ones, so shrinking gradients near convergence do not look like a runaway),
all ranks all-reduce the two sums (so they take the same decision), and when the ratio exceeds ``threshold`` the next ``dense_steps`` steps are plain
dense all-reduces into which each rank flushes its residuals: nothing is lost, the step the
residuals belonged to still happens, and compression resumes afterwards. Every firing is logged
on the ``commpress`` logger and counted in ``stats()`` (``guard_ratio``, ``guard_fired``,
``guard_dense_steps``), so a codec that needs the guard all the time is visible as such.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.faults import wait

logger = logging.getLogger("commpress")


@dataclass
class DivergenceGuard:
    """Residual-to-input ratio watch with a dense fallback (see the module docstring).

    ``threshold=0`` disables the guard. The measurement itself is taken on the hook's thread,
    in bucket order, and the one all-reduce it needs is issued at the step's last bucket, so
    it keeps the collectives' single ordered issue path.
    """

    interval: int = 10
    threshold: float = 20.0
    dense_steps: int = 50
    ratio: float = 0.0
    fired: int = 0
    dense_steps_taken: int = 0
    _dense_left: int = 0
    _input_avg: float = 0.0
    _sums: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def __post_init__(self) -> None:
        for name in ("interval", "dense_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"guard {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise ValueError(f"guard threshold must be a number >= 0 (0: off), got {self.threshold!r}")

    @property
    def enabled(self) -> bool:
        """False when ``threshold`` is 0."""
        return self.threshold > 0

    def dense_now(self) -> bool:
        """True while the guard holds the run on dense steps."""
        return self._dense_left > 0

    def due(self, step: int) -> bool:
        """True when this compressed step is measured."""
        return self.enabled and not self.dense_now() and step % self.interval == 0

    def add(self, residual_sq: float, input_sq: float) -> None:
        """Add one bucket's squared residual and input norms to this step's measurement."""
        self._sums[0] += residual_sq
        self._sums[1] += input_sq

    def end_step(self, measured: bool, group: object = None, device: torch.device | str = "cpu") -> None:
        """Close a step: count a dense step, or decide from this step's measurement (all ranks)."""
        if self._dense_left > 0:
            self._dense_left -= 1
            self.dense_steps_taken += 1
            return
        if not measured:
            return
        sums = torch.tensor(self._sums, dtype=torch.float64, device=device)
        self._sums = [0.0, 0.0]
        wait(dist.all_reduce(sums, group=group, async_op=True), device)  # the same decision on every rank
        e_sq, x_sq = float(sums[0]), float(sums[1])
        if x_sq <= 0.0 or not (e_sq == e_sq) or not (x_sq == x_sq):  # nothing compressed, or a NaN step
            return
        # Gradients shrink as training converges while the residual still holds older, larger
        # ones: against the current input alone the ratio then climbs in a healthy run (sign on
        # digits: 0.8 -> 21 by the last epoch). Measure against a slow average of input norms.
        x_norm = x_sq**0.5
        self._input_avg = x_norm if self._input_avg == 0.0 else 0.8 * self._input_avg + 0.2 * x_norm
        self.ratio = e_sq**0.5 / max(x_norm, self._input_avg)
        logger.debug("commpress guard: residual/input ratio %.3f", self.ratio)
        if self.ratio > self.threshold:
            self.fired += 1
            self._dense_left = self.dense_steps
            logger.warning(
                "commpress: error-feedback residuals are %.1fx the compressed input (guard threshold "
                "%.1f): the next %d steps are dense and flush the residuals (fired %d time(s); a codec "
                "that keeps firing drops too much for this optimizer setting: try topk or a larger ratio)",
                self.ratio, self.threshold, self.dense_steps, self.fired,
            )

    def state(self) -> list[float]:
        """Checkpoint form: ``[dense steps left, fired, dense steps taken, last ratio]``."""
        return [self._dense_left, self.fired, self.dense_steps_taken, self.ratio]

    def load(self, value: object) -> None:
        """Restore :meth:`state` output (validated)."""
        if not isinstance(value, (list, tuple)) or len(value) != 4:
            raise ValueError(f"guard state must be [left, fired, taken, ratio], got {value!r}")
        left, fired, taken, ratio = value
        if not all(isinstance(v, int) and 0 <= v < 1 << 62 for v in (left, fired, taken)):
            raise ValueError(f"guard state counters must be non-negative ints, got {value!r}")
        if not isinstance(ratio, (int, float)) or not 0 <= ratio < float("inf"):
            raise ValueError(f"guard ratio must be finite and >= 0, got {ratio!r}")
        self._dense_left, self.fired, self.dense_steps_taken, self.ratio = left, fired, taken, float(ratio)

    def stats(self) -> dict[str, float]:
        """The guard's counters for ``CompressionState.stats()``."""
        return {"guard_ratio": self.ratio, "guard_fired": self.fired, "guard_dense_steps": self.dense_steps_taken}
