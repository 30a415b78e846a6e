"""What the planner reads: each block's profile, the treatments, and what each treatment holds and costs.

Made by ``profile.py`` (measured on a block) and by ``planning/`` (predicted on fake tensors), read by
``planner.py``, ``policy.py`` and ``ranks.py``; plain data, so that none of those need the code that
measures it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["CHOICES", "Choice", "BlockProfile", "OptionCost"]

Choice = Literal["keep", "selective", "full", "offload", "pointwise"]
CHOICES: tuple[str, ...] = ("keep", "selective", "full", "offload", "pointwise")


@dataclass
class OptionCost:
    """What one treatment of one block holds and costs. Bytes and FLOPs are per training step."""

    internal_bytes: int
    """Bytes held for backward, other than the block's primary input and output."""
    saves_input: bool
    """Whether the block's primary input (its first tensor argument) is held for backward."""
    saves_output: bool
    """Whether the block's primary output (its first output tensor) is held for backward."""
    recompute_flops: int = 0
    """Compute-heavy FLOPs run again in backward."""
    recompute_bytes: int = 0
    """Bytes read and written by the other (pointwise, memory-bound) ops run again in backward."""
    transfer_bytes: int = 0
    """Bytes copied to CPU in forward (and back in backward)."""
    seconds: float | None = None
    """Measured seconds this treatment adds to the block's forward and backward over ``keep`` (median of
    paired rounds, :mod:`~lightning_memopt.checkpointing.timing`); None where not timed."""


@dataclass
class BlockProfile:
    """One block's profile: sizes of its boundary tensors and the cost of every treatment."""

    name: str
    forward_flops: int
    input_bytes: int
    output_bytes: int
    chained: bool
    """Whether the block's primary input is the previous block's primary output (the same storage)."""
    options: dict[str, OptionCost] = field(default_factory=dict)
    input_held: bool = False
    """Whether an op outside the blocks already holds the primary input for backward (a ReLU before the
    first block saves its output): then keeping the input costs the block nothing."""
    seconds: float | None = None
    """Measured seconds of the block's forward and backward, kept (median); None where not timed."""
    note: str | None = None
    """Why the block can only keep its activations (its recomputation would not reproduce its forward);
    then ``options`` holds ``keep`` alone. None for a block every treatment applies to."""

    def activation_bytes(self, choice: str) -> int:
        """Bytes the block alone holds for backward under ``choice`` (boundaries included)."""
        o = self.options[choice]
        return o.internal_bytes + self.input_bytes * o.saves_input + self.output_bytes * o.saves_output

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BlockProfile:
        d = dict(d)
        d["options"] = {k: OptionCost(**v) for k, v in d["options"].items()}
        return cls(**d)
