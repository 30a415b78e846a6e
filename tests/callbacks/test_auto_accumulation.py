import re
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memopt import AutoAccumulation, MicroBatchOOMError, OOMBackoff
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.testing import MemoryCap
from tests.batching.helpers import DeviceReads, Net, assert_params_close, dataset, fit, quiet_trainer


class GradRecorder(pl.Callback):
    def __init__(self):
        self.grads = []
        self.calls = 0

    def on_after_backward(self, trainer, pl_module):
        self.calls += 1
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


def test_fixed_micro_batches_equal_unsplit_sgd(tmp_path):
    base, split = Net(), Net()
    base_rec, split_rec = GradRecorder(), GradRecorder()
    base_trainer = fit(base, [base_rec], tmp_path=tmp_path)
    trainer = fit(
        split, [AutoAccumulation(micro_batch_size=3, exactness="off"), split_rec], tmp_path=tmp_path
    )  # 10 -> [2, 2, 3, 3]; exactness="off": the one-time check would run the batch once more
    assert_params_close(split, base, rel=1e-6)
    # on_before_backward/on_after_backward fire once per optimizer batch, with the full gradient
    assert split.events == base.events == ["before_backward", "after_backward"] * 4
    assert split_rec.calls == 4
    for g_split, g_base in zip(split_rec.grads, base_rec.grads):
        for a, b in zip(g_split, g_base):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the step loss (returned and logged) is the full batch's, not the last micro-batch's
    assert split.seen_sizes == [2, 2, 3, 3] * 4 and base.seen_sizes == [10] * 4
    assert split.step_losses == pytest.approx(base.step_losses, rel=1e-6)
    assert split.logged_losses == pytest.approx(base.logged_losses, rel=1e-6)
    assert split.logged_losses == pytest.approx(base.step_losses, rel=1e-6)
    # epoch aggregates are unchanged
    assert float(trainer.callback_metrics["train_loss_epoch"]) == pytest.approx(
        float(base_trainer.callback_metrics["train_loss_epoch"]), rel=1e-6
    )
    # the engine is removed at teardown
    assert "training_step" not in vars(trainer.strategy) and "optimizer_zero_grad" not in vars(split)


def peak_bytes(model: torch.nn.Module, batch, size: int) -> int:
    """Peak live bytes of one forward+backward of ``size`` samples as a micro-batch after the first of an
    accumulated step runs it (the gradients held from its start), measured outside Lightning."""
    x, y = batch
    with MemoryTracker(model) as tracker:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch.nn.functional.mse_loss(model(x[:size]), y[:size]).backward()
    for p in model.parameters():
        p.grad = None
    return tracker.peak


