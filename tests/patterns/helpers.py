"""What every pattern test does: train the same module twice, seeded alike, in float64, and compare.

Once plain (no package) and once with the package forcing a split: ``"split"`` is
``AutoAccumulation(micro_batch_size=K)``, ``"oom"`` is ``OOMBackoff()`` with one injected out-of-memory
error (the whole batch of ``BATCH`` fails, half of it fits). A pattern then ends one of two ways:

- exact: every parameter equals the plain run's relative to the update,
  ``||p_pkg - p_plain|| / ||p_plain - p_start|| <= BAR`` over all parameters (:func:`relative_update`),
  and what was logged or returned equals the plain run's; or
- named: a :class:`~lightning_memopt.SplitNotExactWarning` (or, with ``exactness="raise"``, a
  :class:`~lightning_memopt.SplitNotExactError`) whose message names the cause.

Only public names are used: the package's callbacks and testing tools, and Lightning's API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import AutoAccumulation, OOMBackoff, SplitNotExactWarning
from lightning_memopt.testing import OOMInjector
from tests.batching import helpers as batching_helpers

FEATURES, CLASSES = 4, 3  # the small classifiers' inputs and classes
BATCH = 8  # samples per DataLoader batch (the optimizer batch)
K = 2  # samples per micro-batch that AutoAccumulation is forced to
BAR = 1e-10  # the largest relative difference of the update that counts as exact (float64)
MODES = ("split", "oom")


class MLP(pl.LightningModule):
    """``self.net``: Linear(FEATURES, 8) -> Tanh -> Linear(8, out), trained with SGD; each pattern writes
    its own ``training_step``."""

    def __init__(self, out: int = CLASSES) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, out))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def classification(samples: int = 3 * BATCH) -> DataLoader:
    """``samples`` (features, class) pairs in batches of BATCH, the same every call."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=g)
    return loader(x, torch.randint(0, CLASSES, (samples,), generator=g))


class Recorder(Logger):
    """A logger that keeps every row Lightning sends it, as ``(step, {key: float})``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def values(self, key: str) -> list[float]:
        """Every value logged under ``key``, in order."""
        return [float(row[key]) for _, row in self.rows if key in row]


@dataclasses.dataclass
class Run:
    """One training run: the trained module, its Trainer, and what was seen on the way."""

    module: pl.LightningModule
    trainer: pl.Trainer
    start: dict[str, torch.Tensor]  # the parameters before training
    logger: Recorder | None
    sizes: list[int]  # dim 0 of every training-mode forward of the watched submodule
    callbacks: list[pl.Callback]

    def metric(self, key: str) -> float:
        return float(self.trainer.callback_metrics[key])


def quiet_trainer(
    callbacks=(), *, steps: int = 3, logger: Logger | bool = False, **kwargs: Any
) -> pl.Trainer:
    """The engine tests' quiet CPU Trainer (no checkpoints, progress bar, summary or validation), made
    deterministic and stopped after ``steps``."""
    return batching_helpers.quiet_trainer(
        callbacks, deterministic=True, max_steps=steps, logger=logger, **kwargs
    )


def loader(*tensors: torch.Tensor, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=False)


def package_callbacks(mode: str, k: int = K, **options: Any) -> list[pl.Callback]:
    """The callbacks of ``mode`` ("plain", "split" into micro-batches of ``k``, "oom"); ``options`` go to
    the package's callback."""
    if mode == "plain":
        return []
    if mode == "split":
        return [AutoAccumulation(micro_batch_size=k, log=False, **options)]
    if mode == "oom":
        return [OOMBackoff(log=False, **options)]
    raise ValueError(f"mode must be 'plain', 'split' or 'oom', got {mode!r}")


