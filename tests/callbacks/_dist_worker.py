"""One rank of a 2-process CPU gloo run of AutoCheckpoint (started by test_auto_checkpoint_distributed.py).

Started by ``tests.distributed.run_ranks("tests.callbacks._dist_worker:main", OUT_DIR)``. For DDP, then ModelParallelStrategy (FSDP2), runs the same training
twice in this process, with and without AutoCheckpoint, and saves both final parameter vectors and the
plan for the test to compare. One launch for both strategies: process start-up dominates the test's time.
"""

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_memopt import AutoAccumulation, AutoCheckpoint, OOMBackoff
from lightning_memopt.checkpointing import apply_checkpointing, policy
from lightning_memopt.testing import OOMInjector
from tests.callbacks.test_auto_checkpoint import GPTModule
from tests.checkpointing.clocks import WorkClock
from tests.checkpointing.models import TinyGPT


class Module(GPTModule):
    """test_auto_checkpoint's module, with dropout, built and optionally sharded in configure_model."""

    def __init__(self, shard: bool, checkpoint_first: bool = False, h: int = 16) -> None:
        super().__init__(n_samples=16)
        self.shard, self.checkpoint_first, self.h = shard, checkpoint_first, h

    def configure_model(self):
        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = TinyGPT(3, h=self.h, dropout=0.1)
        if self.checkpoint_first:  # torchtitan's order: AC, then FSDP
            apply_checkpointing(self.model, {"h.0": "selective", "h.1": "full", "h.2": "offload"})
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.h:
                fully_shard(block, mesh=mesh)  # sharded BEFORE AutoCheckpoint installs (the harder order)
            fully_shard(self.model, mesh=mesh)


def run(kind: str, callbacks, checkpoint_first: bool = False, h: int = 16) -> tuple[torch.Tensor, list, dict]:
    strategy = (
        DDPStrategy(process_group_backend="gloo")
        if kind == "ddp"
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    )
    module = Module(shard=kind == "fsdp2", checkpoint_first=checkpoint_first, h=h)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(1)  # the same dropout masks in both runs
    trainer.fit(module)
    params = []
    for p in module.model.parameters():
        p = p.detach()
        params.append((p.full_tensor() if hasattr(p, "full_tensor") else p).flatten())
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    return torch.cat(params), module.seen_choices, metrics


class InjectOOM(pl.Callback):
    """Rank 1 runs out of memory in the backward of the checkpointed, sharded block ``h.1`` whenever a
    micro-batch holds more than one sample (installed at fit start: the model is built in configure_model)."""

    def __init__(self) -> None:
        self.injector = None

    def on_fit_start(self, trainer, pl_module):
        self.injector = OOMInjector(pl_module.model.h[1], phase="backward", max_size=1, ranks={1}).install()

    def teardown(self, trainer, pl_module, stage):
        self.injector.remove()


def _fit_deciding(
    module: pl.LightningModule, limit: int, *more: pl.Callback
) -> tuple[AutoCheckpoint, AutoAccumulation]:
    """Nine DDP steps of ``module`` with AutoCheckpoint beside AutoAccumulation under ``limit`` bytes (no
    headroom), and ``more`` callbacks: the first batch's search and its trial steps decide, a plan runs;
    returns the two callbacks."""
    accumulation = AutoAccumulation(max_memory=limit, headroom=0.0)
    cb = AutoCheckpoint(max_memory=limit, headroom=0.0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=9,
        callbacks=[cb, accumulation, *more],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return cb, accumulation


def decide_with_rank_timings(rank: int) -> dict:
    """AutoCheckpoint beside AutoAccumulation under DDP, each rank timing its trial steps differently (rank
    1 pays a launch cost per micro-step, rank 0 none): the ranks must take one decision (sizes agreed as
    the smallest, seconds as the longest over ranks), not hang, and train the same plan."""
    from lightning_memopt.checkpointing import checkpointed_blocks
    from tests.callbacks.test_auto_checkpoint import GPTModule, _price_steps, _Wide

    def price(module, samples):
        full = set(checkpointed_blocks(module.model).values()) - {"keep"}
        return "", (100.0 if rank == 1 else 0.0) + samples * (1.3 if full else 1.0)

    with pytest.MonkeyPatch.context() as patch:
        _price_steps(patch, GPTModule, price)
        module = _Wide(n_layer=4)
        cb, accumulation = _fit_deciding(module, 1_500_000)
    sizes = accumulation.engine.sizes
    return {
        "size": accumulation.micro_batch_size,
        "seconds": sizes.step_seconds,
        "choices": cb.plan.choices,
        "seen": module.seen_choices[-1],
    }


def decide_with_rank_probe_timings(rank: int) -> dict:
    """The search's timed probes under DDP: rank 0's micro-steps cost their samples alone (recompute cannot
    pay there: alone it would not search, profile nor try it), rank 1's pay a launch cost each. Agreed as
    the longest over ranks, they rule recompute out on neither rank: both search it and run the trial (its
    collectives), not one waiting for the other, and take one decision."""
    from lightning_memopt.batching.probe import BatchProbes
    from tests.callbacks.test_auto_checkpoint import GPTModule, _price_steps, _Wide

    peak = BatchProbes.peak

    def priced(self, samples, evaluation=False):
        result = peak(self, samples, evaluation)
        if result is not None:
            self.seconds = (100.0 if rank == 1 else 0.0) + samples
        return result

    def price(module, samples):
        return "", (100.0 if rank == 1 else 0.0) + samples

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchProbes, "peak", priced)
        _price_steps(patch, GPTModule, price)
        module = _Wide(n_layer=4)
        _, accumulation = _fit_deciding(module, 2_500_000)  # 5 samples fit kept: 4 probes
    return {"probes": accumulation.probes, "size": accumulation.micro_batch_size}


