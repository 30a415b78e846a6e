"""Messages on the terminal: through Lightning's logging, written above the progress bar, not into it."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator

import lightning.pytorch as pl
import rich
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_memopt import AutoCheckpoint
from lightning_memopt.callbacks._output import info
from tests.callbacks.test_auto_checkpoint import GPTModule

HEADER = "block choice activations recompute GFLOP recompute pointwise offloaded time".split()


class _StdoutAtEmit(logging.Handler):
    """Records what ``stdout`` held when each message containing ``needle`` was logged."""

    def __init__(self, stdout: io.StringIO, needle: str) -> None:
        super().__init__()
        self.stdout, self.needle, self.seen = stdout, needle, []

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.append(self.stdout.getvalue())


def _fit(tmp_path, bar, caplog) -> str:
    """Fit 3 steps with AutoCheckpoint and ``bar``; the plan table AutoCheckpoint logged."""
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[AutoCheckpoint(), bar],
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(GPTModule())
    (table,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AutoCheckpoint plan:")]
    assert table.splitlines()[1].split() == HEADER
    return table


def test_plan_table_is_logged_with_the_tqdm_bar_cleared(tmp_path, caplog, monkeypatch):
    stdout = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)  # tqdm bars write to sys.stdout as it is when made
    spy = _StdoutAtEmit(stdout, "AutoCheckpoint plan")
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(spy)
    try:
        _fit(tmp_path, TQDMProgressBar(), caplog)
    finally:
        logger.removeHandler(spy)
    (at_emit,) = spy.seen
    assert "Epoch 0" in at_emit  # the bar was drawn: the table comes mid-epoch
    assert at_emit.endswith("\r") and at_emit.rstrip("\r ").endswith("]")  # ... and its line was cleared
    assert "AutoCheckpoint plan" not in stdout.getvalue()  # the log handler's stream, not the bar's


@contextlib.contextmanager
def _lightning_log_to_stderr(monkeypatch) -> Iterator[io.StringIO]:
    """A log handler on Lightning's logger (as Lightning adds where the root logger has none) writing to a
    fresh ``sys.stderr``. Set in the test's body: pytest puts its own ``sys.stderr`` back after fixtures."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    logger, handler = logging.getLogger("lightning.pytorch"), logging.StreamHandler(stderr)
    logger.addHandler(handler)
    try:
        yield stderr
    finally:
        logger.removeHandler(handler)


def test_plan_table_is_printed_above_the_rich_bar(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(rich, "_console", None)  # Lightning reconfigures rich's global console: a fresh one
    screen = io.StringIO()  # the terminal rich draws on (live display: it redirects sys.stderr meanwhile)
    bar = RichProgressBar(console_kwargs={"force_terminal": True, "file": screen, "width": 200})
    with _lightning_log_to_stderr(monkeypatch) as stderr:
        table = _fit(tmp_path, bar, caplog)
    assert "AutoCheckpoint plan" not in stderr.getvalue()  # not beside the live display ...
    shown = screen.getvalue()
    assert all(line.rstrip() in shown for line in table.splitlines())  # ... but printed by rich, above it
    assert shown.index("AutoCheckpoint plan:") > shown.index("Epoch 0")  # mid-epoch, the bar redrawn after


def test_info_goes_through_lightnings_logger(caplog, monkeypatch):
    with _lightning_log_to_stderr(monkeypatch) as stderr, caplog.at_level(logging.INFO):
        info("first line\nsecond line")
    (record,) = [r for r in caplog.records if r.getMessage() == "first line\nsecond line"]
    assert record.name.startswith("lightning.pytorch") and record.levelno == logging.INFO
    assert "first line\nsecond line\n" in stderr.getvalue()  # no bar: written as it is