def test_probing_finds_the_largest_size_that_fits_and_changes_nothing(tmp_path):
    batch = tuple(t.clone() for t in dataset(64)[:32])  # a collated batch owns its storage
    sizes = range(2, 33)  # BatchNorm cannot train on one sample
    peaks = {s: peak_bytes(Net(batchnorm=True, dropout=0.2), batch, s) for s in sizes}
    capacity = (peaks[13] + peaks[14]) // 2  # 13 samples fit, 14 do not
    callback = AutoAccumulation(max_memory=capacity, headroom=0.0)
    model = Net(batchnorm=True, dropout=0.2)
    fit(model, [callback], steps=2, batch=32, tmp_path=tmp_path)
    # 13 fit, but 32 samples run as 3 micro-batches at 11 to 15 alike: the search stops at 11 (and 16,
    # which would run 2, does not fit)
    assert max(s for s, p in callback.probes if p is not None and p <= capacity) == 11
    assert all(s in (2, 3, 4, 5, 6, 7, 8, 11, 16, 32) for s, _ in callback.probes)  # ceil(32 / n) alone
    assert 3 <= len(callback.probes) <= 6
    assert model.seen_sizes[-4:] == [10, 11, 11, 8]  # 32 samples as 3 micro-batches of at most 11; then 8
    # evaluation probes start from the whole batch: no activations kept, so it fits whole here
    assert callback.eval_probes[0][0] == 32
    # probing left weights, BatchNorm statistics and RNG as they were: same as a fixed size from the start
    reference = Net(batchnorm=True, dropout=0.2)
    fit(reference, [AutoAccumulation(micro_batch_size=13)], steps=2, batch=32, tmp_path=tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


class BroadNet(Net):
    """One wide hidden layer: its gradients (147 KiB) weigh as much as three samples' activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1))


def test_the_size_fits_the_micro_batches_that_hold_the_gradients(tmp_path):
    # A step's first micro-batch creates the gradients as its backward goes; every later one holds them
    # from its start. Sized on the first, a split step ran out of memory on its second micro-batch (an
    # H100 and a 1B Llama: benchmarks/gpu.py's sizing table); probes of part of a batch now hold them.
    batch = tuple(t.clone() for t in dataset(64)[:32])

    def first_peak(size: int) -> int:  # what every probe measured before
        model = BroadNet()
        x, y = batch
        with MemoryTracker(model) as tracker:
            torch.nn.functional.mse_loss(model(x[:size]), y[:size]).backward()
        return tracker.peak

    later = {s: peak_bytes(BroadNet(), batch, s) for s in range(1, 33)}
    capacity = (later[10] + later[11]) // 2  # 10 samples fit in a later micro-batch, 11 do not
    # sized on the first micro-batch, 13 would fit: 32 samples as 11, 11, 10, the second over capacity
    assert first_peak(32) > capacity and max(s for s in later if first_peak(s) <= capacity) == 13
    # exactness="off": the check's host copies of the gradients would count against this CPU's cap
    callback = AutoAccumulation(max_memory=capacity, headroom=0.0, exactness="off")
    model = BroadNet()
    with MemoryCap(capacity, modules=model) as cap:
        fit(model, [callback], steps=2, batch=32, tmp_path=tmp_path)
    # every out-of-memory error the cap raised was a probe's (the evaluation's search starts whole): no
    # micro-batch of a step ran out of memory
    failed = [s for s, p in [*callback.probes, *callback.eval_probes] if p is None]
    assert cap.raised == len(failed) == 1 and callback.eval_probes[0] == (32, None)
    # 10 fit: 32 samples run as 4 micro-batches of 8 (at 8 to 10 alike), the size the search stops at
    assert max(s for s, p in callback.probes if p is not None and p <= capacity) == 8
    assert model.seen_sizes[-4:] == [8, 8, 8, 8]


class _SlowBroadNet(BroadNet):
    """BroadNet whose training step takes at least 20 ms a sample."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02 * len(batch[0]))
        return super().training_step(batch, batch_idx)


def _probes_seen(monkeypatch) -> list[tuple[int, bool, int | None, object]]:
    """Every probe of the size search: samples, evaluation, peak and ``BatchProbes.seconds`` after it."""
    from lightning_memopt.batching.probe import BatchProbes

    seen, peak = [], BatchProbes.peak

    def timed(self, samples, evaluation=False):
        self.seconds = "stale"
        result = peak(self, samples, evaluation)
        seen.append((samples, evaluation, result, self.seconds))
        return result

    monkeypatch.setattr(BatchProbes, "peak", timed)
    return seen


def test_probes_under_a_tracker_are_not_timed(tmp_path, monkeypatch):
    """On a CPU the probes run under a MemoryTracker, whose cost on every op would read as a micro-step's
    fixed cost: ``BatchProbes.seconds`` is None after each (the search then tries every way that counts;
    on CUDA they are timed: ``test_each_probe_is_timed_on_the_device_clock``)."""
    seen = _probes_seen(monkeypatch)
    batch = tuple(t.clone() for t in dataset(64)[:32])
    capacity = (peak_bytes(BroadNet(), batch, 10) + peak_bytes(BroadNet(), batch, 11)) // 2
    model, callback = _SlowBroadNet(), AutoAccumulation(max_memory=capacity, headroom=0.0, exactness="off")
    with MemoryCap(capacity, modules=model):
        fit(model, [callback], steps=1, batch=32, tmp_path=tmp_path)
    assert len(seen) >= 3 and all(seconds is None for *_, seconds in seen)


@pytest.mark.cuda
def test_each_probe_is_timed_on_the_device_clock(tmp_path, monkeypatch):
    """On CUDA the size search's probes time their micro-step and its backward with CUDA events
    (``BatchProbes.seconds``, what the search's decision on the later ways reads): at least the step's own
    sleep, which the device spends idle between the two events."""
    seen = _probes_seen(monkeypatch)
    model, callback = _SlowBroadNet(), AutoAccumulation(max_memory="1GiB", headroom=0.0, exactness="off")
    fit(model, [callback], steps=1, batch=32, tmp_path=tmp_path, accelerator="gpu")
    training = [(n, s) for n, evaluation, p, s in seen if not evaluation and p is not None]
    assert training and all(0.02 * n <= s < 0.02 * n + 5.0 for n, s in training)


def test_the_size_holds_the_optimizer_state_the_first_step_creates(tmp_path):
    # AdamW creates two tensors per parameter at its first step: sized without them, the first step ran
    # larger micro-batches than every later one (and the size search compared sizes that never ran again).
    from lightning_memopt.memory.tracker import optimizer_state_to_come

    batch = tuple(t.clone() for t in dataset(64)[:32])
    params = list(BroadNet().parameters())
    state = optimizer_state_to_come([torch.optim.AdamW(params)])
    assert state == sum(2 * p.numel() * 4 + 4 for p in params)  # exp_avg, exp_avg_sq, a float32 step
    later = {s: peak_bytes(BroadNet(), batch, s) + state for s in range(1, 33)}
    capacity = (later[10] + later[11]) // 2  # with the state held, 10 samples fit and 11 do not
    callback = AutoAccumulation(max_memory=capacity, headroom=0.0, exactness="off")
    model = BroadNet()
    model.optimizer = "adamw"
    with MemoryCap(capacity, modules=model):
        fit(model, [callback], steps=3, batch=32, tmp_path=tmp_path)
    ran = model.seen_sizes[len(callback.probes) :]  # after the first step's probes
    assert len(ran) >= 8 and set(ran) == {8}  # every step, the first included, as micro-batches of 8


def test_resume_does_not_probe_again(tmp_path):
    batch = tuple(t.clone() for t in dataset(64)[:32])  # a collated batch owns its storage
    capacity = peak_bytes(Net(), batch, 9)
    first = AutoAccumulation(max_memory=capacity, headroom=0.0)
    fit(
        Net(),
        [first, ModelCheckpoint(dirpath=tmp_path)],
        steps=2,
        batch=32,
        tmp_path=tmp_path,
        enable_checkpointing=True,
    )
    # 9 fit; 32 samples run as 4 x 8 at 8 or 9 alike: the search stops at 8
    assert max(s for s, p in first.probes if p is not None and p <= capacity) == 8
    ckpt = next(tmp_path.glob("*.ckpt"))
    assert torch.load(ckpt, weights_only=False)["callbacks"]["AutoAccumulation"]["micro_batch_size"] == 8
    resumed = AutoAccumulation(max_memory=capacity, headroom=0.0)
    model = Net()
    fit(model, [resumed], steps=4, batch=32, tmp_path=tmp_path, ckpt_path=ckpt)
    assert resumed.probes == [] and resumed.engine.sizes.shape_probes == []
    # batches of 32 run as 4 x 8, of 8 as one: no other size, no probe
    assert set(model.seen_sizes) == {8} and len(model.seen_sizes) >= 5


def test_cpu_without_max_memory_runs_whole_batches(tmp_path):
    callback = AutoAccumulation()
    model = Net()
    with pytest.warns(UserWarning, match="pass max_memory="):
        fit(model, [callback], steps=1, tmp_path=tmp_path)
    assert callback.micro_batch_size is None and model.seen_sizes == [10]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive int"),
        ({"eval_micro_batch_size": 2.5}, "eval_micro_batch_size must be a positive int"),
        ({"headroom": 1.0}, r"headroom must be a number in \[0, 1\)"),
        ({"headroom": "0.1"}, r"headroom must be a number in \[0, 1\) .*got '0.1'"),
        ({"headroom": None}, r"headroom must be a number in \[0, 1\) .*got None"),
        ({"max_probes": 2}, "max_probes must be an int >= 3"),
        ({"max_memory": "lots"}, "max_memory must be a byte size"),
        ({"max_memory": 1.5}, r"max_memory as a float is a fraction .* must be in \(0, 1\], got 1.5"),
        (
            {"micro_batch_size": 2, "max_memory": "1GiB"},
            r"micro_batch_size=2 fixes the size, so max_memory='1GiB' would be ignored",
        ),
    ],
)
def test_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoAccumulation(**kwargs)