def _kept_out_of_memory_on_rank_1(rank: int, step: int, launch: float):
    """A DDP fit of ``_Wide`` deciding under 1.5 MB (AutoCheckpoint, AutoAccumulation, OOMBackoff), each
    micro-step priced ``launch + samples`` (+30% recomputed); in optimizer step ``step`` rank 1 alone runs
    out of memory at every size with every block kept (as a longer batch would). Returns the two callbacks,
    the module, the (step, samples) that ran out of memory and the treatments of each step's last micro-step."""
    from lightning_memopt.checkpointing import checkpointed_blocks
    from tests.callbacks.test_auto_checkpoint import GPTModule, _price_steps, _Wide

    kept, treated = [], {}

    def price(module, samples):
        blocks = set(checkpointed_blocks(module.model).values())
        treated[module.trainer.global_step] = sorted(blocks)
        if rank == 1 and blocks == {"keep"} and module.trainer.global_step == step:
            kept.append((module.trainer.global_step, samples))
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1, every block kept)")
        return "", launch + samples * (1.3 if blocks - {"keep"} else 1.0)

    with pytest.MonkeyPatch.context() as patch:
        _price_steps(patch, GPTModule, price)
        module = _Wide(n_layer=4)
        cb, accumulation = _fit_deciding(module, 1_500_000, OOMBackoff())
    return cb, accumulation, module, kept, treated


def decide_with_a_rank_out_of_memory_in_the_trial(rank: int) -> dict:
    """Rank 1 alone runs out of memory at every micro-batch size in the kept way's trial step (a batch
    longer than the first would): at one sample it cannot run the step, rank 0 could. Both end the trial
    together and recompute, agreed before the retry: no rank waits in a collective the other skips."""
    cb, accumulation, module, kept, _ = _kept_out_of_memory_on_rank_1(rank, step=1, launch=100.0)
    return {
        "failed": kept,
        "size": accumulation.micro_batch_size,
        "choices": cb.plan.choices,
        "seen": [module.seen_choices[i] for i in (0, -1)],
    }


def fall_back_with_a_rank_out_of_memory_after_the_decision(rank: int) -> dict:
    """Plain micro-batches win the trial; at step 7 rank 1 alone runs out of memory at every size with every
    block kept: at one sample both ranks recompute from then on, and profile and plan that step together
    (their collectives match): no hang, the same plans on both."""
    cb, _, module, kept, treated = _kept_out_of_memory_on_rank_1(rank, step=7, launch=0.0)
    return {
        "failed": kept,
        "per_shape": cb._by_shape,
        "plans": cb.shape_plans.made,
        "choices": cb.plan.choices,
        "treated": treated,
        "steps": module.trainer.global_step,
    }


def profile_out_of_memory_on_rank_1(rank: int, kind: str) -> dict:
    """AutoCheckpoint under a limit, the first block's profile out of memory on rank 1 alone: both ranks
    make no plan and run every block as the step ran them (full). Under FSDP2 rank 1 still gathers every
    later block with rank 0 before it says so; the gather of what they measured is their one agreement: no
    hang."""
    import lightning_memopt.checkpointing.profile as profile_module

    original = profile_module._profile_block

    def profile_block(*args, **kwargs):
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1, profiling)")
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "_profile_block", profile_block)
        cb = AutoCheckpoint(max_memory=150_000, headroom=0.0)
        _, seen, _ = run(kind, [cb])
    return {"choices": cb.plan.choices, "predicted": cb.plan.predicted, "seen": seen[-1]}


