"""Tests marked ``cuda`` need a CUDA device: they skip cleanly without one, so ``python -m pytest -q tests``
is the one command on CPU machines and on GPU machines alike."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker 'cuda')")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