def train(
    make_module: Callable[[], pl.LightningModule],
    data: Callable[[], Any],
    mode: str = "plain",
    *,
    watch: str = "net",
    phase: str = "forward",
    options: dict[str, Any] | None = None,
    callbacks: list[pl.Callback] | None = None,
    record: bool = False,
    steps: int = 3,
    k: int = K,
    ckpt_path: Any = None,
    **trainer_kwargs: Any,
) -> Run:
    """Build ``make_module()`` (seeded), fit it on ``data()`` in ``mode`` and return the :class:`Run`.

    ``k``: the micro-batch size of "split". ``watch`` names the submodule whose training inputs give the micro-batch sizes, and where the "oom"
    mode's injector raises (in ``phase``); ``callbacks`` come before the package's; ``record`` attaches
    a :class:`Recorder`; ``ckpt_path`` resumes from a checkpoint (the size it saved: no OOM then).
    """
    assert torch.get_default_dtype() == torch.float64, "patterns run in float64 (tests/patterns/conftest.py)"
    pl.seed_everything(0, verbose=False)
    module = make_module()
    start = snapshot(module)
    watched = module.get_submodule(watch)
    sizes: list[int] = []

    def note_size(mod, args):
        if mod.training and args and isinstance(args[0], torch.Tensor):
            sizes.append(len(args[0]))

    handle = watched.register_forward_pre_hook(note_size)
    cbs = list(callbacks or []) + package_callbacks(mode, k, **(options or {}))
    logger = Recorder() if record else None
    injector = (
        OOMInjector(watched, phase=phase, max_size=BATCH // 2) if mode == "oom" else contextlib.nullcontext()
    )
    trainer = quiet_trainer(cbs, steps=steps, logger=logger or False, **trainer_kwargs)
    pl.seed_everything(1, verbose=False)  # the same dropout masks, shuffles and noise in every run
    try:
        with injector:
            loaders = data()  # a training DataLoader, or (training, validation)
            loaders = loaders if isinstance(loaders, tuple) else (loaders,)
            trainer.fit(module, *loaders, ckpt_path=ckpt_path)
    finally:
        handle.remove()
    # the package did split: a test of a run that was never split could not fail
    if mode == "oom" and ckpt_path is None:
        assert injector.raised >= 1, "the injected out-of-memory error never happened"
    if mode in ("split", "oom"):
        assert min(sizes) < BATCH, f"the package never split the batch: training inputs of {sizes}"
    return Run(module, trainer, start, logger, sizes, cbs)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def update_difference(params: dict, reference: dict, start: dict) -> float:
    """``||params - reference|| / ||reference - start||``, 2-norms over all parameters together (dicts of
    name -> tensor): how far a run ends from the reference, relative to the reference's update."""
    assert params.keys() == reference.keys(), "the package changed the module's parameter names"
    diff = sum(((params[k] - reference[k]).detach().double() ** 2).sum() for k in reference)
    update = sum(((reference[k] - start[k]).detach().double() ** 2).sum() for k in reference)
    assert update > 0, "the reference run did not train: nothing to compare"
    return float((diff / update).sqrt())


def relative_update(run: Run, reference: Run) -> float:
    """:func:`update_difference` of two runs' parameters, relative to the reference run's update."""
    return update_difference(
        dict(run.module.named_parameters()), dict(reference.module.named_parameters()), reference.start
    )


def assert_exact(run: Run, reference: Run, bar: float = BAR) -> None:
    rel = relative_update(run, reference)
    assert rel <= bar, f"parameters differ from the unsplit run by {rel:.3g} of the update (bar {bar:g})"


def assert_same_values(got: list[float], expected: list[float], what: str, rel: float = BAR) -> None:
    assert len(got) == len(expected), (
        f"{what}: {len(got)} values logged, the unsplit run logged {len(expected)}"
    )
    for i, (g, e) in enumerate(zip(got, expected)):
        assert abs(g - e) <= rel * max(abs(e), 1e-30), f"{what}[{i}]: {g!r}, the unsplit run logged {e!r}"


@contextlib.contextmanager
def no_split_warning():
    """Asserts that nothing inside warned :class:`~lightning_memopt.SplitNotExactWarning`: an exact pattern
    must not be reported as inexact (a warning on every split would otherwise pass the named tests)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    named = [str(w.message) for w in caught if issubclass(w.category, SplitNotExactWarning)]
    assert not named, f"an exact pattern was warned about: {named}"
