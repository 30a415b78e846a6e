"""One rank of the DDP fit with MaxTokensBatchSampler (launched by tests/data/test_token_batching.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch.utils.data import DataLoader

from lightning_memopt.data.token_batching import MaxTokensBatchSampler, pad_collate
from tests.batching.helpers import quiet_trainer
from tests.data.corpus import long_tailed_lengths, token_sequences

LENGTHS = long_tailed_lengths(64, low=2, high=40, median=8, seed=2)


def main(out: str) -> None:
    from tests.data.test_token_batching import TinyLM

    class Module(TinyLM):
        def train_dataloader(self):
            # Created after Lightning joined the process group: rank and world size come from it.
            self.sampler = MaxTokensBatchSampler(LENGTHS, 96, seed=1)
            data = [t % 32 for t in token_sequences(LENGTHS, vocab=32, seed=2)]
            return DataLoader(data, batch_sampler=self.sampler, collate_fn=pad_collate())

    module = Module()
    trainer = quiet_trainer([], devices=2, strategy="ddp", max_epochs=2, use_distributed_sampler=False)
    trainer.fit(module)
    rank = int(os.environ["RANK"])
    sampler = module.sampler
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    result = {
        "num_replicas": sampler.num_replicas,
        "rank": sampler.rank,
        "shapes": [list(s) for s in module.shapes],
        "batches": epochs,
        "weight": module.head.weight.flatten().tolist(),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
