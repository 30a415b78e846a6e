"""Every callback of the package at once, on third-party models: after ``fit``, finished or failed,
nothing of the package stays on the model or keeps the Trainer or the model alive.

Checked the way a user's sweep would notice: weak references to the Trainer and the model die after
``del`` and ``gc.collect()`` while the user still holds the callbacks; ``torch.save(model)`` pickles
(a leftover instance wrapper is a local function and does not); no instance attribute the package
added remains on the model or its modules; ``state_dict`` keys are the model's own.
"""

from __future__ import annotations

import contextlib
import gc
import io
import weakref

import pytest
import torch

from lightning_memopt import (
    AutoAccumulation,
    AutoCheckpoint,
    BatchNormToGroupNorm,
    DataLoaderMonitor,
    MemoryMonitor,
    OOMBackoff,
)
from lightning_memopt.norm import SwappedGroupNorm
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import ZooModule, loader


class Failing(ZooModule):
    """The user's bug on the second step: the fit raises out of ``training_step``."""

    def __init__(self, name: str, fails: bool) -> None:
        super().__init__(name)
        self.fails = fails

    def training_step(self, batch, batch_idx):
        if self.fails and batch_idx == 1:
            raise ValueError("the user's bug")
        return super().training_step(batch, batch_idx)


def _instance_attributes(model: torch.nn.Module) -> dict[str, tuple[type, set[str]]]:
    return {name: (type(m), set(vars(m))) for name, m in model.named_modules()}


def _fit(model, callbacks, tmp_path, name, fails):
    trainer = quiet_trainer(callbacks, max_steps=2, default_root_dir=tmp_path)
    raised = pytest.raises(ValueError, match="the user's bug") if fails else contextlib.nullcontext()
    with raised:
        trainer.fit(model, loader(name, batch_size=4))
    assert trainer.global_step == (1 if fails else 2)
    return trainer


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_every_callback_together_leaves_nothing_behind(tmp_path, name, fails):
    # What Lightning itself leaves on a module (e.g. ``_hparams``) is the baseline, not a leftover.
    plain = Failing(name, fails)
    _fit(plain, [], tmp_path, name, fails)
    lightning_leaves = _instance_attributes(plain)

    model = Failing(name, fails)
    keys = list(model.state_dict())
    callbacks = [  # kept by the caller, as a user may keep them
        BatchNormToGroupNorm(),
        AutoCheckpoint(),
        AutoAccumulation(micro_batch_size=2),
        OOMBackoff(),
        MemoryMonitor(dirpath=tmp_path),
        DataLoaderMonitor(),
    ]
    trainer = _fit(model, callbacks, tmp_path, name, fails)

    assert list(model.state_dict()) == keys  # the swap keeps the BatchNorm keys; checkpointing adds none
    after = _instance_attributes(model)
    assert set(after) == set(lightning_leaves)  # no module added or removed
    # The one lasting change is by design: each BatchNorm is now a GroupNorm (the trained architecture).
    swapped = {n for n in after if after[n][0] is not lightning_leaves[n][0]}
    assert all(lightning_leaves[n][0].__name__.startswith("BatchNorm") for n in swapped)
    assert all(after[n][0] is SwappedGroupNorm for n in swapped) and (len(swapped) > 0) == (name == "resnet")
    added = {n: after[n][1] - lightning_leaves[n][1] for n in after if n not in swapped}
    assert {n: a for n, a in added.items() if a} == {}, "left on the model"
    torch.save(model, io.BytesIO())

    # The parameters too: what holds their memory (a dry run's autograd graph holding the hook that
    # holds the graph, a cycle no collector frees, would keep them after the model is gone).
    alive = [weakref.ref(trainer), weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    del trainer, model
    gc.collect()
    assert [ref() for ref in alive] == [None] * len(alive)
