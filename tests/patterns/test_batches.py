"""Batches that are not one row per sample everywhere: a tensor all samples share, collated beside them.

A projection matrix of WIDTH x WIDTH beside BATCH = WIDTH samples passes the built-in splitter's checks
(every tensor has BATCH rows), is cut along dim 0 with the samples, and the model fails deep in torch.
The error must say how the batch was cut and how to say otherwise; saying it (a ``split_batch`` hook on
the module, or ``split_fn``) then trains exactly as the unsplit run.
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from tests.patterns.helpers import BATCH, CLASSES, MODES, K, assert_exact, train

WIDTH = BATCH  # the shared matrix has as many rows as the batch has samples: the splitter cannot tell


def projected() -> DataLoader:
    """Batches ``(x, y, proj)``: BATCH samples of WIDTH features, their classes, and one WIDTH x WIDTH
    projection that the collate function puts beside every batch."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3 * BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (3 * BATCH,), generator=g)
    proj = torch.randn(WIDTH, WIDTH, generator=g)
    return DataLoader(
        TensorDataset(x, y), batch_size=BATCH, collate_fn=lambda items: (*default_collate(items), proj)
    )


class Projected(pl.LightningModule):
    """``self.net(x @ proj)``: the pattern of a batch that carries a matrix shared by its samples."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, CLASSES))

    def training_step(self, batch, batch_idx):
        x, y, proj = batch
        return F.cross_entropy(self.net(x @ proj), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def split_samples(batch, sizes):
    """The user's splitter: the samples cut, the projection whole in each micro-batch."""
    x, y, proj = batch
    return [(xs, ys, proj) for xs, ys in zip(x.split(sizes), y.split(sizes))]


class ProjectedWithHook(Projected):
    def split_batch(self, batch, sizes):
        return split_samples(batch, sizes)


@pytest.mark.parametrize("mode", MODES)
def test_a_shared_tensor_cut_with_the_samples_is_named_in_the_error(mode: str) -> None:
    size = K if mode == "split" else BATCH // 2  # OOMBackoff's retry halves the batch
    sizes = [size] * (BATCH // size)
    line = (
        f"micro-batching ran this batch of {BATCH} samples as micro-batches of {sizes}, cutting along dim 0: "
        f"batch[0] ({BATCH}, {WIDTH}), batch[1] ({BATCH},), batch[2] ({WIDTH}, {WIDTH}); if a tensor holds something all samples share rather than one row per "
        "sample, define `split_batch(self, batch, sizes)` on your LightningModule or pass `split_fn=` to the "
        "callback (return one batch per size, that tensor whole in each), or make it a module attribute"
    )
    torch_error = re.escape(f"mat1 and mat2 shapes cannot be multiplied ({size}x{WIDTH} and {size}x{WIDTH})")
    with pytest.raises(RuntimeError, match=torch_error) as error:
        train(Projected, projected, mode)
    assert error.value.__notes__ == [line]  # the error as torch raised it, and one line more


def test_the_unsplit_run_trains() -> None:
    """The pattern is sound without micro-batching: the error above is the split's."""
    run = train(Projected, projected)
    assert run.sizes == [BATCH] * 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["split_batch hook", "split_fn"])
def test_saying_how_to_split_trains_exactly(mode: str, how: str) -> None:
    reference = train(Projected, projected)
    if how == "split_fn":
        run = train(Projected, projected, mode, options={"split_fn": split_samples})
    else:
        run = train(ProjectedWithHook, projected, mode)
    assert_exact(run, reference)
