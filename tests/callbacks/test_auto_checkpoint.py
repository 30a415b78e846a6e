import warnings
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

import lightning_memopt.checkpointing.auto as ac_module
from lightning_memopt import AutoCheckpoint
from lightning_memopt.checkpointing import checkpointed_blocks, evaluate_plan, find_blocks, profile_blocks
from lightning_memopt.testing import MemoryCap
from tests.checkpointing.models import TinyGPT


class GPTModule(pl.LightningModule):
    def __init__(self, n_layer=3, build_in_configure=True, n_samples=8):
        super().__init__()
        self.n_layer = n_layer
        self.n_samples = n_samples
        self.model = None if build_in_configure else TinyGPT(n_layer)
        self.seen_choices = []

    def configure_model(self):
        if self.model is None:
            self.model = TinyGPT(self.n_layer)

    def training_step(self, batch, batch_idx):
        self.seen_choices.append(checkpointed_blocks(self))
        (idx,) = batch
        logits = self.model(idx)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 32, (self.n_samples, 8), generator=g)), batch_size=4)


def _trainer(tmp_path, callbacks, steps=2, **kwargs):
    options = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        **(options | kwargs),
    )


def test_zero_arguments_on_cpu_checkpoints_every_block_built_in_configure_model(tmp_path):
    torch.manual_seed(0)
    module, cb = GPTModule(), AutoCheckpoint()
    trainer = _trainer(tmp_path, [cb])
    trainer.fit(module)
    assert module.seen_choices[0] == {"model.h.0": "full", "model.h.1": "full", "model.h.2": "full"}
    assert cb.plan.choices == module.seen_choices[1] and cb.plan.predicted
    metrics = trainer.callback_metrics
    # Full checkpointing holds exactly each block's input: B * T * h fp32 = 4 * 8 * 16 * 4 bytes.
    assert metrics["checkpoint/activation_bytes_predicted"].item() == 3 * 4 * 8 * 16 * 4
    assert metrics["checkpoint/activation_bytes_measured"].item() == 3 * 4 * 8 * 16 * 4
    assert metrics["checkpoint/recompute_gflops"].item() > 0
    # Teardown takes everything off again.
    assert checkpointed_blocks(module) == {} and "configure_model" not in module.__dict__


def test_gradients_match_plain_training(tmp_path):
    params = []
    for callbacks in ([], [AutoCheckpoint(mode="selective")]):
        torch.manual_seed(0)
        module = GPTModule(build_in_configure=False)
        _trainer(tmp_path, callbacks, steps=3).fit(module)
        params.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    torch.testing.assert_close(params[1], params[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mode": "every_n", "every_n": 2}, {"model.h.0": "full", "model.h.1": "keep", "model.h.2": "full"}),
        ({"mode": "offload"}, {"model.h.0": "offload", "model.h.1": "offload", "model.h.2": "offload"}),
        ({"blocks": ["model.h.1"], "mode": "selective"}, {"model.h.1": "selective"}),
        (
            {"mode": "pointwise"},
            {"model.h.0": "pointwise", "model.h.1": "pointwise", "model.h.2": "pointwise"},
        ),
    ],
)
def test_forced_modes(tmp_path, kwargs, expected):
    module = GPTModule()
    cb = AutoCheckpoint(**kwargs)
    _trainer(tmp_path, [cb], steps=1).fit(module)
    assert module.seen_choices[0] == expected == cb.plan.choices


def test_budget_plans_after_first_batch_and_meets_it(tmp_path):
    torch.manual_seed(0)
    module = GPTModule()
    # Params + grads (SGD: no state) of TinyGPT(3) plus outside activations, plus room for ~2 kept blocks.
    cb = AutoCheckpoint(max_memory=10**6, headroom=0.0)
    trainer = _trainer(tmp_path, [cb], steps=3)
    trainer.fit(module)
    assert module.seen_choices[0] == dict.fromkeys(["model.h.0", "model.h.1", "model.h.2"], "full")
    assert set(module.seen_choices[1].values()) == {"keep"}  # 1 MB is plenty: nothing recomputed
    assert cb.plan.cost == 0
    measured = trainer.callback_metrics["checkpoint/activation_bytes_measured"].item()
    assert measured == cb.plan.activation_bytes


class _Wide(GPTModule):
    """16 samples of 64 tokens a batch: TinyGPT(4)'s whole batch does not fit 1.5 MB with every block kept."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 32, (32, 64), generator=g)), batch_size=16)


class _PricedClock:
    """The engine's step clock in a test: its time moves on by the price of each ``training_step`` run
    (:func:`_price_steps`), so a trial step measures exactly those prices."""

    def __init__(self) -> None:
        self.now, self.marks = 0.0, 0
        self.priced: list[tuple[str, int]] = []  # (way, samples) of each micro-step timed

    def mark(self) -> float:
        self.marks += 1
        return self.now

    def settle(self, last: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


def _price_steps(monkeypatch, module_type, price) -> list[tuple[str, int]]:
    """Each ``training_step`` of ``module_type`` costs ``price(module, samples)`` = ``(way, seconds)`` on the
    engine's step clock (deterministic timings); returns the (way, samples) of the micro-steps that the
    trial steps timed (those between a start and an end mark)."""
    import lightning_memopt.batching.step as step_module

    clock = _PricedClock()
    original = module_type.training_step

    def training_step(self, batch, batch_idx):
        samples = batch[0].shape[0]
        way, seconds = price(self, samples)
        clock.now += seconds
        if clock.marks % 2:
            clock.priced.append((way, samples))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(module_type, "training_step", training_step)
    monkeypatch.setattr(step_module, "step_clock", lambda device: clock)
    return clock.priced


def _timed(monkeypatch, launch: float) -> list[tuple[str, int]]:
    """GPTModule's micro-steps priced ``launch + samples`` seconds, +30% recomputed."""
    from lightning_memopt.checkpointing import checkpointed_blocks as treated

    def price(module, samples):
        full = set(treated(module.model).values()) - {"keep"} != set()
        return ("full" if full else "keep"), launch + samples * (1.3 if full else 1.0)

    return _price_steps(monkeypatch, GPTModule, price)