@pytest.mark.parametrize("name", ["count_fn", "split_fn"])
def test_functions_must_be_callable(name):
    with pytest.raises(TypeError, match=rf"{name} must be a callable, {name}\(.*got 'abc'"):
        AutoAccumulation(**{name: "abc"})
    with pytest.raises(TypeError, match=rf"{name} must be a callable.*got 5"):
        OOMBackoff(**{name: 5})


def test_max_memory_forms(tmp_path):
    # bytes, a string, or a fraction of the device's capacity; on CPU the capacity is unknown: early error
    assert AutoAccumulation(max_memory=4096).max_memory == 4096
    assert AutoAccumulation(max_memory=0.5).max_memory == 0.5
    with pytest.raises(
        ValueError, match=r"max_memory=0.5 is a fraction of the device's capacity.*unknown \(CPU\)"
    ):
        fit(Net(), [AutoAccumulation(max_memory=0.5)], steps=1, tmp_path=tmp_path)


def test_max_memory_resolves_through_the_budget_rule(monkeypatch):
    import types

    from lightning_memopt.callbacks import auto_accumulation

    class Memory:
        def capacity(self):
            return 8000

    monkeypatch.setattr(auto_accumulation, "device_memory", lambda device: Memory())
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    limits = [AutoAccumulation(max_memory=m)._limit(trainer) for m in (0.25, None, "1KiB", 3000)]
    assert limits == [2000, 8000, 1024, 3000]  # the headroom is applied by the search: usable_bytes once more


