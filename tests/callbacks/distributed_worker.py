"""One rank of the 2-process CPU tests (run by tests/callbacks/test_distributed.py, not by pytest).

Started by ``tests.distributed.run_ranks("tests.callbacks.distributed_worker:main", OUT, "STRATEGY:PHASE", ...)``. Importing Lightning takes most of a worker's time, so one launch runs
several fits, one after another in the same process group, and writes OUT/<strategy>-<phase>-rank<r>.json.
"""

from __future__ import annotations

import json
import os

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, DistributedSampler

import lightning_memopt.batching.distributed as distributed
from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.testing import OOMInjector
from tests.batching.helpers import Net, dataset, quiet_trainer
from tests.distributed import full_params, run_each


class ShardedNet(Net):
    """Net with its layers sharded by FSDP2 (``fully_shard``) in ``configure_model``."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=self.device_mesh)
        fully_shard(self, mesh=self.device_mesh)


CLIP = 0.1  # gradient_clip_val of the "stepclip" runs (the gradients' norm is above it in both steps)


class CountCollectives(Callback):
    """The engine's small all-reduces (``any_rank`` and sync points) per training step, optimizer step
    included (it runs between ``on_train_batch_start`` and ``on_train_batch_end``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.per_step: list[int] = []
        self._start = 0
        original = distributed._all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        distributed._all_reduce = counted  # every small collective looks it up in the module at each call
        self._restore = lambda: setattr(distributed, "_all_reduce", original)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self.calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_step.append(self.calls - self._start)

    def teardown(self, trainer, pl_module, stage):
        self._restore()


class RootShardedNet(Net):
    """Net as one FSDP2 unit (``fully_shard`` on the root only): an OOM inside its backward stops it after
    other layers' gradients were computed and before any reduce-scatter."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=self.device_mesh)


def run(strategy_name: str, phase: str, out: str) -> None:
    model = {"fsdp2": ShardedNet, "fsdp2root": RootShardedNet}.get(strategy_name, Net)()
    injector = None
    if phase not in ("none", "plain", "probe"):  # rank 1 only runs out of memory, in the last layer
        # "step": the optimizer step; "stepclip": the same with gradient clipping (a collective under FSDP2)
        where = {"overlap": "forward", "validation": "forward", "stepclip": "step"}.get(phase, phase)
        # "validation": in the first layer, so rank 0 goes on to the last layer's all-gather; in training too
        layer = model.net[0] if phase == "validation" else model.net[-1]
        injector = OOMInjector(
            layer, phase=where, max_size=4, ranks={1}, training_only=phase != "validation"
        ).install()
    if strategy_name.startswith("fsdp2"):
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    if phase == "probe":  # rank 1 has less memory: both ranks must use its size
        callback = AutoAccumulation(max_memory=2900 if int(os.environ["RANK"]) == 1 else 10**6, headroom=0.0)
    elif phase == "overlap":  # step 1 backs off to 3 (k=4); step 2 overlaps the last micro-batch's sync
        callback = OOMBackoff(overlap_after=1)
    else:
        callback = OOMBackoff()
    val_sizes: list[int] = []  # samples of each validation forward, as the first layer sees them
    model.net[0].register_forward_pre_hook(
        lambda m, args: None if m.training else val_sizes.append(len(args[0]))
    )
    counter = CountCollectives()
    trainer = quiet_trainer(
        [counter] if phase == "plain" else [callback, counter],
        devices=2,
        strategy=strategy,
        max_steps=2,
        use_distributed_sampler=False,
        limit_val_batches=1 if phase == "validation" else 0,
        gradient_clip_val=CLIP if phase == "stepclip" else None,
    )
    # rank r gets samples r, r + 2, ...: a step's two batches of 10 are the first 20 samples
    sampler = DistributedSampler(dataset(), num_replicas=2, rank=trainer.global_rank, shuffle=False)
    loader = DataLoader(dataset(), batch_size=10, sampler=sampler)
    trainer.fit(model, loader, loader if phase == "validation" else None)
    validation = {}
    if phase == "validation":  # the loss validation logged, and the same batch through the trained model
        injector.remove()
        x, y = next(iter(loader))
        with torch.no_grad():
            expected = torch.nn.functional.mse_loss(model(x), y)
        validation = {"logged": float(trainer.callback_metrics["val_loss"]), "expected": float(expected)}
    params = full_params(model)
    result = {
        "rank": trainer.global_rank,
        "micro_batch_size": callback.micro_batch_size,
        "oom_retries": callback.engine.sizes.oom_retries if callback.engine else 0,
        "eval_micro_batch_size": callback.engine.sizes.eval_size if callback.engine else None,
        "eval_oom_retries": callback.engine.sizes.eval_oom_retries if callback.engine else 0,
        "raised": injector.raised if injector is not None else 0,
        "probes": getattr(callback, "probes", []),
        "overlapped": callback.engine.last_regime in ("overlapped", "unagreed"),
        "collectives": counter.per_step,
        "validation": validation,
        "val_sizes": val_sizes,
        "params": params,
        "losses": model.step_losses,
    }
    with open(out, "w") as f:
        json.dump(result, f)


def main(out_dir: str, *runs: str) -> None:
    run_each(out_dir, runs, run)
