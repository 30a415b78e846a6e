"""How a split step's outputs are combined: what the autograd graph says a value reduced, and what it
cannot say (:func:`~lightning_memopt.batching.outputs.reductions`, :func:`~.combine`)."""

import torch

from lightning_memopt.batching.outputs import combine, reductions


def _split_outputs(make, x, sizes):
    """``make(micro_batch)`` on each micro-batch of ``x``, and its reductions (read before any backward)."""
    outs = [make(part) for part in x.split(sizes)]
    return [{k: v.detach() for k, v in o.items()} for o in outs], [
        reductions(o, n) for o, n in zip(outs, sizes)
    ]


def test_reductions_over_the_samples_combine_to_the_batchs():
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)

    def make(t):
        return {
            "max": t.max(),
            "class_min": t.amin(0),  # (3,): as many classes as a micro-batch of 3 has samples
            "sum": t.sum(),
            "mean": t.mean(),
            "class_mean": t.mean(0),
            "sample_max": t.amax(-1),  # one value per sample: joined
        }

    outs, how = _split_outputs(make, x, [3, 3])
    got = combine(outs, [3, 3], how=how, inexact=(inexact := []))
    expected = {k: v.detach() for k, v in make(x).items()}
    assert inexact == []
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-15, atol=0, msg=key)


def test_a_mean_is_weighted_by_the_elements_each_micro_batch_averaged():
    """A user's ``split_fn`` may trim each micro-batch's padding: the mean of micro-batches of other widths
    is weighted by their elements, not their samples."""
    a = torch.ones(2, 4, requires_grad=True)
    b = torch.full((2, 1), 6.0, requires_grad=True)
    how = [reductions({"m": t.mean()}, 2) for t in (a, b)]
    assert how == [{"['m']": ("mean", 8.0)}, {"['m']": ("mean", 2.0)}]
    got = combine([{"m": a.mean().detach()}, {"m": b.mean().detach()}], [2, 2], how=how)
    assert got["m"].item() == (8 * 1.0 + 2 * 6.0) / 10


def test_what_the_graph_cannot_say_is_named():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(5, requires_grad=True)  # not the samples': summing its sum over micro-batches is wrong
    outs = [
        {"detached": t.max().detach(), "ratio": t.max() / t.min(), "weight_sum": w.sum()} for t in x.split(2)
    ]
    how = [reductions(o, 2) for o in outs]
    assert how == [{}, {}]
    inexact = []
    combine([{k: v.detach() for k, v in o.items()} for o in outs], [2, 2], how=how, inexact=inexact)
    assert inexact == ["['detached']", "['ratio']", "['weight_sum']"]
