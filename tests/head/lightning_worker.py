"""One rank of a 2-process gloo run of AutoCheckpoint's chunked head in Lightning (started by
test_fsdp_head.py): a tiny float64 Hugging Face GPT-2 trained 2 SGD steps under DDP and under
ModelParallelStrategy (FSDP2, blocks then the root sharded in configure_model), with head="keep" and with
the default head="auto"; the initial and final parameters and whether each step's output had logits."""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_memopt import AutoCheckpoint


class GPT2Module(pl.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.shard, self.model, self.had_logits = shard, None, []

    def configure_model(self):
        if self.model is not None:
            return
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=50,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = transformers.GPT2LMHeadModel(config).double()
        self.initial = torch.cat([p.detach().flatten().clone() for p in self.model.parameters()])
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch, labels=batch)
        self.had_logits.append("logits" in out)
        return out.loss

    def train_dataloader(self):
        ids = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(ids, batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run(kind: str, head: str) -> dict:
    strategy = (
        DDPStrategy(process_group_backend="gloo")
        if kind == "ddp"
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    )
    module = GPT2Module(shard=kind == "fsdp2")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        callbacks=[AutoCheckpoint(head=head)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    final = [p.detach() for p in module.model.parameters()]
    final = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).flatten() for p in final])
    return {"initial": module.initial, "final": final, "had_logits": module.had_logits}


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    result = {f"{kind}-{head}": run(kind, head) for kind in ("ddp", "fsdp2") for head in ("keep", "auto")}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
