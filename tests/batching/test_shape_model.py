"""Per-batch sizing from a memory model over shapes: fitted to probes, one probe per length it does not know."""

import json
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching.engine import MicroBatchEngine
from lightning_memopt.batching.shape_model import ShapeModel
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.testing import MemoryCap
from tests.batching.helpers import assert_params_close, quiet_trainer
from tests.batching.test_per_batch_sizing import lm_batch
from tests.distributed import run_ranks

LENGTHS_BY_RANK = {0: [48, 12, 96, 24, 160, 56], 1: [64, 96, 12, 200, 48, 160]}  # as shapes_worker
VOCAB = 512


# ------------------------------------------------------------------------------------------ the model
def test_two_widths_fit_linear_plus_quadratic_exactly():
    model = ShapeModel(usable=100_000, limit=110_000, workspace=1_000)
    cost = lambda t: 24 * t + 0.25 * t * t  # noqa: E731  bytes per sample of t tokens
    model.measured(width=64, samples=3, increment=1_000 + 3 * cost(64))
    assert model.samples_for(64) == int(99_000 // cost(64))
    model.measured(width=256, samples=1, increment=1_000 + cost(256))
    assert (model.linear, model.quadratic) == (pytest.approx(24, rel=1e-12), pytest.approx(0.25, rel=1e-12))
    for t in (16, 64, 256, 300, 1000):  # measured, or beyond them: the fitted shape, exact here
        assert model.per_sample(t) == pytest.approx(cost(t), rel=1e-12)
        assert model.samples_for(t) == max(1, int(99_000 // cost(t)))
    chord = cost(64) + (cost(256) - cost(64)) * (100 - 64) / (256 - 64)  # between them: above the curve
    assert model.per_sample(100) == pytest.approx(chord, rel=1e-12) and chord > cost(100)
    model.held = 9_000  # the optimizer created its state: less room
    assert model.samples_for(300) == int(90_000 // cost(300))


def test_between_measured_widths_the_chord_beyond_them_the_fitted_shape():
    model = ShapeModel(usable=10**6, limit=10**6, workspace=0)
    for t, cost in ((16, 100.0), (32, 160.0), (64, 400.0)):  # not on one a*t + b*t^2 curve
        model.add(t, cost)
    for t, cost in ((16, 100.0), (32, 160.0), (64, 400.0)):
        assert model.per_sample(t) == cost  # measured widths are exact
    assert model.per_sample(48) == pytest.approx(280.0)  # halfway along the chord from 32 to 64
    fitted = lambda t: model.linear * t + model.quadratic * t * t  # noqa: E731
    assert model.per_sample(100) == pytest.approx(400.0 * fitted(100) / fitted(64))
    assert model.per_sample(10) == pytest.approx(100.0 * fitted(10) / fitted(16))
    # known: within sqrt(2) of a measured width, or between two at most 2x apart
    assert [model.knows(t) for t in (12, 11, 40, 90, 91)] == [True, False, True, True, False]


def test_a_curve_that_bends_down_is_fitted_by_a_line():
    model = ShapeModel(usable=10**6, limit=10**6, workspace=0)
    model.add(10, 100.0)
    model.add(100, 500.0)  # less than linear: the quadratic coefficient would be negative
    assert model.quadratic == 0 and model.linear > 0


def test_a_miss_lowers_the_prediction_at_that_length():
    model = ShapeModel(usable=9_000, limit=10_000, workspace=0)
    model.add(32, 100.0)
    model.add(128, 400.0)
    assert model.samples_for(128) == 22
    model.missed(width=128, samples=22)  # 22 x 128 tokens went over the 10,000-byte limit
    assert model.per_sample(128) == pytest.approx(10_000 / 22)
    assert model.samples_for(128) == 19  # 9,000 / (10,000 / 22)
    assert model.samples_for(32) == 90  # the other measured width: unchanged
    model.missed(width=128, samples=30)  # more than failed before: nothing new, kept
    assert model.samples_for(128) == 19
    restored = ShapeModel.from_state(model.state())
    assert [restored.samples_for(t) for t in (32, 100, 128, 500)] == [
        model.samples_for(t) for t in (32, 100, 128, 500)
    ]


def test_from_probes_predicts_the_size_the_search_found():
    probes = [(1, 1_300), (2, 1_600), (7, 3_100), (8, None)]  # 300 bytes a sample, 1,000 fixed
    model = ShapeModel.from_probes(probes, width=50, size=7, whole=False, usable=3_350, limit=3_500, held=600)
    assert model.workspace == pytest.approx(400)  # the intercept 1,000 less the 600 held
    assert model.samples_for(50) == 7  # 8 would fit the line (3,400 > 3,350? no: 3,400): the search said no
    whole = ShapeModel.from_probes(
        probes[:3], width=50, size=7, whole=True, usable=3_350, limit=3_500, held=600
    )
    assert whole.samples_for(50) == 7  # (3,350 - 1,000) // 300
    assert whole.samples_for(25) == 15  # one width known: linear in tokens, 150 bytes a sample


# --------------------------------------------------------------------------------- in a training run
class AttentionLM(pl.LightningModule):
    """One attention layer in float64 (its T x T scores make memory quadratic in the length)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16, dtype=torch.float64)
        self.qkv = torch.nn.Linear(16, 48, dtype=torch.float64)
        self.head = torch.nn.Linear(16, VOCAB, dtype=torch.float64)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(batch["input_ids"])).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2) / 4).softmax(-1)  # (B, T, T)
        logits = self.head(scores @ v)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())  # mean over labels != -100

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def whole_peak(length: int) -> int:
    """Peak bytes of a whole-batch step (forward, backward, AdamW) of 8 samples, outside Lightning."""
    model = AttentionLM()
    optimizer = model.configure_optimizers()
    model.training_step(lm_batch(8, 0), 0).backward()
    optimizer.step()  # the optimizer's state exists, as in every step after the first
    optimizer.zero_grad()
    with MemoryTracker(model, optimizer) as tracker:
        model.training_step(lm_batch(length, 0), 0).backward()
        optimizer.step()
    return tracker.peak


class Record(pl.Callback):
    def __init__(self, sized) -> None:
        self.sized, self.counts, self.sizes = sized, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = self.sized.engine if self.sized else None
        self.counts.append(engine.num_micro_batches if engine else 1)
        self.sizes.append(engine.sizes.micro_batch_size if engine else None)


def run(lengths, callbacks=(), *, capacity=2**40, steps=None, ckpt_path=None, **kwargs):
    model = AttentionLM()
    loader = DataLoader([lm_batch(t, i) for i, t in enumerate(lengths)], batch_size=None)
    record = Record(callbacks[0] if callbacks else None)
    trainer = quiet_trainer([*callbacks, record], max_steps=steps or len(lengths), **kwargs)
    with MemoryCap(capacity, modules=model) as cap:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    run.sizes = record.sizes
    return model, record.counts, cap


def micro_step_peak(samples: int, length: int) -> int:
    """Peak bytes of one forward and backward of ``samples`` samples, the optimizer's state and the
    gradients alive."""
    model = AttentionLM()
    optimizer = model.configure_optimizers()
    model.training_step(lm_batch(8, 0), 0).backward()
    optimizer.step()
    part = {k: v[:samples] for k, v in lm_batch(length, 1).items()}
    with MemoryTracker(model, optimizer) as tracker:
        optimizer.zero_grad(set_to_none=False)  # held from the start, as in a split step's later micro-batch
        model.training_step(part, 0).backward()
    return tracker.peak


LENGTHS = [48, 12, 96, 24, 160, 40, 96, 200, 12, 64, 160, 48]


def test_each_batch_runs_as_few_micro_batches_as_its_length_allows_exactly():
    capacity = whole_peak(64)  # a whole batch of 64 tokens fits; longer ones need splitting
    base, _, _ = run(LENGTHS)
    auto = AutoAccumulation(max_memory=capacity, headroom=0.05)
    model, counts, cap = run(LENGTHS, [auto, OOMBackoff()], capacity=capacity)
    engine = auto.engine
    assert engine.sizes.oom_retries == 0  # no step ran out of memory
    # the first batch's search, then one probe per new power-of-two length: 12 (8-15), 96 (64-127), 24,
    # 160 (128-255); 200, 64, ... fall in buckets measured before
    assert [w for w, _, _ in engine.sizes.shape_probes] == [12, 96, 24, 160]
    assert counts[LENGTHS.index(12)] == 1 and counts[LENGTHS.index(200)] > counts[LENGTHS.index(96)] > 1
    # each step runs the fewest micro-batches of at most the size the model predicted for its length
    assert counts == [math.ceil(8 / min(8, size)) for size in run.sizes]
    # and the model is right: bytes per sample at every length within 3% of a measurement outside Lightning
    shapes = engine.sizes.model
    for t in sorted(set(LENGTHS)):
        measured = (micro_step_peak(4, t) - micro_step_peak(2, t)) / 2
        assert shapes.per_sample(t) == pytest.approx(measured, rel=0.03), t
    assert_params_close(model, base, rel=1e-10)


def test_a_resumed_run_sizes_as_the_uninterrupted_one_without_probing(tmp_path):
    capacity = whole_peak(64)
    lengths = LENGTHS[:6] * 2  # the checkpoint after the first 6 steps; the second epoch repeats them

    def fit(ckpt_path=None):
        auto = AutoAccumulation(max_memory=capacity, headroom=0.05)
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
        model, counts, _ = run(
            LENGTHS[:6],
            [auto, OOMBackoff(), saver],
            capacity=capacity,
            steps=len(lengths),
            ckpt_path=ckpt_path,
            enable_checkpointing=True,
        )
        return model, counts, auto

    full, full_counts, _ = fit()
    resumed, counts, auto = fit(str(tmp_path / "epoch=0-step=6.ckpt"))
    assert counts == full_counts[6:]
    assert (
        auto.probes == [] and auto.engine.sizes.shape_probes == []
    )  # the model came back with the checkpoint
    assert_params_close(resumed, full, rel=0.0)


def test_thrashing_lowers_the_prediction_for_that_length_only(monkeypatch):
    """The CUDA allocator (faked: the engine's counter) retries during two steps of 96 tokens: the next
    96-token batch runs smaller, without a retry; 48-token batches keep their size."""
    capacity = whole_peak(64)
    lengths = [48, 96, 96, 96, 96, 48]
    retries = {"count": 0, "armed": False}

    def counter(engine):  # read before and after each step; the armed step retries 3 times in between
        value = retries["count"]
        if retries["armed"]:
            retries["count"], retries["armed"] = value + 3, False
        return value

    monkeypatch.setattr(MicroBatchEngine, "_allocator_retries", counter)

    class Thrashing(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            retries["armed"] = batch_idx in (2, 3)

    auto = AutoAccumulation(max_memory=capacity, headroom=0.05)
    base, _, _ = run(lengths)
    model, counts, _ = run(lengths, [auto, OOMBackoff(), Thrashing()], capacity=capacity)
    sizes = run.sizes
    engine = auto.engine
    assert (engine.sizes.near_misses, engine.sizes.oom_retries) == (1, 0)
    assert sizes[1] == sizes[2] == sizes[3] > sizes[4]  # lowered after steps 2 and 3 thrashed
    assert sizes[5] == sizes[0]  # another length: as before
    assert counts[4] > counts[3]
    assert_params_close(model, base, rel=1e-10)


@pytest.mark.timeout(300)
def test_two_ranks_with_different_lengths_run_the_same_number_of_micro_batches(tmp_path):
    """DDP and FSDP2, 2 gloo processes, each rank its own lengths (tests/batching/shapes_worker.py): every
    step, both ranks run as many micro-batches as the rank that needs most, each its own size; training
    equals the plain run's; a step without a new length costs one small collective more than OOMBackoff's
    own (DDP: its agreement)."""
    runs = (
        "ddp:plain",
        "ddp:sized",
        "fsdp2:plain",
        "fsdp2:sized",
        "fsdp2:plain-uneven",
        "fsdp2:sized-uneven",
    )
    run_ranks("tests.batching.shapes_worker:main", tmp_path, *runs, timeout=280)
    result = {
        spec: [json.loads((tmp_path / f"{spec.replace(':', '-')}-rank{r}.json").read_text()) for r in (0, 1)]
        for spec in runs
    }
    for strategy in ("ddp", "fsdp2"):
        ranks = result[f"{strategy}:sized"]
        assert ranks[0]["counts"] == ranks[1]["counts"]
        assert len(set(ranks[0]["counts"])) > 1  # the count follows the lengths
        assert any(a != b for a, b in zip(ranks[0]["sizes"], ranks[1]["sizes"]))  # each rank its own size
        assert ranks[0]["collectives"] == ranks[1]["collectives"]
        # every rank probes when a length is new to any rank's model: each its own batch, as many times
        assert len(ranks[0]["shape_probes"]) == len(ranks[1]["shape_probes"]) < 6
        for rank in ranks:
            assert rank["oom_retries"] == 0
            # each probe measured this rank's length at that step
            widths = [w for w, _, _ in rank["shape_probes"]]
            assert set(widths) <= set(LENGTHS_BY_RANK[ranks.index(rank)])
        for rank, plain in zip(ranks, result[f"{strategy}:plain"]):
            for name, value in plain["params"].items():
                expected = torch.tensor(value, dtype=torch.float64)
                got = torch.tensor(rank["params"][name], dtype=torch.float64)
                assert (got - expected).norm() <= 1e-10 * expected.norm(), name
    # FSDP2, rank 0 with 2 samples a batch: where rank 1 needs more micro-batches, rank 0 runs its last one
    # again, weighted 0, so that both run as many (FSDP2 communicates in each); training is unchanged
    ranks = result["fsdp2:sized-uneven"]
    assert ranks[0]["counts"] == ranks[1]["counts"] and max(ranks[0]["counts"]) > 2
    for rank, plain in zip(ranks, result["fsdp2:plain-uneven"]):
        for name, value in plain["params"].items():
            expected = torch.tensor(value, dtype=torch.float64)
            got = torch.tensor(rank["params"][name], dtype=torch.float64)
            assert (got - expected).norm() <= 1e-10 * expected.norm(), name
    # DDP, the last step (no new length on either rank): the count's agreement and OOMBackoff's own one
    assert [r["collectives"][-1] for r in result["ddp:sized"]] == [2, 2]


def test_length_fn_tells_the_length_and_a_bad_one_is_named():
    from lightning_memopt.batching.engine import MicroBatchEngine
    from lightning_memopt.batching.sizes import MicroBatchSizes

    def length(length_fn=None):
        return MicroBatchEngine(MicroBatchSizes(), length_fn=length_fn).length

    batch = lm_batch(12, 0)
    assert length()(batch) == 12
    assert length(lambda b: int(b["labels"].ne(-100).sum(1).max()))(batch) <= 12
    with pytest.raises(ValueError, match=r"length_fn\(batch\) must return a positive int.*got 0"):
        length(lambda b: 0)(batch)
    with pytest.raises(TypeError, match="length_fn must be a callable"):
        OOMBackoff(length_fn=12)


def test_length_fn_is_the_length_sizing_follows():
    """A length_fn that says every sample is 4 times as long as its tensors: the model sees those lengths."""
    capacity = whole_peak(64)
    lengths = [48, 12, 48]
    plain = AutoAccumulation(max_memory=capacity, headroom=0.05)
    run(lengths, [plain, OOMBackoff()], capacity=capacity)
    longer = AutoAccumulation(
        max_memory=capacity, headroom=0.05, length_fn=lambda b: 4 * b["input_ids"].shape[1]
    )
    run(lengths, [longer, OOMBackoff()], capacity=capacity)
    assert longer.state_dict()["tokens_per_sample"] == 192 and plain.state_dict()["tokens_per_sample"] == 48
    assert [w for w, _, _ in plain.engine.sizes.shape_probes] == [12]
    assert [w for w, _, _ in longer.engine.sizes.shape_probes] == [48]  # the 12-token batch, as 48
