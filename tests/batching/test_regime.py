"""choose_regime without a Trainer: which regime each phase, strategy and stability gets."""

import types

import pytest
import torch

from lightning_memopt.batching import regime as regime_module
from lightning_memopt.batching.errors import MicroBatchOOMError
from lightning_memopt.batching.regime import (
    Agreed,
    Overlapped,
    Regime,
    Sharded,
    Sharding,
    Unagreed,
    choose_regime,
)
from tests.batching.helpers import patch_regime


def strategy(ddp: bool = False) -> types.SimpleNamespace:
    model = torch.nn.Linear(2, 2)
    if ddp:  # stands in for DistributedDataParallel: only the type is looked at
        model = types.SimpleNamespace(require_forward_param_sync=True)
    return types.SimpleNamespace(model=model, root_device=torch.device("cpu"))


@pytest.fixture
def distributed(monkeypatch):
    agreements = []
    patch_regime(monkeypatch, "is_distributed", lambda: True)
    monkeypatch.setattr(regime_module, "any_rank", lambda flag, device=None: agreements.append(flag) or flag)
    return agreements


def test_one_process_is_local_in_every_phase():
    for phase in ("training", "evaluation", "optimizer_step"):
        regime = choose_regime(phase, strategy(), retry=True, stable_steps=5, overlap_after=0)
        assert type(regime) is Regime and not regime.distributed
        assert regime.failed("OOM", peer=False) and not regime.failed(None, peer=False)


def test_training_regimes(distributed, monkeypatch):
    sharding = Sharding([torch.nn.Linear(1, 1)])
    assert (
        type(choose_regime("training", strategy(), retry=False)) is Regime
    )  # DDP syncs in the last backward
    agreed = choose_regime("training", strategy(), retry=True, micro_batches=4)
    assert type(agreed) is Agreed and agreed.average
    monkeypatch.setattr(regime_module, "ddp_module", lambda s: s.model)
    stable = {"retry": True, "stable_steps": 2, "overlap_after": 2}
    assert type(choose_regime("training", strategy(True), micro_batches=4, **stable)) is Overlapped
    assert (
        type(choose_regime("training", strategy(True), micro_batches=1, **stable)) is Agreed
    )  # nothing to overlap
    assert (
        type(choose_regime("training", strategy(), sharding=sharding, micro_batches=4, retry=True)) is Sharded
    )
    unsynced = choose_regime("training", strategy(), sharding=sharding, size=3, **stable)
    assert type(unsynced) is Unagreed and not unsynced.failed(None, peer=False)
    with pytest.raises(
        MicroBatchOOMError, match=r"under FSDP2 after 2 clean steps at micro-batch size 3.*\nOOM$"
    ):
        unsynced.failed("OOM", peer=False)
    assert distributed == []  # choosing asks nothing of the other ranks


def test_agreement_and_overlap_failures(distributed, monkeypatch):
    agreed = choose_regime("evaluation", strategy(), retry=True)
    assert type(agreed) is Agreed and not agreed.average
    assert agreed.failed(None, peer=True) and distributed == []  # learned at a sync point: no agreement
    assert agreed.failed("OOM", peer=False) and distributed == [True]
    monkeypatch.setattr(regime_module, "ddp_module", lambda s: s.model)
    overlap = choose_regime(
        "training", strategy(True), retry=True, micro_batches=2, stable_steps=1, overlap_after=1
    )
    with overlap.around(0, last=False):
        assert overlap.ddp.require_forward_param_sync  # the first micro-batch broadcasts buffers
    assert overlap.failed("OOM", peer=False)  # before the sync point: agreed on
    assert distributed == [True, True]
    with overlap.around(1, last=True):  # the sync point: the agreement on the first micro-batch
        assert not overlap.ddp.require_forward_param_sync
    assert distributed == [True, True, False]
    assert not overlap.failed(None, peer=False)  # no agreement after it
    assert distributed == [True, True, False]
    with pytest.raises(MicroBatchOOMError, match="while DDP synchronizes gradients during backward"):
        overlap.failed("OOM", peer=False)


def test_optimizer_step_agrees_only_while_unsettled(distributed):
    assert type(choose_regime("optimizer_step", strategy(), retry=True, stable_steps=1)) is Agreed
    settled = choose_regime("optimizer_step", strategy(), retry=True, stable_steps=2)
    assert type(settled) is Unagreed and not settled.agrees
    with pytest.raises(MicroBatchOOMError, match=r"had already stepped cleanly.*\nOOM\nWhat to do"):
        settled.failed("OOM", peer=False)
