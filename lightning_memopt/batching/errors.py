"""The error micro-batching raises when splitting cannot help, and the advice it carries (plain Python)."""

from __future__ import annotations

__all__ = [
    "BATCHNORM_ADVICE",
    "CHECKLIST",
    "MicroBatchOOMError",
    "SplitNotExactError",
    "SplitNotExactWarning",
]

# Every option named here exists (tests/batching/test_errors.py checks them against the signatures).
CHECKLIST = """\
What to do, cheapest first:
  1. precision="bf16-mixed" (or "16-mixed") on the Trainer: activations take half the bytes.
  2. lightning_memopt.AutoCheckpoint(): recompute activations in backward instead of keeping them.
  3. lightning_memopt.BatchNormToGroupNorm(): small micro-batches make BatchNorm statistics noisy;
     GroupNorm does not depend on the micro-batch size.
  4. Shard parameters, gradients and optimizer state across devices with Lightning's
     strategy="fsdp" or ModelParallelStrategy (FSDP2).
  5. Offload saved activations to CPU memory: AutoCheckpoint(mode="offload"), or
     AutoCheckpoint(allow_offload=True) to let its planner offload where that is cheapest.
  6. A smaller model or shorter sequences: one sample does not fit as it is."""

BATCHNORM_ADVICE = (
    "The model has BatchNorm layers in training mode, which need at least 2 samples per micro-batch "
    "(their statistics are computed over the micro-batch): add lightning_memopt.BatchNormToGroupNorm() "
    "to the callbacks (or lightning_memopt.norm.convert_batchnorm(model)) so that one sample can run."
)


class MicroBatchOOMError(RuntimeError):
    """Out of memory at the smallest micro-batch: splitting the batch further cannot help.

    The smallest micro-batch is one sample, or two for a model with BatchNorm layers in training mode.
    The message holds the failed step's memory by category and a checklist of what to do.

    A ``RuntimeError`` subclass on purpose: :func:`~lightning_memopt.batching.oom.is_out_of_memory` never
    takes it for an allocator error, so nothing retries it again.
    """


class SplitNotExactWarning(UserWarning):
    """Micro-batching will not give this step the unsplit batch's gradient, and the message says why.

    Raised as a warning (once, on rank zero) by the micro-batching callbacks when their one-time check
    finds that a split batch's gradient differs from another split's, or when something they see makes
    the result depend on the split: BatchNorm in training mode, a parameter or buffer written in place
    inside ``training_step``, a loss that couples the samples of a batch. The message names the cause
    and the fix; ``exactness="raise"`` turns it into :class:`SplitNotExactError`.
    """


class SplitNotExactError(RuntimeError):
    """What :class:`SplitNotExactWarning` reports, raised instead (``exactness="raise"``)."""
