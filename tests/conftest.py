"""Tests marked ``cuda`` need a CUDA device: they skip cleanly without one, so ``python -m pytest -q tests``
is the one command on CPU machines and on GPU machines alike.

AutoCheckpoint times each treatment while it profiles (plans priced in seconds). In tests its clock counts
work instead (:class:`tests.checkpointing.clocks.WorkClock`): a plan a test asserts is the same on every
run, and no test depends on how busy the machine is. Tests of the timing itself pass their own clocks.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker 'cuda')")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def deterministic_step_clock(monkeypatch):
    """AutoCheckpoint's treatments timed on a :class:`WorkClock`, not on the wall clock."""
    from lightning_memopt.checkpointing import policy
    from tests.checkpointing.clocks import WorkClock

    monkeypatch.setattr(policy, "step_clock", lambda device: WorkClock())