@pytest.mark.parametrize("launch", [0.0, 100.0])
def test_with_autoaccumulation_recompute_only_where_the_step_is_faster(tmp_path, monkeypatch, launch):
    """One decision for the micro-batch and the blocks: plain micro-batches unless recomputing makes larger
    ones that run the step faster (a launch cost per micro-step), then the plan made for the micro-batch
    that runs, its predicted activations those measured."""
    from lightning_memopt import AutoAccumulation
    from lightning_memopt.checkpointing import CostModel

    timed = _timed(monkeypatch, launch)
    torch.manual_seed(0)
    module = _Wide(n_layer=4)
    accumulation = AutoAccumulation(max_memory=1_500_000, headroom=0.0)
    cb = AutoCheckpoint(max_memory=1_500_000, headroom=0.0, cost_model=CostModel(use_time=False))
    # steps 1-5 the trial (recomputed and profiled, kept, the plan, kept, the plan), 6 the decision, 7 the
    # plan measured
    trainer = _trainer(tmp_path, [cb, accumulation], steps=7)
    with warnings.catch_warnings(record=True) as caught, MemoryCap(1_500_000, modules=module) as cap:
        warnings.simplefilter("always")
        trainer.fit(module)
    # Within the limit: every out-of-memory error the cap raised was a probe's, none a step's.
    assert cap.raised == sum(p is None for _, p in accumulation.probes)
    ways = [way for way, _ in timed]  # the trial's steps: every micro-step of each, taking turns twice
    n_plain, n_larger = ways.count("keep") // 2, ways.count("full") // 3  # recompute first: it plans
    assert ways == ["full"] * n_larger + (["keep"] * n_plain + ["full"] * n_larger) * 2
    assert n_plain > n_larger >= 1
    plain, larger = max(n for w, n in timed if w == "keep"), max(n for w, n in timed if w == "full")
    assert (
        sum(n for w, n in timed if w == "keep") == 2 * 16
        and sum(n for w, n in timed if w == "full") == 3 * 16
    )
    # a step's seconds: its micro-steps' together (launch + samples each, +30% recomputed)
    keep_time, full_time = n_plain * launch + 16, n_larger * launch + 1.3 * 16
    recomputes = full_time < keep_time
    assert recomputes == (launch > 0)
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
    if not recomputes:  # nothing profiled, nothing planned: every step runs plain micro-batches
        assert said == [
            f"AutoCheckpoint checkpoints no block of _Wide: {n_plain} micro-batches of {plain} without "
            f"recompute: {keep_time:.3g} s a step; {n_larger} of {larger} with the least recompute that fits them: "
            f"{full_time:.3g} s"
        ]
        assert -(-16 // accumulation.micro_batch_size) == n_plain
        assert all(set(c.values()) == {"keep"} for c in module.seen_choices[-2:])
        assert (
            not cb.plan.predicted and "checkpoint/activation_bytes_measured" not in trainer.callback_metrics
        )
        return
    assert said[0] == (
        f"AutoCheckpoint recomputes: {n_plain} micro-batches of {plain} without recompute: {keep_time:.3g} s a "
        f"step; {n_larger} of {larger} with the least recompute that fits them: {full_time:.3g} s"
    )
    # timed at the micro-batch that runs: the even split (9 fit; 16 runs as 2 x 8)
    assert -(-16 // accumulation.micro_batch_size) == n_larger and larger == -(-16 // n_larger)
    assert cb.plan.predicted and set(cb.plan.choices.values()) != {"keep"}
    assert module.seen_choices[-1] == cb.plan.choices  # the second step ran the plan made for its micro-batch
    measured = trainer.callback_metrics["checkpoint/activation_bytes_measured"].item()
    assert measured == cb.plan.activation_bytes > 0


@pytest.mark.parametrize("launch", [0.0, 100.0])
def test_the_exactness_check_waits_for_the_step_after_the_planning_turn(tmp_path, monkeypatch, launch):
    """The trial's first step, recompute's planning turn (every block recomputed, in micro-batches twice as
    large), runs unchecked; the next, plain micro-batches' first turn, checks its own."""
    import lightning_memopt.batching.step as step_module
    from lightning_memopt import AutoAccumulation
    from lightning_memopt.checkpointing import CostModel

    timed = _timed(monkeypatch, launch)
    checks, original = [], step_module.TrainingStep._check

    def check(self, regime, start, written):
        recomputed = set(checkpointed_blocks(self.module).values()) != {"keep"}
        checks.append((self.engine.trainer.global_step, self.sizes, recomputed))
        return original(self, regime, start, written)

    monkeypatch.setattr(step_module.TrainingStep, "_check", check)
    torch.manual_seed(0)
    module = _Wide(n_layer=4)
    accumulation = AutoAccumulation(max_memory=1_500_000, headroom=0.0)
    cb = AutoCheckpoint(max_memory=1_500_000, headroom=0.0, cost_model=CostModel(use_time=False))
    trainer = _trainer(tmp_path, [cb, accumulation], steps=7)
    with warnings.catch_warnings(), MemoryCap(1_500_000, modules=module):
        warnings.simplefilter("ignore")
        trainer.fit(module)
    plain = [n for way, n in timed if way == "keep"]
    plain = plain[: len(plain) // 2]  # the first of plain micro-batches' two turns
    assert checks == [(1, plain, False)]  # whichever way wins the trial (recompute's where launch > 0)


@pytest.mark.parametrize("launch", [0.0, 100.0])
def test_micro_steps_timed_to_cost_their_samples_alone_are_neither_recomputed_nor_tried(
    tmp_path, monkeypatch, launch
):
    """The size search's probes are timed: where a micro-step costs its samples alone (priced here, probes
    and steps alike, ``launch + samples`` seconds, +30% recomputed), fewer micro-batches save nothing, and
    recompute is neither probed, nor profiled, nor tried; with a launch cost it is all three."""
    from lightning_memopt import AutoAccumulation
    from lightning_memopt.batching.probe import BatchProbes
    from lightning_memopt.checkpointing import CostModel

    timed = _timed(monkeypatch, launch)
    probed, peak = [], BatchProbes.peak

    def priced(self, samples, evaluation=False):
        result = peak(self, samples, evaluation)
        full = set(checkpointed_blocks(self.engine.trainer.lightning_module.model).values()) != {"keep"}
        probed.append(("full" if full else "keep", samples))
        if result is not None:
            self.seconds = launch + samples * (1.3 if full else 1.0)
        return result

    monkeypatch.setattr(BatchProbes, "peak", priced)
    profiled = []
    plan_from = ac_module.AutoCheckpointer._plan_from
    monkeypatch.setattr(
        ac_module.AutoCheckpointer, "_plan_from", lambda *a, **k: profiled.append(1) or plan_from(*a, **k)
    )
    torch.manual_seed(0)
    module = _Wide(n_layer=4)
    limit = 2_500_000
    accumulation = AutoAccumulation(max_memory=limit, headroom=0.0)
    cb = AutoCheckpoint(max_memory=limit, headroom=0.0, cost_model=CostModel(use_time=False))
    trainer = _trainer(tmp_path, [cb, accumulation], steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
    if launch:  # recompute's search and trial: its probes, its profile at the trial's first step
        assert any(way == "full" for way, _ in probed) and profiled and timed and said == []  # trial: 5 steps
        return
    assert all(way == "keep" for way, _ in probed) and not profiled and timed == []
    fit = [n for n, p in accumulation.probes[1:] if p is not None]  # the first pays first-time costs
    high = max(fit)  # the largest that fits: a step of 16 runs as 4 micro-batches of 4
    low = max(n for n in fit if n <= high / 2)
    count = -(-16 // high)
    assert said == [
        f"AutoCheckpoint checkpoints no block of _Wide: {count} micro-batches of {-(-16 // count)} without "
        f"recompute: fewer, larger micro-batches would save at most 0.0% of the step (a micro-step: {low:g} s "
        f"at {low} samples, {high:g} s at {high})"
    ]
    assert count > 1 and all(set(c.values()) == {"keep"} for c in module.seen_choices)
    # logged: the step's seconds as the probes predict them, a second a sample (its micro-steps' together)
    assert trainer.callback_metrics["batching/step_seconds_predicted"].item() == pytest.approx(16.0)


def test_a_fit_resumed_during_the_trial_trains_as_the_fit_that_went_on(tmp_path, monkeypatch):
    """A checkpoint after the trial's second step (of five), where recompute's plan was made: the resumed
    fit goes on with the trial and its plan, takes the same decision as the fit that went on, profiles
    nothing again, and ends with the same parameters."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_memopt import AutoAccumulation
    from lightning_memopt.batching.probe import BatchProbes
    from lightning_memopt.checkpointing import CostModel

    _timed(monkeypatch, 100.0)  # recompute wins

    def fit(ckpt=None, probe=True):
        torch.manual_seed(0)
        module = _Wide(n_layer=4)
        saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
        callbacks = [
            AutoCheckpoint(max_memory=1_500_000, headroom=0.0, cost_model=CostModel(use_time=False)),
            AutoAccumulation(max_memory=1_500_000, headroom=0.0),
        ]
        trainer = _trainer(tmp_path, callbacks + [saves], steps=7, enable_checkpointing=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, ckpt_path=ckpt)
        said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
        return module, callbacks[0], said

    went_on, cb, said = fit()
    monkeypatch.setattr(BatchProbes, "peak", lambda *a, **k: pytest.fail("searched again"))
    # the trial's plan, made at the step saved (recompute's first turn), comes with AutoCheckpoint's state
    monkeypatch.setattr(
        ac_module.AutoCheckpointer, "_plan_from", lambda *a, **k: pytest.fail("profiled again")
    )
    resumed, resumed_cb, resumed_said = fit(ckpt=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert said == resumed_said and len(said) == 1 and said[0].startswith("AutoCheckpoint recomputes")
    assert resumed_cb.plan.choices == cb.plan.choices and set(cb.plan.choices.values()) != {"keep"}
    assert resumed.seen_choices[-3:] == went_on.seen_choices[-3:]
    for a, b in zip(went_on.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class _WideVocab(_Wide):
    """_Wide with a 512-token vocabulary: the loss's gradient w.r.t. the logits, made when backward starts,
    is as large as the blocks' activations."""

    def configure_model(self):
        if self.model is None:
            self.model = TinyGPT(self.n_layer, vocab=512)


@pytest.mark.parametrize("measured", [True, False])
def test_the_plan_holds_backwards_first_transient_beside_what_it_keeps(tmp_path, monkeypatch, measured):
    """Recompute wins (a launch cost per micro-step); the plan for the micro-batch that runs holds what the
    size search measured of the step with every block kept beyond the blocks' profiled bytes (the logits'
    gradient) beside the activations it keeps: no step runs out of memory. Without it (measured=False) the
    plan keeps blocks the search measured not to fit, and the step after it does run out of memory."""
    from lightning_memopt import AutoAccumulation
    from lightning_memopt.checkpointing import CostModel

    _timed(monkeypatch, 100.0)
    if not measured:
        monkeypatch.setattr(ac_module.AutoCheckpointer, "_transient", lambda self, profiles, held: 0)
    torch.manual_seed(0)
    module, limit = _WideVocab(n_layer=4), 3_500_000
    accumulation = AutoAccumulation(max_memory=limit, headroom=0.0)
    cb = AutoCheckpoint(max_memory=limit, headroom=0.0, cost_model=CostModel(use_time=False))
    trainer = _trainer(tmp_path, [cb, accumulation], steps=7)  # 4 trial steps, profiled, planned, one more
    with warnings.catch_warnings(), MemoryCap(limit, modules=module) as cap:
        warnings.simplefilter("ignore")
        if not measured:
            with pytest.raises(torch.OutOfMemoryError, match="MemoryCap"):
                trainer.fit(module)
            assert list(cb.plan.choices.values()).count("keep") >= 2
            return
        trainer.fit(module)
    assert cap.raised == sum(p is None for _, p in accumulation.probes)  # only probes ran out of memory
    assert cb.plan.transient > 0 and cb.plan.peak_bytes == cb.plan.activation_bytes + cb.plan.transient
    assert cb.plan.peak_bytes <= cb.plan.max_bytes and list(cb.plan.choices.values()).count("keep") == 1
    measured_bytes = trainer.callback_metrics["checkpoint/activation_bytes_measured"].item()
    assert measured_bytes == cb.plan.activation_bytes  # measured on the step that ran the plan


def test_capacity_known_plans_under_capacity(tmp_path, monkeypatch):
    param_bytes = sum(p.numel() * 4 for p in TinyGPT(3).parameters())
    # Outside the blocks autograd holds: the embedding's indices (int64), ln_f's input and its stats
    # (B*T*h*4 + 2*B*T*4), the head's input (B*T*h*4), the log-softmax output (B*T*vocab*4) and
    # nll_loss's total weight (a fp32 scalar).
    B, T, h, vocab = 4, 8, 16, 32
    outside = B * T * 8 + 2 * B * T * h * 4 + 2 * B * T * 4 + B * T * vocab * 4 + 4

    class FakeDevice:
        def capacity(self):
            return 2 * param_bytes + outside + 40_000  # parameters, SGD gradients, 40 kB for the blocks

    monkeypatch.setattr(ac_module, "device_memory", lambda *a, **k: FakeDevice())
    torch.manual_seed(0)
    module = GPTModule()
    cb = AutoCheckpoint(headroom=0.0)
    trainer = _trainer(tmp_path, [cb], steps=3)
    trainer.fit(module)
    assert cb.plan.predicted and cb.plan.max_bytes == 40_000
    assert cb.plan.activation_bytes <= cb.plan.max_bytes < cb.plan.baseline_bytes
    assert "keep" in cb.plan.choices.values() or "selective" in cb.plan.choices.values()
    assert trainer.callback_metrics["checkpoint/activation_bytes_measured"].item() == cb.plan.activation_bytes


def test_infeasible_budget_raises(tmp_path):
    with pytest.raises(MisconfigurationException, match="does not even hold the parameters"):
        _trainer(tmp_path, [AutoCheckpoint(max_memory=1000, headroom=0.0)]).fit(GPTModule())


def test_mismatch_warns(tmp_path):
    class Flaky(GPTModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:  # this step's blocks see twice the sequence length the plan was made for
                batch = [torch.cat([batch[0], batch[0]], dim=1)]
            return super().training_step(batch, batch_idx)

    cb = AutoCheckpoint(max_memory=10**6, headroom=0.0)
    with pytest.warns(UserWarning, match=r"the plan predicted .* \(more than 10% apart\)"):
        _trainer(tmp_path, [cb], steps=2).fit(Flaky())


def test_exception_in_first_step_leaves_nothing_behind(tmp_path):
    from lightning_memopt.memory import tracker

    class Failing(GPTModule):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)  # runs with the measuring hooks entered
            raise ValueError("user bug")

    module = Failing()
    with pytest.raises(ValueError, match="user bug"):
        _trainer(tmp_path, [AutoCheckpoint(max_memory=10**6, headroom=0.0)]).fit(module)
    assert module.seen_choices == [{"model.h.0": "full", "model.h.1": "full", "model.h.2": "full"}]
    assert tracker._ACTIVE == []  # the step's ActivationMeter was exited
    assert checkpointed_blocks(module) == {} and "configure_model" not in module.__dict__


def test_resume_reapplies_plan_without_profiling(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cb = AutoCheckpoint(max_memory=10**6, headroom=0.0)
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False
    )
    trainer.callbacks.append(cb)
    trainer.fit(GPTModule())
    ckpt = trainer.checkpoint_callback.best_model_path
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert any(v.get("plan", {}) and v["plan"]["choices"] == cb.plan.choices for v in saved.values())

    def boom(*a, **k):
        raise AssertionError("profiled again")

    monkeypatch.setattr(ac_module, "profile_blocks", boom)
    module, cb2 = GPTModule(), AutoCheckpoint(max_memory=10**6, headroom=0.0)
    _trainer(tmp_path, [cb2], steps=3).fit(module, ckpt_path=ckpt)
    assert cb2.plan == cb.plan
    assert module.seen_choices[0] == cb.plan.choices


def test_checkpoint_loads_into_bare_model(tmp_path):
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        callbacks=[AutoCheckpoint()],
    )
    trainer.fit(GPTModule(build_in_configure=False))
    bare = GPTModule(build_in_configure=False)
    state = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)["state_dict"]
    assert list(state) == list(bare.state_dict())
    bare.load_state_dict(state)


def test_no_repeated_blocks_warns_once_and_changes_nothing(tmp_path):
    class Small(GPTModule):
        def configure_model(self):
            self.model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))

    module = Small()
    with pytest.warns(UserWarning, match="found no repeated blocks in Small and changes nothing") as record:
        _trainer(tmp_path, [AutoCheckpoint()], steps=1).fit(module)
    assert sum("no repeated blocks" in str(w.message) for w in record) == 1
    assert module.seen_choices == [{}]


def test_blocks_matching_nothing_lists_candidates(tmp_path):
    with pytest.raises(ValueError, match=r"candidate block classes found: \['Block'\]"):
        _trainer(tmp_path, [AutoCheckpoint(blocks=["encoder.*"])], steps=1).fit(GPTModule())


def test_fsdp_strategy_policy_is_not_doubled(tmp_path):
    strategy = FSDPStrategy(activation_checkpointing_policy={torch.nn.Linear})
    cb, module = AutoCheckpoint(), GPTModule()
    trainer = type("T", (), {"strategy": strategy})()
    with pytest.warns(UserWarning, match="already checkpoints activations .* AutoCheckpoint does nothing"):
        cb.setup(trainer, module, "fit")
    assert "configure_model" not in module.__dict__


def test_fraction_budget_needs_known_capacity(tmp_path):
    with pytest.raises(
        MisconfigurationException, match=r"max_memory=0.5 is a fraction of the device's capacity, but this"
    ):
        _trainer(tmp_path, [AutoCheckpoint(max_memory=0.5)]).fit(GPTModule())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_memory": "-1GB"}, "max_memory must be a byte size, got '-1GB'"),
        ({"max_memory": "banana"}, "max_memory must be a byte size, got 'banana'"),
        ({"max_memory": 0}, "max_memory must be positive, got 0"),
        ({"max_memory": 1.5}, r"must be in \(0, 1\], got 1.5"),
        ({"max_memory": 0.0}, r"must be in \(0, 1\], got 0.0"),
        ({"mode": "fast"}, "mode must be one of .* got 'fast'"),
        ({"mode": "full", "max_memory": "1GB"}, "only used by mode='auto', got mode='full'"),
        ({"every_n": 0}, "every_n must be a positive int, got 0"),
        ({"headroom": 1.0}, r"headroom must be a number in \[0, 1\) .* got 1.0"),
        ({"max_memory": "1e400GB"}, "max_memory must be a finite byte size, got '1e400GB'"),
        ({"blocks": 5}, "blocks must be module classes, class names or name patterns, got 5"),
        ({"blocks": ["h.*", 5]}, "blocks must be module classes, class names or name patterns, got 5"),
        ({"cost_model": 5}, "cost_model must be a CostModel, got 5"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoCheckpoint(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"allow_offload": "no"}, "allow_offload must be True or False or None, got 'no'"),
        ({"log": "yes"}, "log must be True or False, got 'yes'"),
    ],
)
def test_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        AutoCheckpoint(**kwargs)


