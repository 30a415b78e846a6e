"""Helpers shared by the head's tests and the zoo's."""

from __future__ import annotations

import pytest


def second_passes(monkeypatch: pytest.MonkeyPatch, on: tuple[str, ...] = ()) -> list:
    """The list the chunked head's second pass over the vocabulary appends each call's features' shape to;
    ``on``: the device types where a float32 weight's gradient is computed by columns too (the CPU: what
    CUDA runs)."""
    from lightning_memopt.head import loss as head_loss

    calls, second_pass = [], head_loss._weight_gradient_by_columns
    monkeypatch.setattr(head_loss, "WEIGHT_GRADIENT_BY_COLUMNS", on)
    monkeypatch.setattr(
        head_loss, "_weight_gradient_by_columns", lambda *a: calls.append(a[0].shape) or second_pass(*a)
    )
    return calls
