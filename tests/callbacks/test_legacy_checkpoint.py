"""A checkpoint written before the two micro-batching callbacks shared one owner still resumes exactly.

``data/two_callbacks_v0_step4.ckpt`` was written by the earlier ``AutoAccumulation`` + ``OOMBackoff`` (each
saving its own state: sizes in samples, a back-off after one out-of-memory error at step 2) at step 4 of an
8-step run: :class:`tests.batching.helpers.Net` built under float64, ``dataset(64)`` in batches of 16, SGD.
``data/two_callbacks_v0_final.pt`` holds that run's final parameters, its limit and its sizes per step.
"""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memopt import AutoAccumulation, OOMBackoff
from tests.batching.helpers import Net, dataset, quiet_trainer

DATA = Path(__file__).parent / "data"


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_a_checkpoint_of_the_two_callbacks_resumes_with_its_sizes_and_ends_as_the_old_run(float64, tmp_path):
    final = torch.load(DATA / "two_callbacks_v0_final.pt", weights_only=False)
    auto = AutoAccumulation(max_memory=final["capacity"], headroom=0.0)
    model = Net()
    loader = DataLoader(dataset(64), batch_size=16)
    trainer = quiet_trainer([auto, OOMBackoff(grow_after=2)], max_steps=8, default_root_dir=tmp_path)
    trainer.fit(model, loader, ckpt_path=DATA / "two_callbacks_v0_step4.ckpt")
    sizes = auto.engine.sizes
    assert auto.probes == []  # the saved size was taken, not probed again
    assert sizes.oom_retries == 1  # the old run's back-off is remembered
    assert final["sizes"][4:] == [9] * 4  # the old run's steps 5-8: micro-batches of at most 9 samples
    # so 16 samples as two of 8 each step; the first split step is checked once: boundaries moved by 4
    assert model.seen_sizes == [8, 8] + [4, 8, 4] + [8, 8] * 3
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, final["params"][name], rtol=1e-10, atol=1e-12, msg=name)
