"""AutoCheckpoint under a limit, batches that grow (issue 12): a plan per batch shape, never over max_bytes."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

import lightning_memopt.checkpointing.auto as ac_module
from lightning_memopt import AutoCheckpoint
from lightning_memopt.checkpointing import ActivationMeter, find_blocks
from tests.batching.helpers import quiet_trainer
from tests.checkpointing.models import TinyGPT

# Padded to each batch's longest sequence: 4 samples of 8, 16, 12, 24 ... tokens; new longest: steps 0, 2, 5.
LENGTHS = [8, 8, 16, 12, 16, 24, 8, 24]
# Parameters + SGD gradients take 85.38 KiB and the activations outside the blocks a few more, so the blocks'
# max_bytes is 273,868 bytes at 8 tokens and 256,460 at 24; every block kept holds 225,024 bytes at 16 tokens and
# 356,544 at 24: the plan made on the first (8-token) batch keeps everything and would overrun at 24 tokens.
MAX_MEMORY = 370_000


class GPTModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT(3)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BlockBytes(pl.Callback):
    """Per step: the batch shape, the bytes the blocks hold at the end of the forward (``ActivationMeter``,
    independent of AutoCheckpoint's own probe) and the blocks' max_bytes of the plan AutoCheckpoint ran."""

    def __init__(self, auto: AutoCheckpoint) -> None:
        self.auto = auto
        self.rows: list[tuple[tuple[int, ...], int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._meter = ActivationMeter(pl_module, find_blocks(pl_module)).__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self._meter.__exit__(None, None, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # After a step that profiled, the plan is the one made for that step's shape (on the same batch).
        self.rows.append((tuple(batch.shape), self._meter.total, self.auto.plan.max_bytes))


def _batches(lengths=LENGTHS):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (4, t), generator=g) for t in lengths]


def _fit(tmp_path, callbacks, lengths=LENGTHS, ckpt_path=None, checkpointing=False):
    torch.manual_seed(0)
    module = GPTModule()
    trainer = quiet_trainer(
        callbacks, default_root_dir=tmp_path, max_steps=len(lengths), enable_checkpointing=checkpointing
    )
    trainer.fit(module, DataLoader(_batches(lengths), batch_size=None), ckpt_path=ckpt_path)
    return module, trainer


def test_longer_batches_are_planned_for_and_never_exceed_the_budget(tmp_path):
    auto = AutoCheckpoint(max_memory=MAX_MEMORY, headroom=0.0)
    meter = BlockBytes(auto)
    module, _ = _fit(tmp_path, [auto, meter])
    for step, (shape, held, max_bytes) in enumerate(meter.rows):
        assert held <= max_bytes, (
            f"step {step}, batch {shape}: the blocks held {held} bytes, max_bytes {max_bytes}"
        )
    # One plan per new longest shape (steps 0, 2, 5), none for the shorter or repeated ones.
    assert auto.shape_plans.made == 3
    assert list(auto.shape_plans.plans) == [((4, 8),), ((4, 16),), ((4, 24),)]
    short, long = auto.shape_plans.plans[((4, 8),)], auto.shape_plans.plans[((4, 24),)]
    assert set(short.choices.values()) == {"keep"} and "full" in long.choices.values()
    assert [max_bytes for *_, max_bytes in meter.rows] == [273_868] * 2 + [265_164] * 3 + [
        256_460,
        273_868,
        256_460,
    ]
    # Profiled steps run every block full: only the blocks' inputs, 4 x T x 16 fp32 per block, are held.
    assert [meter.rows[i][1] for i in (0, 2, 5)] == [3 * 4 * t * 16 * 4 for t in (8, 16, 24)]
    assert meter.rows[7][1] == long.activation_bytes  # the 24-token plan's prediction, exact

    plain, _ = _fit(tmp_path, [])
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=0, msg=name)


def test_planning_only_on_the_first_batch_overruns(tmp_path):
    """The test above can fail: planned once on the short first batch (the behaviour before issue 12), the
    24-token batches hold more than the max_bytes."""

    class FirstBatchOnly(AutoCheckpoint):
        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            self._by_shape = False

    auto = FirstBatchOnly(max_memory=MAX_MEMORY, headroom=0.0)
    meter = BlockBytes(auto)
    _fit(tmp_path, [auto, meter])  # silently: the plan is checked on step 1 only, 8 tokens like step 0
    over = [step for step, (_, held, max_bytes) in enumerate(meter.rows) if held > max_bytes]
    assert over == [5, 7] and meter.rows[5][1] == 356_544 > meter.rows[5][2] == 273_868


def test_a_batch_too_large_even_fully_checkpointed_warns_before_it_runs(tmp_path):
    ran = []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            ran.append(tuple(batch.shape))

    # Fully checkpointed, the blocks' peak at 8 tokens (their inputs, and one block recomputed in backward)
    # times 64 (the elements) times 64 (the sequence: attention's T x T), over the blocks' 273,868 bytes:
    # the warning comes before the batch runs.
    with (
        pytest.warns(
            UserWarning,
            match=r"shapes \[\(4, 512\)\] arrives; .* 154.\d\d MiB, over the blocks. share 267.45 KiB",
        ),
        pytest.raises(
            MisconfigurationException, match=r"AutoCheckpoint: max_memory=370000 .* Pass max_memory >="
        ),
    ):
        _fit(tmp_path, [AutoCheckpoint(max_memory=MAX_MEMORY, headroom=0.0), Recorder()], lengths=[8, 8, 512])
    assert ran == [(4, 8), (4, 8), (4, 512)]


def test_under_micro_batching_a_longer_batch_is_sized_not_warned_about(tmp_path):
    # The batch of 512 tokens that the test above warns about: under OOMBackoff the engine sizes its
    # micro-batches by measuring them, so AutoCheckpoint does not estimate it (the estimate scaled the whole
    # batch, and read 16x over on micro-batches a quarter of it that fit).
    import warnings

    from lightning_memopt import OOMBackoff

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MisconfigurationException, match=r"AutoCheckpoint: max_memory=370000"):
            _fit(
                tmp_path,
                [AutoCheckpoint(max_memory=MAX_MEMORY, headroom=0.0), OOMBackoff()],
                lengths=[8, 8, 512],
            )
    assert not [w for w in caught if "arrives; fully checkpointed" in str(w.message)]


def test_resume_keeps_the_plans_per_shape(tmp_path, monkeypatch):
    auto = AutoCheckpoint(max_memory=MAX_MEMORY, headroom=0.0)
    _, trainer = _fit(tmp_path, [auto], checkpointing=True)
    ckpt = trainer.checkpoint_callback.best_model_path
    saved = next(v for v in torch.load(ckpt, weights_only=False)["callbacks"].values() if "shapes" in v)
    assert [e["shapes"] for e in saved["shapes"]] == [[[4, 8]], [[4, 16]], [[4, 24]]]

    def boom(*a, **k):
        raise AssertionError("profiled again")

    monkeypatch.setattr(ac_module, "profile_blocks", boom)
    resumed = AutoCheckpoint(max_memory=MAX_MEMORY, headroom=0.0)
    # A new epoch from step 8: batches of 8, 8 and 16 tokens, all planned for before.
    _fit(tmp_path / "r", [resumed], lengths=LENGTHS + [24, 16, 8], ckpt_path=ckpt)
    assert resumed.shape_plans.plans == auto.shape_plans.plans and resumed.shape_plans.made == 0
    assert resumed.plan == auto.shape_plans.plans[((4, 16),)]


def test_a_larger_micro_batch_of_the_same_shape_is_planned_for(tmp_path):
    """With OOMBackoff: step 0 runs out of memory at 8 and 4 samples and trains as 4 x 2, so its plan is
    profiled on 2; growth brings later steps of the same shape to [2, 3, 3], which that plan does not
    cover (3 samples hold 1.5x what it predicted): they are planned for again, and no step holds more than
    the plan it ran predicted."""
    from lightning_memopt import OOMBackoff
    from lightning_memopt.testing import OOMInjector

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (8, 16), generator=g) for _ in range(4)]

    def fit(callbacks, injector=None):
        torch.manual_seed(0)
        module = GPTModule()
        trainer = quiet_trainer(callbacks, max_steps=len(batches))
        if injector is not None:
            injector = injector(module, trainer).install()
        trainer.fit(module, DataLoader(batches, batch_size=None))
        return module, injector

    base, _ = fit([])
    auto = AutoCheckpoint(max_memory=2 * MAX_MEMORY, headroom=0.0)
    with pytest.warns() as caught:
        module, injector = fit(
            [auto, OOMBackoff(grow_after=1)],
            lambda m, t: OOMInjector(m.model, max_size=2, steps={0}, step_fn=lambda: t.global_step),
        )
    assert injector.raised == 2  # 8, then 4
    assert sorted(shape[-1] for shape in auto.shape_plans.plans) == [(2,), (3,)]  # keyed by micro-batch
    assert auto.shape_plans.made == 2
    assert not [w for w in caught if "held" in str(w.message) and "predicted" in str(w.message)]
    for p, q in zip(module.parameters(), base.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_a_smaller_micro_batch_of_the_same_shape_gets_its_own_plan(tmp_path):
    """With OOMBackoff: step 0 trains whole (8 samples) and its plan is made for 8 (two blocks recomputed);
    step 1 runs out of memory at 8 and trains as 2 x 4. The steps after it run 4 samples a micro-batch: the
    plan made for 8 recomputes more than they need, so they are profiled and planned for 4 (every block
    kept), and hold what it predicted."""
    from lightning_memopt import OOMBackoff
    from lightning_memopt.testing import OOMInjector

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (8, 16), generator=g) for _ in range(5)]
    torch.manual_seed(0)
    module = GPTModule()
    auto = AutoCheckpoint(max_memory=MAX_MEMORY, headroom=0.0)
    trainer = quiet_trainer([auto, OOMBackoff()], max_steps=len(batches))
    injector = OOMInjector(module.model, max_size=4, steps={1}, step_fn=lambda: trainer.global_step).install()
    with pytest.warns() as caught:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    assert injector.raised == 1  # 8 at step 1
    plans = auto.shape_plans.plans
    assert sorted(shape[-1] for shape in plans) == [(4,), (8,)] and auto.shape_plans.made == 2
    assert auto.plan is plans[((8, 16), (4,))]  # the last steps ran the plan made for their micro-batch
    assert list(plans[((8, 16), (8,))].choices.values()) == ["full", "full", "keep"]
    assert set(plans[((8, 16), (4,))].choices.values()) == {"keep"}
    assert not [w for w in caught if "held" in str(w.message) and "predicted" in str(w.message)]


def test_batches_a_tokenizer_collates_get_a_plan_per_length(tmp_path):
    """Hugging Face's collators return a BatchEncoding (a Mapping, not a dict): its 48-token batches ran the
    plan made for its 16-token ones (the batch's shapes read as none), now each length gets its own."""
    import transformers
    from transformers import BatchEncoding

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    def collate(rows):
        ids = torch.randint(
            0, 128, (8, 16 if rows[0] < 16 else 48), generator=torch.Generator().manual_seed(0)
        )
        return BatchEncoding({"input_ids": ids, "labels": ids.clone()})

    torch.manual_seed(0)
    cb = AutoCheckpoint(max_memory="5MiB")
    trainer = quiet_trainer([cb], max_steps=4, default_root_dir=tmp_path)
    trainer.fit(Module(), DataLoader(list(range(32)), batch_size=8, collate_fn=collate))
    assert cb.shape_plans.made == 2


def _capped_fit(tmp_path, limit: int, lengths: list[int], precision: str = "32-true"):
    """AutoCheckpoint beside AutoAccumulation under ``limit`` bytes of a ``MemoryCap``: batches of 4 samples
    of ``lengths`` tokens. Returns AutoCheckpoint's lines, the cap, the trainer, each micro-batch's shape,
    the callback and the treatments the last micro-step ran."""
    import warnings

    from lightning_memopt import AutoAccumulation
    from lightning_memopt.checkpointing import checkpointed_blocks
    from lightning_memopt.testing import MemoryCap

    class Seen(GPTModule):
        def training_step(self, batch, batch_idx):
            shapes.append(tuple(batch.shape))
            treated[:] = sorted(set(checkpointed_blocks(self.model).values()))
            return super().training_step(batch, batch_idx)

    shapes: list[tuple[int, ...]] = []
    treated: list[str] = []
    torch.manual_seed(0)
    module, auto = Seen(), AutoCheckpoint(max_memory=limit)
    trainer = quiet_trainer(
        [auto, AutoAccumulation(max_memory=limit)],
        max_steps=len(lengths),
        default_root_dir=tmp_path,
        precision=precision,
    )
    with warnings.catch_warnings(record=True) as caught, MemoryCap(limit, modules=module) as cap:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_batches(lengths), batch_size=None))
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
    return said, cap, trainer, shapes, auto, treated