def test_the_checklist_leaves_out_what_the_fit_already_does(tmp_path):
    # Under bf16-mixed, without BatchNorm, the advice starts at AutoCheckpoint: half precision and swapping
    # BatchNorm are in place; in 32-true with BatchNorm it names both.
    with pytest.raises(MicroBatchOOMError) as raised:
        fit(Net(), [AutoAccumulation(max_memory=1000)], steps=1, tmp_path=tmp_path, precision="bf16-mixed")
    advice = str(raised.value).split("What to do, cheapest first:\n")[1]
    assert advice.startswith("  1. lightning_memopt.AutoCheckpoint()") and "precision=" not in advice
    assert "  2. Shard parameters" in advice
    assert "BatchNormToGroupNorm" not in advice
    with pytest.raises(MicroBatchOOMError) as raised:
        fit(Net(batchnorm=True), [AutoAccumulation(max_memory=1000)], steps=1, tmp_path=tmp_path)
    advice = str(raised.value).split("What to do, cheapest first:\n")[1]
    assert (
        advice.startswith('  1. precision="bf16-mixed"')
        and "  3. lightning_memopt.BatchNormToGroupNorm" in advice
    )


def test_nothing_fits_raises_micro_batch_oom_error(tmp_path):
    model = Net(batchnorm=True)
    with pytest.raises(
        MicroBatchOOMError,
        match=r"(?s)AutoAccumulation\(max_memory=1000, headroom=0.1\) found no training micro-batch size.*"
        r"even min_size=2 does not fit.*The least it measured, 2 samples a micro-batch, peaked at .*: "
        r"max_memory=\d+ \(.*\) or more fits it.*BatchNormToGroupNorm.*What to do",
    ) as raised:
        fit(model, [AutoAccumulation(max_memory=1000)], steps=1, tmp_path=tmp_path)
    # The limit it names fits micro-batches of 2; a byte less does not
    least = int(re.search(r"max_memory=(\d+) \(", str(raised.value)).group(1))
    accumulation = AutoAccumulation(max_memory=least)
    fit(Net(batchnorm=True), [accumulation], steps=1, tmp_path=tmp_path)
    assert accumulation.micro_batch_size == 2
    with pytest.raises(MicroBatchOOMError):
        fit(Net(batchnorm=True), [AutoAccumulation(max_memory=least - 1)], steps=1, tmp_path=tmp_path)


