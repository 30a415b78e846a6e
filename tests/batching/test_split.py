import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_memopt.batching.split import batch_size, micro_batch_sizes, micro_batch_weights, split_batch


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "train"


Pair = namedtuple("Pair", ["x", "y"])


def test_micro_batch_sizes_are_even_and_fewest():
    assert micro_batch_sizes(10, 4) == [3, 3, 4]  # the largest last
    assert micro_batch_sizes(10, 10) == [10]
    assert micro_batch_sizes(10, 64) == [10]
    assert micro_batch_sizes(9, 3) == [3, 3, 3]
    assert micro_batch_sizes(7, 1) == [1] * 7
    assert micro_batch_sizes(5, 2, smallest=2) == [2, 3]  # BatchNorm: no micro-batch of one sample
    assert micro_batch_sizes(7, 1, smallest=2) == [2, 2, 3]
    assert micro_batch_sizes(1, 1, smallest=2) == [1]
    for total in range(1, 40):
        for micro in range(1, 12):
            sizes = micro_batch_sizes(total, micro)
            assert sum(sizes) == total and max(sizes) <= micro and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes)  # the largest last: the step's last forward is its largest
            assert len(sizes) == -(-total // micro)
    with pytest.raises(ValueError, match="need total >= 1 and micro >= 1, got total=5, micro=0"):
        micro_batch_sizes(5, 0)


def test_split_through_containers():
    x, y = torch.arange(20.0).view(10, 2), torch.arange(10)
    scale = torch.tensor(2.0)  # 0-dim: shared by every sample
    batch = {
        "pair": Pair(x, y),
        "list": [x, 7],
        "sample": Sample(x, y),
        "od": OrderedDict(m=scale),
        "s": "tag",
    }
    parts = split_batch(batch, [4, 3, 3])
    assert len(parts) == 3
    assert torch.equal(parts[1]["pair"].x, x[4:7]) and isinstance(parts[1]["pair"], Pair)
    assert torch.equal(parts[2]["list"][0], x[7:]) and parts[2]["list"][1] == 7
    assert isinstance(parts[0]["sample"], Sample) and torch.equal(parts[0]["sample"].y, y[:4])
    assert parts[0]["sample"].tag == "train"
    assert parts[2]["od"]["m"] is scale and isinstance(parts[2]["od"], OrderedDict)
    assert parts[1]["s"] == "tag"
    # The pieces are views: splitting copies nothing.
    assert parts[1]["pair"].x.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_per_sample_sequences_split_with_the_tensors():
    # (x[8], y[8], 8 strings) by 4: each micro-batch gets its own 4 strings, not all 8.
    x, y = torch.arange(8.0), torch.arange(8)
    names = [f"s{i}" for i in range(8)]
    parts = split_batch((x, y, names, ("a", "b")), [4, 4])
    assert parts[0][2] == names[:4] and parts[1][2] == names[4:]
    assert torch.equal(parts[1][0], x[4:]) and isinstance(parts[1][2], list)
    assert parts[1][3] == ("a", "b")  # not one per sample (2 != 8): every micro-batch gets it
    parts = split_batch({"x": x, "ids": tuple(range(8))}, [3, 3, 2])
    assert [p["ids"] for p in parts] == [(0, 1, 2), (3, 4, 5), (6, 7)]


def test_tensors_disagreeing_on_dim_0_are_an_error():
    batch = {"x": torch.zeros(8, 2), "y": torch.zeros(8), "mask": torch.ones(3, 3)}
    with pytest.raises(
        ValueError,
        match=r"disagree on dim 0.*batch\['x'\] has 8 rows \(the batch size\), but batch\['mask'\] has 3\. .*split_fn=",
    ):
        split_batch(batch, [4, 4])
    # a list of per-sample tensors whose dim 0 is not the batch size: ambiguous, so an error too
    with pytest.raises(ValueError, match=r"batch\[1\]\[0\] has 3"):
        split_batch((torch.zeros(2, 1), [torch.zeros(3, 5), torch.zeros(3, 4)]), [1, 1])


def test_single_split_returns_batch_itself():
    batch = (torch.zeros(5, 2), torch.zeros(5))
    assert split_batch(batch, [5])[0] is batch


def test_batch_size():
    assert batch_size((torch.zeros(6, 3), {"y": torch.zeros(6)}, "name", torch.tensor(1.0))) == 6
    assert batch_size((torch.zeros(4, 6), torch.zeros(3))) == 4  # the first tensor decides, as in Lightning
    with pytest.raises(ValueError, match="no tensor with a sample dimension"):
        batch_size({"a": 1})


def test_unknown_type_names_the_hook():
    class Graph:
        pass

    with pytest.raises(
        TypeError, match=r"cannot split a batch containing '.*Graph'.*split_batch\(self, batch, sizes\)"
    ):
        split_batch([torch.zeros(4), Graph()], [2, 2])


def test_sizes_must_add_up():
    with pytest.raises(
        ValueError, match=r"micro-batch sizes \[2, 2\] must be positive and add up to the batch size 5"
    ):
        split_batch(torch.zeros(5), [2, 2])


def test_user_split_fn():
    def split_fn(batch, sizes):
        return [batch[:s] for s in sizes]

    assert [len(p) for p in split_batch(list(range(5)), [3, 2], split_fn=split_fn)] == [3, 2]
    with pytest.raises(ValueError, match="split_fn returned 1 micro-batches for sizes"):
        split_batch([1, 2], [1, 1], split_fn=lambda b, s: [b])


def test_weights_reproduce_the_full_batch_mean():
    torch.manual_seed(0)
    losses = torch.randn(10)
    sizes = micro_batch_sizes(10, 4)
    parts = split_batch(losses, sizes)
    weights = micro_batch_weights(parts, sizes)
    assert weights == [0.3, 0.3, 0.4]
    combined = sum(w * p.mean() for w, p in zip(weights, parts))
    torch.testing.assert_close(combined, losses.mean(), rtol=1e-6, atol=0)


def test_token_count_weights():
    # Token-mean loss: micro-batches weigh their share of non-padding tokens, not of samples.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    token_loss = torch.arange(16.0).view(4, 4)
    sizes = [2, 2]
    parts = split_batch({"mask": mask, "loss": token_loss}, sizes)
    weights = micro_batch_weights(parts, sizes, count_fn=lambda mb: mb["mask"].sum())
    assert weights == [4 / 10, 6 / 10]
    full = (token_loss * mask).sum() / mask.sum()
    combined = sum(w * (p["loss"] * p["mask"]).sum() / p["mask"].sum() for w, p in zip(weights, parts))
    torch.testing.assert_close(combined, full)
    with pytest.raises(ValueError, match="count_fn must return non-negative counts with a positive sum"):
        micro_batch_weights(parts, sizes, count_fn=lambda mb: 0)
    with pytest.raises(
        ValueError, match=r"count_fn must return one number per micro-batch, got a tensor of shape \(2,\)"
    ):
        micro_batch_weights(parts, sizes, count_fn=lambda mb: mb["mask"].sum(1))
