"""Step-wise learning-rate schedule: linear warmup, then cosine decay or constant."""

from __future__ import annotations

import math


class WarmupCosine:
    """LambdaLR multiplier: `step/warmup` up to `warmup`, then cosine from 1 to `min_ratio`.

    A callable object rather than a closure so that LambdaLR's `state_dict()` (and so Lightning
    checkpoints) can save it. `decay_steps=None` holds the rate constant after warmup.
    """

    def __init__(self, warmup_steps: int, decay_steps: int | None, min_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.decay_steps or self.decay_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
