"""OOMBackoff's thrash detection in a Lightning fit: CPU tensors, the engine's device memory a faked CUDA
device whose allocator counter (``num_alloc_retries``) the model raises at chosen steps."""

import pytest
import torch

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching.engine import MicroBatchEngine
from lightning_memopt.callbacks._micro_batching import engine_of
from lightning_memopt.memory.device import device_memory
from lightning_memopt.testing import OOMInjector
from tests.batching.helpers import Net, assert_params_close, fit, patch_regime
from tests.memory.fake_cuda import FakeCuda


@pytest.fixture
def fake(monkeypatch):
    """The engine measures a CUDA device whose allocator statistics come from a :class:`FakeCuda`; the run
    stays on CPU. Only ``torch.cuda.memory_stats`` is replaced: a whole fake ``torch.cuda`` during a fit
    would also answer Lightning's and transformers' own CUDA questions."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "memory_stats", cuda.memory_stats)
    monkeypatch.setattr(
        MicroBatchEngine,
        "_device_memory",
        lambda self, tracker=None: device_memory("cuda:0", capacity="1GiB"),
    )
    return cuda


class Retrying(Net):
    """The allocator retries ``count`` times during each training step in ``steps`` (global step indices)."""

    def __init__(self, cuda, steps, count=1, **kwargs):
        super().__init__(**kwargs)
        self.cuda, self.retry_steps, self.count = cuda, set(steps), count
        self.sizes_per_step: list[list[int]] = []  # samples of each micro-batch that ran, per step
        self.size_after_step: list[int | None] = []  # the engine's micro-batch size after each step

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        if len(self.sizes_per_step) <= step:
            self.sizes_per_step.append([])
            if step in self.retry_steps:  # once per step, whatever its micro-batches
                self.cuda.alloc_retries += self.count
        self.sizes_per_step[step].append(len(batch[0]))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.size_after_step.append(engine_of(self.trainer).sizes.micro_batch_size)


def test_thrashing_halves_the_next_step_without_a_retry_and_stays_exact(tmp_path, fake):
    base = Net()
    fit(base, steps=8, tmp_path=tmp_path, precision="64-true")
    model = Retrying(fake, steps={1, 2})
    callback = OOMBackoff(grow_after=2, exactness="off")  # the check would add calls
    trainer = fit(model, [callback], steps=8, tmp_path=tmp_path, precision="64-true")
    # retries in steps 1 and 2 (2 of the last 5): step 3 runs at half the size; growth after 2 clean steps
    # (3 and 4) stops at 9, below the 10 that thrashed; each step ran once (no retry). Size 9 runs a batch
    # of 10 as 5 + 5 (as even as possible, split.micro_batch_sizes).
    assert model.size_after_step == [None, None, 5, 5, 9, 9, 9, 9]
    assert model.sizes_per_step == [[10], [10], [10]] + [[5, 5]] * 5
    engine = callback.engine
    assert (engine.sizes.near_misses, engine.sizes.oom_retries) == (1, 0)
    assert (engine.sizes.smallest_failed_size, engine.sizes.max_micro_batch_size) == (10, 10)
    keys = sorted(k for k in trainer.callback_metrics if k.startswith("batching/"))
    assert keys == [
        f"batching/{k}" for k in ("micro_batch_size", "near_misses", "num_micro_batches", "oom_retries")
    ]
    assert float(trainer.callback_metrics["batching/near_misses"]) == 1
    assert callback.state_dict()["sizes"]["near_misses"] == 1
    assert model.net[0].weight.dtype == torch.float64
    assert_params_close(model, base, rel=1e-10)


@pytest.mark.parametrize("steps", [{1, 6}, {3}])
def test_isolated_retries_do_not_lower_the_size(tmp_path, fake, steps):
    model = Retrying(fake, steps=steps, count=4)  # many retries in one step are still one re-pack
    callback = OOMBackoff()
    fit(model, [callback], steps=8, tmp_path=tmp_path)
    assert model.sizes_per_step == [[10]] * 8
    assert callback.engine.sizes.near_misses == 0 and fake.alloc_retries == 4 * len(steps)


def test_an_out_of_memory_retry_is_not_thrashing(tmp_path, fake):
    """The OOM's own allocator retries come with a back-off already: they start a new window."""
    model = Retrying(fake, steps={1, 2})
    with OOMInjector(model.net[-1], max_size=5, steps={2}, step_fn=lambda: model.global_step) as injected:
        callback = OOMBackoff(exactness="off")  # the one-time check would add training_step calls
        fit(model, [callback], steps=5, tmp_path=tmp_path)
    assert injected.raised == 1
    assert model.sizes_per_step == [[10], [10], [10, 5, 5], [5, 5], [5, 5]]
    assert (callback.engine.sizes.near_misses, callback.engine.sizes.oom_retries) == (0, 1)


def test_distributed_runs_do_not_watch(tmp_path, fake, monkeypatch):

    patch_regime(monkeypatch, "is_distributed", lambda: True)  # one process posing as a rank
    model = Retrying(fake, steps={0, 1, 2, 3})
    callback = OOMBackoff()
    trainer = fit(model, [callback], steps=4, tmp_path=tmp_path)
    assert model.sizes_per_step == [[10]] * 4 and callback.engine.sizes.near_misses == 0
    assert "batching/near_misses" not in trainer.callback_metrics


def test_thrashing_at_the_floor_warns_once_and_trains_on(tmp_path, fake):
    model = Retrying(fake, steps=range(6))
    callback = OOMBackoff()
    with pytest.warns(UserWarning, match="thrashing.*at 1 samples per micro-batch, the fewest") as warned:
        auto = AutoAccumulation(micro_batch_size=1, exactness="off")  # the check would add calls
        fit(model, [auto, callback], steps=6, batch=4, tmp_path=tmp_path)
    thrashing = [str(w.message) for w in warned if "thrashing" in str(w.message)]
    assert len(thrashing) == 1 and "expandable_segments:True" in thrashing[0]
    assert model.sizes_per_step == [[1] * 4] * 6
    assert (callback.engine.sizes.near_misses, callback.engine.sizes.oom_retries) == (
        3,
        0,
    )  # after steps 1, 3 and 5


def test_cpu_has_no_counter_and_logs_no_key(tmp_path):
    callback = OOMBackoff()
    trainer = fit(Net(), [callback], steps=2, tmp_path=tmp_path)
    assert callback.engine._allocator_retries() is None
    assert "batching/near_misses" not in trainer.callback_metrics
