"""One rank of the 2-process per-batch sizing test (run by tests/batching/test_shape_model.py, not by pytest).

Each rank trains the float64 attention model on its own variable-length batches (rank 1's are longer),
plainly or with ``AutoAccumulation(max_memory=...) + OOMBackoff``, under DDP or FSDP2, and writes
OUT/<strategy>-<mode>-rank<r>.json: micro-batches and sizes per step, the small collectives per step,
the probes, and the parameters after training.
"""

from __future__ import annotations

import json
import os

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader

import lightning_memopt.batching.distributed as distributed
from lightning_memopt import AutoAccumulation, OOMBackoff
from tests.batching.helpers import quiet_trainer
from tests.batching.test_shape_model import LENGTHS_BY_RANK, AttentionLM, lm_batch
from tests.distributed import full_params, run_each

# Each rank's padded lengths, step by step: the ranks' batches differ in length at every step.
LENGTHS = LENGTHS_BY_RANK
CAPACITY = 7_400_000  # bytes: about a whole batch of 64 tokens, as in the one-process test


class ShardedAttentionLM(AttentionLM):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for layer in (self.embed, self.qkv, self.head):
            fully_shard(layer, mesh=self.device_mesh)
        fully_shard(self, mesh=self.device_mesh)


class Steps(Callback):
    """Per step: micro-batches, samples per micro-batch, and the engine's small collectives."""

    def __init__(self, sized) -> None:
        self.sized = sized
        self.counts, self.sizes, self.collectives = [], [], []
        self.calls = 0
        original = distributed._all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        distributed._all_reduce = counted
        self._restore = lambda: setattr(distributed, "_all_reduce", original)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self.calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = self.sized.engine if self.sized else None
        self.counts.append(engine.num_micro_batches if engine else 1)
        self.sizes.append(engine.sizes.micro_batch_size if engine else None)
        self.collectives.append(self.calls - self._start)

    def teardown(self, trainer, pl_module, stage):
        self._restore()


def run(strategy_name: str, mode: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    model = ShardedAttentionLM() if strategy_name == "fsdp2" else AttentionLM()
    if strategy_name == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    callbacks = (
        [AutoAccumulation(max_memory=CAPACITY, headroom=0.05), OOMBackoff()]
        if mode.startswith("sized")
        else []
    )
    steps = Steps(callbacks[0] if callbacks else None)
    trainer = quiet_trainer(
        [*callbacks, steps],
        devices=2,
        strategy=strategy,
        max_steps=len(LENGTHS[rank]),
        use_distributed_sampler=False,
    )
    batches = [lm_batch(t, 10 * rank + i) for i, t in enumerate(LENGTHS[rank])]
    if mode.endswith("uneven") and rank == 0:  # 2 samples: fewer than the micro-batches rank 1 needs
        batches = [{k: v[:2] for k, v in b.items()} for b in batches]
    trainer.fit(model, DataLoader(batches, batch_size=None))
    params = full_params(model)
    engine = callbacks[0].engine if callbacks else None
    result = {
        "counts": steps.counts,
        "sizes": steps.sizes,
        "collectives": steps.collectives,
        "probes": callbacks[0].probes if callbacks else [],
        "shape_probes": engine.sizes.shape_probes if engine else [],
        "oom_retries": engine.sizes.oom_retries if engine else 0,
        "params": params,
    }
    with open(out, "w") as f:
        json.dump(result, f)


def main(out_dir: str, *runs: str) -> None:
    run_each(out_dir, runs, run)