@pytest.mark.parametrize(("precision", "long"), [("32-true", 128), ("bf16-mixed", 192)])
def test_a_later_batch_one_sample_of_which_does_not_fit_kept_recomputes(tmp_path, precision, long):
    """The 8-token batches fit whole without recompute, so the size search decides against it; a batch of
    ``long`` tokens then runs out of memory at one sample: the blocks recompute from then on, each batch
    shape planned for its micro-batches, and the fit ends (before: torch's out-of-memory error)."""
    said, cap, trainer, shapes, auto, _ = _capped_fit(tmp_path, 1_000_000, [8, 8, long, 8], precision)
    assert (
        said[0] == "AutoCheckpoint checkpoints no block of Seen: the whole batch of 4 fits without recompute"
    )
    assert said[1].startswith(
        "AutoCheckpoint recomputes from now on: 1 sample of a batch of 4 ran out of memory with every block "
        f"kept ({long} tokens a sample)"
    )
    assert said[2] == (  # the short batches' plan, one of two: named by the shapes it was made for
        "AutoCheckpoint checkpoints no block of Seen for batches of shapes [(4, 8), (4,)]: the step fits "
        "max_memory=1000000 with every block keeping its activations (no recompute)"
    )
    assert cap.raised >= 1 and trainer.global_step == 4
    assert (1, long) in shapes and shapes[-1] == (4, 8)  # one sample at a time, then the short batch whole
    planned = {sig[0]: set(plan.choices.values()) for plan, (sig, *_) in auto.shape_plans._entries}
    assert planned[(4, long)] - {"keep"}  # the long batch's plan recomputes something
    assert planned[(4, 8)] == {"keep"}  # the short batches' keeps everything, as decided


def test_profiling_out_of_memory_runs_the_blocks_as_the_step_ran_them(tmp_path):
    """At 2 MB one sample of 256 tokens fits only with every block recomputed, and profiling its blocks
    (each treatment of one block beside what the step holds) runs out of memory: one line says so, no plan
    is made, every block stays recomputed and the fit ends (before: torch's out-of-memory error, raised
    from inside the profile)."""
    said, cap, trainer, shapes, auto, treated = _capped_fit(tmp_path, 2_000_000, [8, 8, 256, 8])
    assert said[1].startswith("AutoCheckpoint recomputes from now on: 1 sample of a batch of 4 ran out")
    assert said[2].startswith(
        "AutoCheckpoint: profiling the blocks on the step's micro-batch ran out of memory (OutOfMemoryError: "
    )
    assert said[2].endswith(
        "they run on as this step ran them, unplanned (every block full in mode 'auto': the least memory)"
    )
    assert trainer.global_step == 4 and shapes[-1] == (4, 8) and treated == ["full"]
    assert auto.shape_plans.made == 0 and not auto.plan.predicted and not auto.measuring
