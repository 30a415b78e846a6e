"""One rank of a 2-process CPU gloo run of AutoCheckpoint under a limit, each rank with its own batch shapes.

Started by ``tests.distributed.run_ranks("tests.callbacks._dist_shapes_worker:main", OUT_DIR)`` from
test_auto_checkpoint_ranks.py. Variable-length data as a DataLoader without a distributed sampler gives it:
each rank's batch is padded to its own longest sequence, so the ranks' shapes differ step by step. For DDP,
then ModelParallelStrategy (FSDP2, every block and the root ``fully_shard``-ed), trains in float64 without
AutoCheckpoint, with it under a limit, and with it and ``OOMBackoff`` while rank 1 runs out of memory in a
checkpointed block's backward; saves, per run, the parameters and per step the shapes, the plan ran and the
bytes the blocks held (``ActivationMeter``, independent of AutoCheckpoint's own probe).
"""

import contextlib
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_memopt import AutoCheckpoint, OOMBackoff
from lightning_memopt.checkpointing import ActivationMeter, checkpointed_blocks, find_blocks, policy
from lightning_memopt.testing import OOMInjector
from tests.checkpointing.clocks import WorkClock
from tests.checkpointing.models import TinyGPT

# Tokens per sample, per rank and step (4 samples a batch). Step 1: only rank 1 sees a new, longer shape;
# step 4: rank 0 gets 24 tokens, which only rank 1 has run (step 3): the plan made then covers it.
LENGTHS = {0: [8, 8, 16, 8, 24, 12], 1: [8, 16, 12, 24, 8, 24]}
# In float64 the blocks keep 2 x the bytes of test_auto_checkpoint_shapes' fp32 model: all kept fit at 8
# tokens, not at 16 or 24 (DDP: whole states; FSDP2: half of them per rank, so a lower limit).
MAX_MEMORY = {"ddp": 610_000, "fsdp2": 570_000}


class Module(pl.LightningModule):
    """TinyGPT in float64, built (and for FSDP2 sharded, blocks then root) in configure_model."""

    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.shard = shard
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = TinyGPT(3).double()
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Steps(pl.Callback):
    """Per step: the batch shape, the choices the blocks ran, the bytes they held at the end of the
    forward (under OOMBackoff: the last micro-batch's), and the plan's max_bytes and predicted bytes."""

    def __init__(self, auto: AutoCheckpoint | None) -> None:
        self.auto = auto
        self.rows: list[dict] = []
        self._meter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._ran = checkpointed_blocks(pl_module)  # AutoCheckpoint's own hook ran before: this step's plan
        self._meter = ActivationMeter(pl_module, find_blocks(pl_module)).__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self._meter.__exit__(None, None, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = self.auto.plan if self.auto is not None else None
        self.rows.append(
            {
                "shape": list(batch.shape),
                "ran": self._ran,
                "held": self._meter.total,
                # After a step that profiled: the plan made on it; else the plan it ran.
                "max_bytes": plan.max_bytes if plan is not None else None,
                "predicted": plan.activation_bytes if plan is not None else None,
                "plans_made": self.auto.shape_plans.made if self.auto is not None else 0,
            }
        )


class InjectOOM(pl.Callback):
    """Rank 1 runs out of memory in the backward of block ``h.2`` (checkpointed there: recomputed in that
    backward) at step 3, its first 24-token batch, while a micro-batch holds more than 2 samples."""

    def __init__(self) -> None:
        self.injector = None

    def on_fit_start(self, trainer, pl_module):
        self.injector = OOMInjector(
            pl_module.model.h[2],
            phase="backward",
            max_size=2,
            ranks={1},
            steps={3},
            step_fn=lambda: trainer.global_step,
        ).install()

    def teardown(self, trainer, pl_module, stage):
        self.injector.remove()


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
)


@contextlib.contextmanager
def recorded_collectives():
    """Every collective called through ``torch.distributed`` (FSDP2's, Lightning's, the package's), in
    order, as (name, elements). DDP's gradient all-reduces run in its C++ reducer and are not seen."""
    calls: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counted(name, fn):
        def call(*args, **kwargs):
            first = args[0] if args else None
            calls.append((name, first.numel() if isinstance(first, torch.Tensor) else -1))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def run(kind: str, callbacks, lengths=LENGTHS) -> tuple[torch.Tensor, list[tuple[str, int]]]:
    rank = int(os.environ["RANK"])
    strategy = (
        DDPStrategy(process_group_backend="gloo")
        if kind == "ddp"
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    )
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 32, (4, t), generator=g) for t in lengths[rank]]
    module = Module(shard=kind == "fsdp2")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=len(batches),
        callbacks=callbacks,
        use_distributed_sampler=False,  # each rank its own batches: its own shapes
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with recorded_collectives() as calls:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    params = []
    for p in module.model.parameters():
        p = p.detach()
        params.append((p.full_tensor() if hasattr(p, "full_tensor") else p).flatten())
    return torch.cat(params), calls


def main(out: str) -> None:
    # Plans priced in seconds: time counted as work (as tests/conftest.py does in the tests' own process),
    # so that the plans asserted are the same on every run.
    policy.step_clock = lambda device: WorkClock()
    rank = int(os.environ["RANK"])
    result = {}
    for kind in ("ddp", "fsdp2"):
        plain, plain_calls = run(kind, [])
        auto = AutoCheckpoint(max_memory=MAX_MEMORY[kind], headroom=0.0)
        steps = Steps(auto)
        params, calls = run(kind, [auto, steps])
        both = AutoCheckpoint(max_memory=MAX_MEMORY[kind], headroom=0.0)
        inject, backoff, both_steps = InjectOOM(), OOMBackoff(), Steps(both)
        backed_off, backoff_calls = run(kind, [both, inject, backoff, both_steps])
        result[kind] = {
            "plain": plain,
            "plain_collectives": plain_calls,
            "auto": params,
            "auto_steps": steps.rows,
            "auto_collectives": calls,
            "auto_plans": auto.shape_plans.state(),
            "backoff": backed_off,
            "backoff_steps": both_steps.rows,
            "backoff_plans": both.shape_plans.state(),
            "backoff_collectives": backoff_calls,
            "backoff_state": [
                backoff.micro_batch_size,
                backoff.engine.sizes.oom_retries,
                inject.injector.raised,
            ],
        }
    # Last (a failed fit leaves the process group as it is): at step 1 only rank 1's batch is too long for
    # any plan. Every rank plans on the same figures, so every rank raises, and none waits for the other.
    try:
        run(
            "ddp",
            [AutoCheckpoint(max_memory=MAX_MEMORY["ddp"], headroom=0.0)],
            lengths={0: [8, 8, 8], 1: [8, 64, 8]},
        )
    except MisconfigurationException as err:
        result["infeasible"] = str(err)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
