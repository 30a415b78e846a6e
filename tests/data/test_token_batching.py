from __future__ import annotations

import collections
import itertools
import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_memopt import AutoAccumulation
from lightning_memopt.data.token_batching import MaxTokensBatchSampler, pad_collate, padding_tokens
from tests.data.corpus import long_tailed_lengths, random_batches, token_sequences

LENGTHS = long_tailed_lengths(1000, seed=1)


def _sampler(**kwargs) -> MaxTokensBatchSampler:
    kwargs.setdefault("max_tokens", 4096)
    kwargs.setdefault("bucket_size", 256)
    return MaxTokensBatchSampler(LENGTHS, **kwargs)


def test_example_batches_and_bound():
    sampler = MaxTokensBatchSampler([5, 60, 7, 64, 6, 8], max_tokens=128, shuffle=False)
    assert list(sampler) == [[0, 4, 2, 5], [1, 3]]
    assert len(sampler) == 2
    # 127 tokens: the two long samples no longer fit together (2 x 64 = 128 > 127)
    assert list(MaxTokensBatchSampler([5, 60, 7, 64, 6, 8], 127, shuffle=False)) == [[0, 4, 2, 5], [1], [3]]


def test_token_bound_holds_on_every_batch_and_batches_are_full():
    sampler = _sampler()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        for batch in batches:
            assert len(batch) * max(LENGTHS[i] for i in batch) <= 4096
    # the budget, not a sample count, decides: short samples come many to a batch, long ones few
    sizes = {max(LENGTHS[i] for i in b): len(b) for b in batches}
    assert sizes[min(sizes)] > 50 and sizes[max(sizes)] <= 2


def test_same_seed_same_batches_other_epoch_or_seed_differs():
    a, b = _sampler(seed=3), _sampler(seed=3)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert list(_sampler(seed=4)) != first
    a.set_epoch(0)
    assert list(a) == first


def test_every_index_once_per_epoch_single_rank():
    for bucket_size in (1, 7, 256, None):
        counts = collections.Counter(i for b in _sampler(bucket_size=bucket_size) for i in b)
        assert sorted(counts) == list(range(len(LENGTHS))) and set(counts.values()) == {1}


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_ranks_get_equal_batch_counts_and_cover_the_epoch(num_replicas, drop_last):
    every = _sampler()._epoch_batches()
    per_rank = [
        list(_sampler(num_replicas=num_replicas, rank=r, drop_last=drop_last)) for r in range(num_replicas)
    ]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1
    (count,) = counts
    if drop_last:
        assert count == len(every) // num_replicas
        kept = every[: count * num_replicas]
    else:
        assert count == -(-len(every) // num_replicas)
        kept = every + every[: count * num_replicas - len(every)]  # the first batches, repeated
    seen = collections.Counter(i for batches in per_rank for b in batches for i in b)
    assert seen == collections.Counter(i for b in kept for i in b)
    # no rank repeats a batch of another, beyond the padding round
    assert sorted(map(tuple, itertools.chain(*per_rank))) == sorted(map(tuple, kept))
    if not drop_last and len(every) % num_replicas == 0:
        assert set(seen.values()) == {1}


def test_rank_and_world_size_default_from_torch_distributed(monkeypatch):
    assert (_sampler().num_replicas, _sampler().rank) == (1, 0)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 2)
    sampler = _sampler()
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    assert list(sampler) == list(_sampler(num_replicas=4, rank=2))


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_resume_mid_epoch_equals_uninterrupted(num_replicas):
    reference = _sampler(num_replicas=num_replicas, rank=num_replicas - 1)
    reference.set_epoch(2)
    full = list(reference)
    interrupted = _sampler(num_replicas=num_replicas, rank=num_replicas - 1)
    interrupted.set_epoch(2)
    iterator = iter(interrupted)
    head = [next(iterator) for _ in range(5)]
    state = interrupted.state_dict()
    assert state == {"seed": 0, "epoch": 2, "batches_done": 5}

    resumed = _sampler(num_replicas=num_replicas, rank=num_replicas - 1)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # what Lightning does at the epoch's start keeps the position
    assert head + list(resumed) == full
    assert len(resumed) == len(full)
    # the next epoch starts at its beginning, as in the uninterrupted run
    resumed.set_epoch(3)
    reference.set_epoch(3)
    assert list(resumed) == list(reference)


def test_oversized_sample_gets_its_own_batch_with_one_warning():
    with pytest.warns(UserWarning, match=r"1 sample\(s\) are longer than max_tokens=100 \(the longest: 300"):
        sampler = MaxTokensBatchSampler([10, 300, 20, 30], 100, shuffle=False)
    assert list(sampler) == [[0, 2, 3], [1]]


def test_padding_much_lower_than_random_batching():
    sampler = _sampler(max_tokens=8192, bucket_size=None)
    batches = list(sampler)
    padding, padded = padding_tokens(batches, LENGTHS)
    # random batching over as many batches (the same number of steps)
    random_padding, _ = padding_tokens(
        random_batches(len(LENGTHS), round(len(LENGTHS) / len(batches))), LENGTHS
    )
    assert padded - padding == sum(LENGTHS)
    assert random_padding / padding >= 3
    # sorting in chunks pads more than sorting everything, and still far less than random batching
    chunked, _ = padding_tokens(list(_sampler(max_tokens=8192, bucket_size=128)), LENGTHS)
    assert padding <= chunked and random_padding / chunked >= 3


def test_padding_tokens_counts():
    assert padding_tokens([[0, 1], [2]], [3, 5, 4]) == (2, 14)


