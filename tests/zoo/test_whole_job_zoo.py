"""The user's whole job on architectures nobody here wrote: the three callbacks with a limit the batch does
not fit whole, as a Lightning user adds them, against the same fit of the unsplit batch.

The limit is read from the model itself: a plain step's peak (live tensor bytes, MemoryTracker) at a
quarter of the batch, plus half its growth to half the batch, so that the search's ways, the trial and the
plan all run (the recompute way's micro-batch is planned, profiled and timed in the fit's own steps).
"""

from __future__ import annotations

import warnings

import pytest

from lightning_memopt import AutoAccumulation, AutoCheckpoint, OOMBackoff
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import ZooModule, loader, no_dropout, whole_job_limit

BATCH, STEPS = 16, 3


@pytest.mark.parametrize(
    ("name", "precision"), [("vit", "32-true"), ("vit", "bf16-mixed"), ("llama", "32-true")]
)
def test_the_defaults_train_a_batch_that_does_not_fit_as_the_unsplit_batch(name: str, precision: str) -> None:
    limit = whole_job_limit(name, BATCH, precision)
    reference = no_dropout(ZooModule(name, lr=0.01))
    quiet_trainer(max_steps=STEPS, precision=precision).fit(reference, loader(name, BATCH, batches=STEPS))
    module = no_dropout(ZooModule(name, lr=0.01))
    keys = list(module.state_dict())
    callbacks = [AutoCheckpoint(max_memory=limit), AutoAccumulation(max_memory=limit), OOMBackoff()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(callbacks, max_steps=STEPS, precision=precision).fit(
            module, loader(name, BATCH, batches=STEPS)
        )
    said = [str(w.message) for w in caught]
    assert not [s for s in said if "unsplit batch's gradient" in s], said  # the check passed
    assert list(module.state_dict()) == keys
    if (
        precision == "32-true"
    ):  # the unsplit batch's update, to float32 rounding (under bf16-mixed the check's bar)
        start = ZooModule(name).parameters()
        update = max((p - s).abs().max().item() for p, s in zip(reference.parameters(), start))
        gap = max((p - r).abs().max().item() for p, r in zip(module.parameters(), reference.parameters()))
        assert gap <= 1e-5 * update