def decide_head_with_rank_timings(rank: int) -> dict:
    """The output head in the decision under DDP: a tiny Hugging Face GPT-2 whose logits outweigh its
    blocks; rank 1 pays a launch cost per micro-step (the chunked head's larger micro-batches win there),
    rank 0 none (the own head would): one decision on both ranks, no hang, the same head trained."""
    from lightning_memopt.checkpointing.auto import AutoCheckpointer
    from tests.callbacks.test_auto_checkpoint import _HFLM, _price_steps

    using, use = [], AutoCheckpointer.use
    cost = {"own head": 1.0, "keep": 1.2, "full": 1.4}

    def price(module, samples):
        return using[-1], (100.0 if rank == 1 else 0.0) + samples * cost[using[-1]]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoCheckpointer, "use", lambda self, t: using.append(t) or use(self, t))
        _price_steps(patch, _HFLM, price)
        module = _HFLM()
        cb, accumulation = _fit_deciding(module, 9_000_000)
    return {
        "size": accumulation.micro_batch_size,
        "seconds": accumulation.engine.sizes.step_seconds,
        "own_head": cb.state()["own_head"],
        "heads": module.heads[-2:],
    }


def main(out: str) -> None:
    # Plans priced in seconds: time counted as work (tests/conftest.py does it in the tests' own process),
    # so that the budgeted plan asserted is the same on every run.
    policy.step_clock = lambda device: WorkClock()
    rank = int(os.environ["RANK"])
    for kind in ("ddp", "fsdp2"):
        plain, _, _ = run(kind, [])
        cb = AutoCheckpoint()
        checkpointed, seen, _ = run(kind, [cb])
        result = {"plain": plain, "checkpointed": checkpointed}
        result["unprofiled"] = profile_out_of_memory_on_rank_1(rank, kind)
        if kind == "ddp":
            result["decided"] = decide_with_rank_timings(rank)
            result["probe_decided"] = decide_with_rank_probe_timings(rank)
            result["head_decided"] = decide_head_with_rank_timings(rank)
            result["oom_decided"] = decide_with_a_rank_out_of_memory_in_the_trial(rank)
            result["fell_back"] = fall_back_with_a_rank_out_of_memory_after_the_decision(rank)
        if kind == "fsdp2":
            result["checkpoint_first"], result["seen_first"], _ = run(kind, [], checkpoint_first=True)
            # A limit between all-full and all-kept: the sharded blocks are profiled and planned for.
            budgeted = AutoCheckpoint(max_memory=150_000, headroom=0.0)
            result["budgeted"], result["seen_budgeted"], metrics = run(kind, [budgeted])
            result["budgeted_plan"] = budgeted.plan.choices
            # The pointwise treatment in blocks sharded in configure_model: norms recomputed as modules,
            # their parameters gathered again by FSDP before the block's backward reruns them.
            result["pointwise"], result["seen_pointwise"], _ = run(kind, [AutoCheckpoint(mode="pointwise")])
            # At width 8 the LayerNorms run again with grad (their mean and rstd are a quarter of their
            # output): the rerun reads the parameters FSDP gathers for the block's backward.
            result["plain_h8"] = run(kind, [], h=8)[0]
            result["pointwise_rerun"] = run(kind, [AutoCheckpoint(mode="pointwise")], h=8)[0]
            result["budgeted_bytes"] = (
                budgeted.plan.activation_bytes,
                metrics["checkpoint/activation_bytes_predicted"],
                metrics["checkpoint/activation_bytes_measured"],
            )
            # OOMBackoff with activation checkpointing inside sharded blocks: rank 1's backward OOM (at 4
            # and 2 samples) makes both ranks back off to 1, the same training as size 1 from the start
            inject, backoff = InjectOOM(), OOMBackoff()
            result["backed_off"], _, _ = run(kind, [inject, backoff], checkpoint_first=True)
            result["size_one"], _, _ = run(
                kind, [AutoAccumulation(micro_batch_size=1), OOMBackoff()], checkpoint_first=True
            )
            result["backoff"] = [
                backoff.micro_batch_size,
                backoff.engine.sizes.oom_retries,
                inject.injector.raised,
            ]
        torch.save(result, os.path.join(out, f"{kind}_params{rank}.pt"))
        with open(os.path.join(out, f"{kind}_plan{rank}.json"), "w") as f:
            json.dump({"seen": seen, "choices": cb.plan.choices, "predicted": cb.plan.predicted}, f)