def test_pad_collate_hf_convention():
    collate = pad_collate(pad_value=7, label_pad=-1)
    batch = collate([{"input_ids": [1, 2, 3], "labels": [4, 5, 6]}, torch.tensor([9])])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [9, 7, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[4, 5, 6], [9, -1, -1]]
    assert {t.dtype for t in batch.values()} == {torch.long}


def test_pad_collate_bad_samples():
    with pytest.raises(ValueError, match="labels of the same length"):
        pad_collate()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="empty batch"):
        pad_collate()([])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_tokens": 0}, ValueError, r"max_tokens must be a positive int .* got 0"),
        ({"max_tokens": 2.5}, ValueError, r"max_tokens must be a positive int .* got 2.5"),
        ({"lengths": []}, ValueError, "lengths is empty"),
        ({"lengths": [3, 0]}, ValueError, r"lengths\[1\] must be >= 1 token, got 0"),
        ({"lengths": [3, 2.5]}, TypeError, r"lengths\[1\] must be an int \(a token count\), got 2.5"),
        ({"lengths": [3, "4"]}, TypeError, r"lengths\[1\] must be an int"),
        ({"lengths": torch.ones(3)}, TypeError, "1-D integer tensor"),
        ({"lengths": "abc"}, TypeError, "sequence of ints"),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"rank must be an int in \[0, num_replicas=2\), got 2"),
        (
            {"num_replicas": 2, "rank": -1},
            ValueError,
            r"rank must be an int in \[0, num_replicas=2\), got -1",
        ),
        ({"num_replicas": 0}, ValueError, "num_replicas must be a positive int"),
        ({"bucket_size": 0}, ValueError, "bucket_size must be a positive int"),
        ({"seed": 1.0}, TypeError, "seed must be an int"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"lengths": [3, 4], "max_tokens": 8, **kwargs}
    with pytest.raises(error, match=match):
        MaxTokensBatchSampler(kwargs.pop("lengths"), kwargs.pop("max_tokens"), **kwargs)


def test_lengths_as_tensor_or_numpy_ints():
    np = pytest.importorskip("numpy")
    expected = list(MaxTokensBatchSampler([3, 9, 4], 12, shuffle=False))
    assert list(MaxTokensBatchSampler(torch.tensor([3, 9, 4]), 12, shuffle=False)) == expected
    assert list(MaxTokensBatchSampler(np.array([3, 9, 4]), 12, shuffle=False)) == expected


def test_load_state_dict_errors():
    sampler = _sampler()
    with pytest.raises(ValueError, match=r"the state misses \['batches_done'\]"):
        sampler.load_state_dict({"seed": 0, "epoch": 0})
    with pytest.raises(ValueError, match="saved with seed=5, this sampler has seed=0"):
        sampler.load_state_dict({"seed": 5, "epoch": 0, "batches_done": 0})
    with pytest.raises(ValueError, match=r"batches_done=100000 is outside \[0, "):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "batches_done": 100000})


# ------------------------------------------------------------------------------------------ Lightning
class TinyLM(pl.LightningModule):
    """An embedding and a linear head in float64: a causal LM loss that is a mean over real tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 32, dtype=torch.float64)
        self.shapes: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        self.shapes.append(tuple(batch["input_ids"].shape))
        logits = self.head(self.embed(batch["input_ids"]))  # (B, T, vocab)
        # next-token prediction: position t predicts label t + 1; padding labels are -100
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(callbacks=(), max_steps=2):
    lengths = long_tailed_lengths(64, low=2, high=40, median=8, seed=2)
    data = [t % 32 for t in token_sequences(lengths, vocab=32, seed=2)]
    sampler = MaxTokensBatchSampler(lengths, 96, seed=1)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=pad_collate())
    module = TinyLM()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_train_batches=1,  # one batch per epoch: the second step is epoch 1's first batch
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, loader)
    return module, sampler, lengths


def test_lightning_fit_uses_the_batches_and_epochs_and_accumulation_is_exact():
    module, sampler, lengths = _fit()
    assert sampler.epoch == 1  # Lightning's set_epoch reached the sampler through batch_sampler.sampler
    expected = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batch = next(iter(sampler))
        expected.append((len(batch), max(lengths[i] for i in batch)))
    assert module.shapes == expected
    assert expected[0] != expected[1]

    # one sample per micro-batch, weighted by real target tokens: the same update as the whole batch
    def targets(batch):
        return int((batch["labels"][:, 1:] != -100).sum())

    split, _, _ = _fit([AutoAccumulation(micro_batch_size=1, count_fn=targets, log=False)])
    assert len(split.shapes) > len(module.shapes)  # it really ran micro-batches
    for a, b in zip(module.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)


def test_ddp_fit_each_rank_runs_its_own_batches_same_count(tmp_path):
    from tests.data.ddp_worker import LENGTHS
    from tests.distributed import run_ranks

    run_ranks("tests.data.ddp_worker:main", tmp_path, timeout=200)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["num_replicas"], r["rank"]) for r in ranks] == [(2, 0), (2, 1)]
    for r in ranks:
        expected = [[len(b), max(LENGTHS[i] for i in b)] for epoch in r["batches"] for b in epoch]
        assert r["shapes"] == expected  # each rank trained on its own sampler batches, both epochs
    assert len(ranks[0]["shapes"]) == len(ranks[1]["shapes"])
    for epoch in (0, 1):
        seen = [i for r in ranks for b in r["batches"][epoch] for i in b]
        assert set(seen) == set(range(len(LENGTHS)))  # the two ranks cover the epoch
    assert ranks[0]["weight"] == ranks[1]["weight"]  # DDP kept the replicas equal
