"""RngState: the one snapshot of the random generators (torch, Python, NumPy, given torch.Generators)."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_memopt._rng import RngState

numpy = pytest.importorskip("numpy")


def _draws(generator: torch.Generator) -> tuple:
    return (
        torch.rand(2).tolist(),
        random.random(),
        numpy.random.rand(),
        torch.rand(1, generator=generator).item(),
    )


def test_restore_puts_every_generator_back():
    generator = torch.Generator().manual_seed(3)
    state = RngState.capture([generator])
    first = _draws(generator)
    state.restore()
    assert _draws(generator) == first
    state.restore()  # the saved states stay valid
    assert _draws(generator) == first


def test_same_compares_torch_and_same_host_compares_python_and_numpy():
    state = RngState.capture()
    assert state.same(RngState.capture()) and state.same_host(RngState.capture())
    torch.rand(1)
    assert not RngState.capture().same(state) and RngState.capture().same_host(state)
    state = RngState.capture()
    numpy.random.rand()
    assert RngState.capture().same(state) and not RngState.capture().same_host(state)
    state = RngState.capture()
    random.random()
    assert not RngState.capture().same_host(state)


def test_restore_host_leaves_torch_where_it_is():
    state = RngState.capture()
    python, numpy_draw = random.random(), numpy.random.rand()
    torch_draw = torch.rand(1)
    after_torch = torch.get_rng_state()
    state.restore_host()
    assert torch.equal(torch.get_rng_state(), after_torch)
    assert (random.random(), numpy.random.rand()) == (python, numpy_draw)
    assert not torch.equal(torch.rand(1), torch_draw)
