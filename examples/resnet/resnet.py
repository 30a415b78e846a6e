"""A small ResNet with BatchNorm, trained on synthetic images made in code.

Each of the ``num_classes`` classes is a smooth random colour pattern (a 4x4 grid of random colours,
upsampled); a sample is its class pattern with random contrast, a random shift and Gaussian noise, so
the task is easy enough to learn in a few hundred steps and needs no download.

The model uses BatchNorm everywhere, the case where micro-batching changes training: BatchNorm
normalizes over the (micro-)batch, so with ``AutoAccumulation`` splitting each batch its statistics come
from fewer samples. ``BatchNormToGroupNorm`` replaces every BatchNorm by a GroupNorm, which does not
depend on the batch. Nothing in this file knows about lightning_memopt.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


# ----------------------------------------------------------------------------------------- the model
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18's block)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:  # match the shape of the residual
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # (B, C_out, H / stride, W / stride)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, *, widths: list[int], blocks_per_stage: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        # One Sequential of blocks per stage; every stage after the first halves the resolution.
        stages, in_channels = [], widths[0]
        for i, width in enumerate(widths):
            blocks = [BasicBlock(in_channels, width, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(width, width, stride=1) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, 3, H, W) -> (B, C_last, H / 2^(stages-1), ...)
        return self.head(x.mean(dim=(2, 3)))  # global average pool: (B, C_last) -> (B, classes)


class ImageClassifier(L.LightningModule):
    """A ResNet classifier as a LightningModule.

    Args:
        widths: Channels of each stage.
        blocks_per_stage: Residual blocks per stage.
        num_classes: Output classes (linked to the data module's ``num_classes``).
        lr: SGD learning rate (momentum 0.9, Nesterov).
        weight_decay: SGD weight decay.
    """

    def __init__(
        self,
        widths: list[int] = [8, 16, 32],  # noqa: B006 (jsonargparse shows list defaults in --help)
        blocks_per_stage: int = 2,
        num_classes: int = 10,
        lr: float = 0.05,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ResNet(widths=list(widths), blocks_per_stage=blocks_per_stage, num_classes=num_classes)
        # Lets BatchNormToGroupNorm probe each BatchNorm's input shape with one no-grad forward.
        self.example_input_array = torch.zeros(2, 3, 32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, classes)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(
            self.parameters(),
            lr=self.hparams.lr,
            momentum=0.9,
            nesterov=True,
            weight_decay=self.hparams.weight_decay,
        )


# ------------------------------------------------------------------------------------------ the data
def synthetic_images(
    num_samples: int, *, num_classes: int, image_size: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_samples`` images ``(N, 3, S, S)`` and labels ``(N,)``; the class patterns depend on ``seed``
    only through the first draw, so every split made with the same ``seed`` shares them."""
    patterns_generator = torch.Generator().manual_seed(seed)
    patterns = torch.rand(num_classes, 3, 4, 4, generator=patterns_generator) * 2 - 1  # (K, 3, 4, 4)
    patterns = F.interpolate(patterns, size=(image_size, image_size), mode="bilinear", align_corners=False)
    generator = torch.Generator().manual_seed(seed + 1 + num_samples)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)  # (N,)
    contrast = 0.5 + torch.rand(num_samples, 1, 1, 1, generator=generator)  # (N, 1, 1, 1)
    images = patterns[labels] * contrast  # (N, 3, S, S)
    shifts = torch.randint(-4, 5, (num_samples, 2), generator=generator)
    for i, (dy, dx) in enumerate(shifts.tolist()):  # a random translation per image
        images[i] = images[i].roll((dy, dx), dims=(1, 2))
    images += noise * torch.randn(images.shape, generator=generator)
    return images, labels


class SyntheticImages(L.LightningDataModule):
    """Synthetic 3-channel images of ``num_classes`` classes, made in memory.

    Args:
        batch_size: Samples per optimizer step (micro-batching, if any, happens inside the step).
        num_classes: Number of classes.
        image_size: Height and width.
        train_samples: Training images.
        val_samples: Validation images.
        noise: Standard deviation of the Gaussian noise added to every pixel.
        seed: Seed of the patterns and the samples.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_classes: int = 10,
        image_size: int = 32,
        train_samples: int = 4096,
        val_samples: int = 512,
        noise: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        kwargs = {
            "num_classes": hp.num_classes,
            "image_size": hp.image_size,
            "noise": hp.noise,
            "seed": hp.seed,
        }
        self.train_set = TensorDataset(*synthetic_images(hp.train_samples, **kwargs))
        self.val_set = TensorDataset(*synthetic_images(hp.val_samples, **kwargs))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, generator=generator
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
