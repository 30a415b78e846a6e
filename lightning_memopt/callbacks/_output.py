"""What the callbacks tell the user on the terminal, while a progress bar may be drawn.

Messages go through Lightning's logging (``rank_zero_info``: the ``lightning.pytorch`` logger, rank zero
only), so that a user's logging configuration applies and tests read them with ``caplog``. Emitted
during an epoch, a message would land in the middle of the progress bar: the log handler writes to the
stream it was made with, beside the bar. :func:`info` writes it where the bar expects other output:

- ``TQDMProgressBar`` (tqdm): the bars are cleared first and redrawn after
  (:meth:`tqdm.external_write_mode`).
- ``RichProgressBar`` (rich's live display): on a terminal it replaces ``sys.stdout``/``sys.stderr``
  with proxies that print above the bar; the log handlers that hold the replaced stream write to the
  proxy for this one message.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from tqdm import tqdm

__all__ = ["info"]


def info(message: str) -> None:
    """``rank_zero_info(message)``, written above (not into) a progress bar being drawn."""
    with tqdm.external_write_mode(file=sys.stderr), _through_live_display():
        rank_zero_info(message)


@contextlib.contextmanager
def _through_live_display() -> Iterator[None]:
    """Point the log handlers that write to a stream rich's live display proxies at the proxy meanwhile."""
    swapped: list[tuple[logging.StreamHandler, object]] = []
    handlers = logging.getLogger("lightning.pytorch").handlers + logging.getLogger().handlers
    for proxy in (sys.stderr, sys.stdout):
        proxied = getattr(proxy, "rich_proxied_file", None)  # rich.file_proxy.FileProxy
        for handler in handlers:
            if (
                proxied is not None
                and isinstance(handler, logging.StreamHandler)
                and handler.stream is proxied
            ):
                swapped.append((handler, handler.setStream(proxy)))
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
