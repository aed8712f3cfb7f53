"""Where a step is: the explicit state every part of the engine reads instead of loose booleans."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    IDLE = "idle"  # no micro-batch in flight: blocks called now are plain host modules
    FORWARD = "forward"  # a micro-batch's step function (or the time until its backward begins)
    BACKWARD = "backward"  # its backward has begun (the first block's backward ran)


@dataclass
class StepState:
    """The engine's position in the training loop.

    ``step_open``: the user's step function is running, so block calls stream (outside it a block is a
    plain host module). Under automatic optimisation Lightning runs the backward after the step function
    returned, so ``phase`` may be BACKWARD while ``step_open`` is False.
    """

    step_open: bool = False
    phase: Phase = Phase.IDLE
    calls: dict[int, int] = field(default_factory=dict)  # forward calls of each block not yet backwarded
    recorded: list[int] = field(default_factory=list)  # this micro-batch's block calls, in order

    def open(self) -> None:
        """The user's step function begins: a micro-batch is in flight until its backward is done."""
        self.step_open = True
        self.recorded = []
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD

    def close(self, backward_follows: bool) -> None:
        """The user's step function returned; without a backward to come, the micro-batch is over."""
        self.step_open = False
        if not backward_follows:
            self.end_micro_batch()

    def forward_call(self, block: int) -> None:
        self.phase = Phase.FORWARD if self.phase is Phase.IDLE else self.phase
        self.recorded.append(block)
        self.calls[block] = self.calls.get(block, 0) + 1

    def backward_call(self, block: int) -> bool:
        """``block``'s backward begins; True if its gradients are final (its last outstanding call)."""
        left = self.calls.get(block, 1) - 1
        self.calls[block] = left
        return left <= 0

    def begin_backward(self) -> bool:
        """A block's backward begins; True at the first of the micro-batch."""
        first = self.phase is not Phase.BACKWARD
        self.phase = Phase.BACKWARD
        return first

    def end_micro_batch(self) -> list[int]:
        """The backward is done: back to IDLE; returns the recorded call order."""
        recorded, self.recorded, self.calls, self.phase = self.recorded, [], {}, Phase.IDLE
        return recorded
