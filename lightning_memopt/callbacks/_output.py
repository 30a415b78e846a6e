"""What the callbacks tell the user on the terminal, while a progress bar may be drawn.

Messages go through Lightning's logging (``rank_zero_info``: the ``lightning.pytorch`` logger, rank zero
only), so that a user's logging configuration applies and tests can read them with ``caplog``. A message
emitted during an epoch would land in the middle of the progress bar's line (the bar, on stdout, has no
newline yet; the log handler writes to stderr): :func:`info` clears the bars first and redraws them after.
"""

from __future__ import annotations

import sys

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from tqdm import tqdm

__all__ = ["info"]


def info(message: str) -> None:
    """``rank_zero_info(message)`` with every tqdm bar on the terminal (stdout or stderr) cleared while it
    is written, then redrawn below it (:meth:`tqdm.external_write_mode`)."""
    with tqdm.external_write_mode(file=sys.stderr):
        rank_zero_info(message)