def test_non_scalar_loss_is_refused(tmp_path):
    class PerSample(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self(x) - y) ** 2).squeeze(1)  # (B,): not reduced

    with pytest.raises(
        MisconfigurationException, match=r"must return a scalar loss, got .* shape \(5,\); .*loss.mean\(\)"
    ):
        fit(PerSample(), [AutoAccumulation(micro_batch_size=5)], steps=1, tmp_path=tmp_path)


def test_one_count_fn_for_both_callbacks(tmp_path):
    count = lambda mb: len(mb[0])  # noqa: E731
    # the same function on both, or on one: fine; two different ones: which would win? an error
    fit(Net(), [AutoAccumulation(micro_batch_size=5, count_fn=count), OOMBackoff(count_fn=count)], steps=1)
    trainer = fit(Net(), [AutoAccumulation(micro_batch_size=5), OOMBackoff(count_fn=count)], steps=1)
    assert trainer.callbacks[0].engine.weights.count_fn is count
    with pytest.raises(
        MisconfigurationException,
        match=r"AutoAccumulation\(count_fn=.*\), OOMBackoff\(count_fn=.*\): .* share one engine and one count_fn",
    ):
        fit(Net(), [AutoAccumulation(count_fn=count), OOMBackoff(count_fn=lambda mb: 1)], steps=1)