def test_find_blocks_of_module_used_by_callback():
    assert [n for n, _ in find_blocks(GPTModule(build_in_configure=False))] == [
        "model.h.0",
        "model.h.1",
        "model.h.2",
    ]


def test_configurable_from_yaml_like_arguments():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(AutoCheckpoint, "cb")
    for args, max_bytes in (
        [["--cb.max_memory=6GiB"], "6GiB"],
        [["--cb.max_memory=0.5"], 0.5],
        [["--cb.max_memory=1000"], 1000],
    ):
        cfg = parser.parse_args([*args, "--cb.blocks=[h.*]", "--cb.cost_model.pointwise_flops_per_byte=20"])
        cb = (
            parser.instantiate(cfg).cb
            if hasattr(parser, "instantiate")
            else parser.instantiate_classes(cfg).cb
        )
        assert (cb.max_memory, cb.blocks, cb.cost_model.pointwise_flops_per_byte) == (
            max_bytes,
            ["h.*"],
            20.0,
        )


@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_with_batchnorm_swap_the_module_is_restored_whatever_the_order(tmp_path, checkpoint_first):
    """Both callbacks wrap configure_model; after fit the instance has no wrapper left, in either order."""
    from lightning_memopt import BatchNormToGroupNorm

    module = GPTModule()
    callbacks = [AutoCheckpoint(), BatchNormToGroupNorm()]
    trainer = _trainer(tmp_path, callbacks if checkpoint_first else callbacks[::-1], steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing to swap": TinyGPT has no BatchNorm
        trainer.fit(module)
    assert module.seen_choices[0] == dict.fromkeys(["model.h.0", "model.h.1", "model.h.2"], "full")
    assert "configure_model" not in vars(module) and "on_load_checkpoint" not in vars(module)


def _static_and_outside():
    """TinyGPT(3)'s parameters + SGD gradients, and what autograd holds outside its blocks (see
    test_capacity_known_plans_under_capacity), for a batch of 4 x 8 tokens."""
    param_bytes = sum(p.numel() * 4 for p in TinyGPT(3).parameters())
    B, T, h, vocab = 4, 8, 16, 32
    return 2 * param_bytes, B * T * 8 + 2 * B * T * h * 4 + 2 * B * T * 4 + B * T * vocab * 4 + 4


def test_too_small_a_limit_is_reported_with_the_users_value_and_what_it_must_hold(tmp_path):
    static, outside = _static_and_outside()
    limit = static + outside + 100  # 100 bytes for the blocks: less than any plan needs
    with pytest.raises(MisconfigurationException) as err:
        _trainer(tmp_path, [AutoCheckpoint(max_memory=limit, headroom=0.0)]).fit(GPTModule())
    message = str(err.value)
    assert f"max_memory={limit} (usable with headroom=0.0: " in message
    assert "is too small for any plan; it must hold the parameters, gradients and optimizer state" in message
    assert "Pass max_memory >= " in message


def test_log_false_logs_nothing(tmp_path):
    trainer = _trainer(tmp_path, [AutoCheckpoint(log=False)])
    trainer.fit(GPTModule())
    assert not [k for k in trainer.callback_metrics if k.startswith("checkpoint/")]


@pytest.mark.parametrize(
    ("kwargs", "profiled"),
    [
        ({"mode": "full"}, ["keep", "full"]),
        ({"mode": "selective"}, ["keep", "selective"]),
        ({}, ["keep", "full"]),  # CPU, no limit: full recompute where it helps, else keep
        ({"max_memory": 10**6}, ["keep", "selective", "full", "pointwise"]),  # CPU: no offload
        ({"max_memory": 10**6, "allow_offload": True}, ["keep", "selective", "full", "pointwise", "offload"]),
    ],
)
def test_profiles_only_the_treatments_the_mode_can_choose(tmp_path, monkeypatch, kwargs, profiled):
    seen = []

    def spy(*args, choices, **kw):
        seen.append(list(choices))
        return ac_module.profile_blocks.__wrapped__(*args, choices=choices, **kw)

    spy.__wrapped__ = ac_module.profile_blocks
    monkeypatch.setattr(ac_module, "profile_blocks", spy)
    _trainer(tmp_path, [AutoCheckpoint(**kwargs)], steps=1).fit(GPTModule())
    assert seen == [profiled]


def test_blocks_where_recompute_saves_nothing_are_kept(tmp_path):
    class Linears(GPTModule):
        """Blocks that are single Linear layers: each saves its input whether checkpointed or not."""

        def configure_model(self):
            self.model = torch.nn.Sequential(
                torch.nn.Embedding(32, 16), *[torch.nn.Linear(16, 16) for _ in range(3)]
            )

        def training_step(self, batch, batch_idx):
            self.seen_choices.append(checkpointed_blocks(self))
            return self.model(batch[0]).square().mean()

    module, cb = Linears(), AutoCheckpoint()
    _trainer(tmp_path, [cb], steps=2).fit(module)
    assert module.seen_choices[0] == dict.fromkeys(["model.1", "model.2", "model.3"], "full")
    assert (
        module.seen_choices[1] == cb.plan.choices == dict.fromkeys(["model.1", "model.2", "model.3"], "keep")
    )
    assert cb.plan.extra_flops == 0 and cb.plan.activation_bytes == cb.plan.baseline_bytes


def test_a_model_that_checkpoints_itself_is_left_alone(tmp_path):
    class TimmLike(GPTModule):
        def configure_model(self):
            super().configure_model()
            self.model.grad_checkpointing = True  # what timm's set_grad_checkpointing() sets

    module = TimmLike()
    with pytest.warns(
        UserWarning, match=r"model \(TinyGPT.grad_checkpointing\) already checkpoints"
    ) as record:
        _trainer(tmp_path, [AutoCheckpoint()], steps=1).fit(module)
    assert sum("already checkpoints" in str(w.message) for w in record) == 1
    assert module.seen_choices == [{}]


def test_block_patterns_match_relative_to_the_module_holding_the_blocks(tmp_path):
    module, cb = GPTModule(), AutoCheckpoint(blocks="h.?", mode="full")
    _trainer(tmp_path, [cb], steps=1).fit(module)
    assert module.seen_choices[0] == dict.fromkeys(["model.h.0", "model.h.1", "model.h.2"], "full")


class ScriptedClock:
    """Each timed pass of a round takes the next of ``durations`` seconds: the profile times the policy's
    treatments in its order (keep, selective, full, pointwise on CPU), so each treatment gets its own."""

    def __init__(self, durations):
        self.durations, self.now, self.marks = durations, 0.0, 0

    def mark(self):
        if self.marks % 2:
            self.now += self.durations[(self.marks // 2) % len(self.durations)]
        self.marks += 1
        return self.now

    def settle(self, last):
        """Readable at once."""

    def seconds(self, start, end):
        return end - start


@pytest.mark.parametrize(
    "durations, chosen, never",
    [
        ((1.0, 1.1, 2.0, 2.0), "selective", {"full", "pointwise"}),  # selective adds 0.1s, the others 1s
        ((1.0, 2.0, 1.1, 2.0), "full", {"selective", "pointwise"}),  # full the cheap one
    ],
)
def test_plans_are_priced_by_the_time_each_treatment_takes(tmp_path, monkeypatch, durations, chosen, never):
    from lightning_memopt.checkpointing import policy

    monkeypatch.setattr(policy, "step_clock", lambda device: ScriptedClock(durations))
    module = GPTModule()
    # The blocks get 85 kB: a kept block holds 35,392 bytes, a selective one 22,528, a full one 2,048. Two
    # selective blocks and a kept one fit, or one full block and two kept: which is cheaper is the clock's.
    param_bytes = sum(p.numel() * 4 for p in TinyGPT(3).parameters())
    B, T, h, vocab = 4, 8, 16, 32
    outside = B * T * 8 + 2 * B * T * h * 4 + 2 * B * T * 4 + B * T * vocab * 4 + 4  # see the test above
    cb = AutoCheckpoint(max_memory=2 * param_bytes + outside + 85_000, headroom=0.0)
    _trainer(tmp_path, [cb], steps=2).fit(module)
    choices = set(cb.plan.choices.values())
    assert chosen in choices and not choices & never
    assert cb.plan.seconds == pytest.approx(0.1 * list(cb.plan.choices.values()).count(chosen))


def test_pointwise_under_bf16_mixed_trains_as_plain_and_drops_autocast_copies(tmp_path):
    # Lightning's bf16-mixed on CPU: the LayerNorms' float32 outputs reach the linear layers as bf16
    # copies; pointwise drops them (and the GELU's output) and the parameters after 3 steps are the plain
    # run's, bit for bit. The plan's bytes are MemoryTracker's measurement of the same step.
    params, metrics = [], []
    for callbacks in ([], [AutoCheckpoint(mode="pointwise")]):
        torch.manual_seed(0)
        module = GPTModule(build_in_configure=False)
        trainer = _trainer(tmp_path, callbacks, steps=3, precision="bf16-mixed")
        trainer.fit(module)
        params.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
        metrics.append(trainer.callback_metrics)
    assert torch.equal(params[1], params[0])
    predicted = metrics[1]["checkpoint/activation_bytes_predicted"].item()
    assert predicted == metrics[1]["checkpoint/activation_bytes_measured"].item()
    model = TinyGPT(3)
    profiles = profile_blocks(
        model,
        find_blocks(model),
        torch.randint(0, 32, (4, 8)),
        choices=["keep"],
        context=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    )
    keep = evaluate_plan(profiles, ["keep"] * 3).activation_bytes
    B, T, h = 4, 8, 16  # per block: two bf16 copies of (B,T,h) and the bf16 GELU output (B,T,4h)
    assert keep - predicted == 3 * (2 * B * T * h * 2 + B * T * 4 * h * 2)


class _HFLM(pl.LightningModule):
    """A tiny Hugging Face GPT-2 whose logits (a 2,048-token vocabulary) outweigh its blocks' activations;
    ``heads`` records, per training forward, whether the model's own head ran (logits returned)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=2048, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0
        )
        config.attn_pdrop = 0.0
        self.model = transformers.GPT2LMHeadModel(config)
        self.heads: list[str] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids)
        self.heads.append("own" if getattr(out, "logits", None) is not None else "chunked")
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 2048, (48, 64), generator=g)), batch_size=16)


def _priced_by_way(monkeypatch, launch: float) -> list[tuple[str, int]]:
    """_HFLM's micro-steps priced ``launch + samples`` seconds, 20% more with the chunked head, 40% more
    recomputed (deterministic timings); returns the (way, samples) of the trial's micro-steps."""
    from lightning_memopt.checkpointing.auto import AutoCheckpointer

    using = []
    use = AutoCheckpointer.use
    monkeypatch.setattr(AutoCheckpointer, "use", lambda self, t: using.append(t) or use(self, t))
    cost = {"own head": 1.0, "keep": 1.2, "full": 1.4}
    return _price_steps(monkeypatch, _HFLM, lambda module, n: (using[-1], launch + n * cost[using[-1]]))


@pytest.mark.parametrize("launch", [0.0, 100.0])
def test_with_autoaccumulation_the_chunked_head_stays_only_where_the_step_is_faster(
    tmp_path, monkeypatch, launch
):
    """The head is part of the decision: the model's own head first, the chunked head where its larger
    micro-batches make the step faster (a launch cost per micro-step: priced here ``launch + samples``
    seconds, 20% more chunked, 40% more recomputed), else it is taken off for the rest of the fit."""
    from lightning_memopt import AutoAccumulation

    timed = _priced_by_way(monkeypatch, launch)
    module = _HFLM()
    limit = 9_000_000
    accumulation = AutoAccumulation(max_memory=limit, headroom=0.0)
    # up to 7 trial steps (own head, chunked, recomputed, twice, and the plan once more), then the way decided
    trainer = _trainer(tmp_path, [AutoCheckpoint(max_memory=limit, headroom=0.0), accumulation], steps=10)
    with warnings.catch_warnings(record=True) as caught, MemoryCap(limit, modules=module) as cap:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert cap.raised == sum(p is None for _, p in accumulation.probes)  # only probes ran out of memory
    ways = [way for i, (way, _) in enumerate(timed) if i == 0 or timed[i - 1][0] != way]  # a step each
    # recompute first (it plans), then the ways in turn, twice
    assert ways[:3] == ["full", "own head", "keep"] and ways[1:] == ways[1 : 1 + len(ways) // 2] * 2
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
    assert len(said) == 1 and "micro-batches of" in said[0] and "with the model's own head" in said[0]
    steady = module.heads[-6:]  # the last steps' forwards, after the search's probes
    if launch == 0.0:  # as many samples, each cheaper: the own head
        assert said[0].startswith(
            "AutoCheckpoint checkpoints no block of _HFLM and leaves its own output head: "
        )
        assert set(steady) == {"own"}
    else:  # fewer, larger micro-batches: the chunked head (with or without recompute)
        assert "leaves its own output head" not in said[0]
        assert set(steady) == {"chunked"}
    assert "forward" not in vars(module.model)  # nothing of the head stays attached after fit


def test_a_resumed_run_keeps_the_model_own_head_the_search_chose(tmp_path, monkeypatch):
    """The own head chosen (no launch cost), then a checkpoint: the resumed run decides nothing again and
    computes its loss with the model's own head, as the run that saved did (the chunked head is taken off
    at once, or never installed)."""
    from lightning_memopt import AutoAccumulation
    from lightning_memopt.batching.probe import BatchProbes

    _priced_by_way(monkeypatch, 0.0)
    limit = 9_000_000
    module = _HFLM()
    callbacks = [
        AutoCheckpoint(max_memory=limit, headroom=0.0),
        AutoAccumulation(max_memory=limit, headroom=0.0),
    ]
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=8,  # the trial (up to 7 steps), then the decision
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
    assert len(said) == 1 and "leaves its own output head" in said[0]
    ckpt = trainer.checkpoint_callback.best_model_path
    saved = [v for v in torch.load(ckpt, weights_only=False)["callbacks"].values() if "own_head" in v]
    assert [v["own_head"] for v in saved] == [True]

    def boom(*a, **k):
        raise AssertionError("searched again")

    monkeypatch.setattr(BatchProbes, "peak", boom)
    resumed = _HFLM()
    callbacks = [
        AutoCheckpoint(max_memory=limit, headroom=0.0),
        AutoAccumulation(max_memory=limit, headroom=0.0),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, callbacks, steps=9).fit(resumed, ckpt_path=ckpt)
    assert not [w for w in caught if str(w.message).startswith("AutoCheckpoint")]
    assert resumed.heads and set(resumed.heads) == {"own"}
    assert "forward" not in vars(resumed.model)


class _StemModule(pl.LightningModule):
    """Two blocks, the first a linear stem on the raw batch (it saves its input: a slice of the batch
    under micro-batching), in float32 at a batch of 8."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Linear(12, 16)),
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
        )
        self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        return self.head(self.blocks(batch[0])).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randn(24, 12, generator=torch.Generator().manual_seed(0))), batch_size=8
        )


def test_micro_batches_sliced_from_the_batch_measure_what_the_plan_predicts(tmp_path):
    # AutoAccumulation runs micro-batches of 2, slices of the batch of 8: the stem saves its slice, whose
    # storage is the whole batch. The blocks' bytes are the slice's, as predicted; before, the whole batch
    # counted and every step warned that the blocks held more than the plan predicted.
    from lightning_memopt import AutoAccumulation

    torch.manual_seed(0)
    module = _StemModule()
    trainer = _trainer(tmp_path, [AutoCheckpoint(mode="full"), AutoAccumulation(micro_batch_size=2)], steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    metrics = trainer.callback_metrics
    # Full recompute: each block holds its input: the stem 2 x 12 fp32 (its slice), the next 2 x 16.
    assert metrics["checkpoint/activation_bytes_predicted"].item() == 2 * 12 * 4 + 2 * 16 * 4
    assert metrics["checkpoint/activation_bytes_measured"].item() == 2 * 12 * 4 + 2 * 16 * 4
    assert not [w for w in caught if "more than 10% apart" in str(w.message)]


class _HeavyBatch(GPTModule):
    """Each batch also carries 4 x 40,000 float32 features (640 KB) that the step reads but autograd never
    holds: they stay alive beside the activations through the step, as an image batch does."""

    def training_step(self, batch, batch_idx):
        idx, features = batch
        logits = self.model(idx)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()) + 0 * features.mean()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, 32, (self.n_samples, 64), generator=g)
        samples = [(i, lambda: torch.zeros(40_000)) for i in idx]  # made as loaded: no dataset held
        return DataLoader(samples, batch_size=4, collate_fn=lambda rows: _collate(rows))


def _collate(rows):
    return torch.stack([i for i, _ in rows]), torch.stack([make() for _, make in rows])


@pytest.mark.parametrize("counted", [True, False])
def test_the_plan_counts_the_batch_held_beside_the_activations(tmp_path, monkeypatch, counted):
    """The measured step's batch, which autograd does not hold but the step does, counts beside what the
    plan keeps (ForwardProbe.batch_bytes): the planned steps fit. Without it (counted=False) the plan
    keeps blocks that the batch leaves no room for, and the step after it runs out of memory."""
    from lightning_memopt.checkpointing import meter

    if not counted:
        monkeypatch.setattr(
            meter.ForwardProbe, "batch_bytes", property(lambda self: 0, lambda self, v: None), raising=False
        )
    torch.manual_seed(0)
    module, limit = _HeavyBatch(n_layer=4, n_samples=12), 1_800_000
    cb = AutoCheckpoint(max_memory=limit, headroom=0.0)
    trainer = _trainer(tmp_path, [cb], steps=3)  # measured and planned, then the plan runs twice
    with warnings.catch_warnings(), MemoryCap(limit, modules=module):
        warnings.simplefilter("ignore")
        if not counted:
            with pytest.raises(torch.OutOfMemoryError, match="MemoryCap"):
                trainer.fit(module)
            return
        trainer.fit(module)
    assert cb.plan.predicted and set(cb.plan.choices.values()) != {"full"}  # some block keeps


@pytest.mark.parametrize(("kwargs", "kept"), [({"max_memory": 10**9}, False), ({"mode": "offload"}, True)])
def test_the_pinned_buffers_of_the_profile_s_offload_stay_only_while_a_plan_offloads(
    tmp_path, monkeypatch, kwargs, kept
):
    """The profile's ``offload`` passes pin host buffers in the shared pool: freed as soon as the plan that
    runs offloads nothing (a plan under a roomy limit keeps every block), else kept for its steps, and freed
    when the fit ends either way."""
    from lightning_memopt.checkpointing import offload
    from tests.memory.fake_cuda import install

    fake = install(monkeypatch)  # CPU tensors play the device's; the pool's copies are the overlapped ones
    monkeypatch.setattr(offload, "OFFLOAD_DEVICE_TYPES", ("cpu",))
    offload.offloader_for("cpu", min_bytes=0)  # TinyGPT's tensors are far below the default 1 MiB
    buffers = []

    def pinned(nbytes):
        buffer = fake.pinned_empty(nbytes)
        buffers.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(offload, "pinned_empty", pinned)
    alive = []

    class Pinned(pl.Callback):  # after AutoCheckpoint's own on_train_batch_end, which plans
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            alive.append(sum(ref() is not None for ref in buffers))

    cb = AutoCheckpoint(allow_offload=True, **kwargs)
    _trainer(tmp_path, [cb, Pinned()], steps=2).fit(GPTModule())
    assert "offload" in cb.plan.choices.values() if kept else set(cb.plan.choices.values()) == {"keep"}
    assert buffers and offload._OFFLOADERS == {}
    assert alive == ([len(buffers)] * 2 if kept else [0, 0])
    assert not any(ref() is not None for ref in buffers)  # the fit's end freed them all