def test_token_weighted_loss(tmp_path):
    """With count_fn, micro-batch losses are weighted by their share of counted elements (tokens)."""

    class TokenNet(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen_sizes.append(len(x))
            mask = (x[:, 0] > 0).float()  # a "token" is a sample with a positive first feature
            per_sample = ((self(x) - y) ** 2).squeeze(1)
            loss = (per_sample * mask).sum() / mask.sum().clamp_min(1)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

    base, split = TokenNet(), TokenNet()
    fit(base, tmp_path=tmp_path)
    fit(
        split,
        [AutoAccumulation(micro_batch_size=3, count_fn=lambda b: float((b[0][:, 0] > 0).sum()))],
        tmp_path=tmp_path,
    )
    assert_params_close(split, base, rel=1e-6)


class Pair:
    """A batch type the built-in splitter does not know."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)


def _pair_collate(samples):
    x, y = zip(*samples)
    return Pair(torch.stack(x), torch.stack(y))


class PairNet(Net):
    def training_step(self, batch, batch_idx):
        self.seen_sizes.append(len(batch))
        loss = torch.nn.functional.mse_loss(self(batch.x), batch.y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=len(batch))
        return loss


def _fit_pairs(model, callbacks, tmp_path):
    from torch.utils.data import DataLoader

    trainer = quiet_trainer(callbacks, max_steps=2, default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(dataset(), batch_size=10, collate_fn=_pair_collate))


def test_unknown_batch_type_names_the_hook(tmp_path):
    with pytest.raises(
        TypeError, match=r"define `split_batch\(self, batch, sizes\)` on your LightningModule"
    ):
        _fit_pairs(PairNet(), [AutoAccumulation(micro_batch_size=4)], tmp_path)


def test_split_batch_hook_on_the_module(tmp_path):
    class Hooked(PairNet):
        def split_batch(self, batch, sizes):
            xs, ys = torch.split(batch.x, sizes), torch.split(batch.y, sizes)
            return [Pair(x, y) for x, y in zip(xs, ys)]

    base, split = Hooked(), Hooked()
    _fit_pairs(base, [], tmp_path)
    # exactness="off": the one-time check would run the batch once more, as 6 micro-batches
    _fit_pairs(split, [AutoAccumulation(micro_batch_size=4, exactness="off")], tmp_path)
    assert split.seen_sizes == [3, 3, 4] * 2
    assert_params_close(split, base, rel=1e-6)


def test_evaluation_micro_batches_join_predictions_and_average_logged_values(tmp_path):
    from torch.utils.data import DataLoader

    class Predicts(Net):
        def predict_step(self, batch, batch_idx):
            x, _ = batch
            self.seen_sizes.append(len(x))
            return {"prediction": self(x), "count": torch.tensor(len(x))}

    def run(callbacks):
        model = Predicts()
        trainer = pl.Trainer(
            accelerator="cpu",
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        loader = DataLoader(dataset(), batch_size=10)
        predictions = trainer.predict(model, loader)
        validated = trainer.validate(model, loader, verbose=False)
        sizes.append(model.seen_sizes)
        return predictions, validated

    sizes = []

    (whole, whole_val), (split, split_val) = run([]), run([AutoAccumulation(eval_micro_batch_size=3)])
    assert sizes == [[10] * 4, [2, 2, 3, 3] * 4]
    assert len(split) == len(whole) == 4
    for a, b in zip(split, whole):
        assert a["prediction"].shape == (10, 1)
        torch.testing.assert_close(a["prediction"], b["prediction"])
    assert split_val[0]["val_loss"] == pytest.approx(whole_val[0]["val_loss"], rel=1e-6)


def test_training_step_extra_keys_are_the_full_batch_values(tmp_path):
    class Extras(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch
            error = (self(x) - y).detach().abs().squeeze(1)
            loss = super().training_step(batch, batch_idx)
            return {"loss": loss, "error": error, "mean_error": error.mean()}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.outputs.append({k: v.clone() for k, v in outputs.items()})

    whole, split = Extras(), Extras()
    whole.outputs, split.outputs = [], []
    fit(whole, tmp_path=tmp_path, steps=1)
    fit(split, [AutoAccumulation(micro_batch_size=3)], tmp_path=tmp_path, steps=1)  # 10 -> [2, 2, 3, 3]
    (a,), (b,) = split.outputs, whole.outputs
    assert set(a) == {"loss", "error", "mean_error"}
    torch.testing.assert_close(a["error"], b["error"])  # per-sample: joined, all 10 samples
    torch.testing.assert_close(a["mean_error"], b["mean_error"], rtol=1e-6, atol=0)  # weighted by share


class TokenLM(pl.LightningModule):
    """Next-token prediction whose labels ignore some positions: the loss's count is learned (tokens)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == 0, -100)
        logits = self.head(self.embed(tokens[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_steady_micro_batched_step_reads_the_device_once(tmp_path, monkeypatch):
    """On a GPU every read of a tensor's value waits for the device's queued work, and it idles until the next
    launch: once the weights are learned and the split checked, a step of four micro-batches reads the
    device once, the counts of its micro-batches together, before its first forward; its loss is not read."""
    reads = DeviceReads(monkeypatch)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (40, 9), generator=g)  # zeros are padding: a varying count per sample
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
    trainer = quiet_trainer(
        [AutoAccumulation(micro_batch_size=2), reads], max_steps=5, default_root_dir=tmp_path
    )
    trainer.fit(TokenLM(), loader)
    # the first steps learn the count and check the split
    assert reads.since(3) == ["tolist in lightning_memopt/_tree.py"] * 3
