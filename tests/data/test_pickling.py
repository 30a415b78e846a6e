import functools
import multiprocessing
import pickle
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt.data import check_picklable, find_unpicklable, worker_start_method
from tests.data.helpers import CostlyItems


class Transformed(Dataset):
    """Module-level (picklable) dataset holding a transform chosen by the test."""

    def __init__(self, transform=None, **extra):
        self.data = torch.arange(8.0)
        self.transform = transform
        self.__dict__.update(extra)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.transform(self.data[i]) if self.transform else self.data[i]


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Slotted:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


def double(x):
    return 2 * x


def _spawn(dataset, **kwargs):
    return DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="spawn", **kwargs)


def test_a_lambda_inside_a_transform_chain_is_named_by_path():
    loader = _spawn(Transformed(Compose([double, lambda x: x + 1])))
    found = find_unpicklable(loader)
    assert found.path == "dataset.transform.transforms[1]"
    assert found.what.startswith("a lambda defined at ") and "test_pickling.py" in found.what
    with pytest.raises(
        pickle.PicklingError,
        match=r"under the 'spawn' start method .* dataset\.transform\.transforms\[1\] is a lambda",
    ):
        check_picklable(loader)


def test_local_functions_classes_partials_and_collate_functions():
    def local_fn(x):
        return x

    class LocalDataset(Transformed):
        pass

    found = find_unpicklable(_spawn(Transformed(functools.partial(local_fn))))
    assert found.path == "dataset.transform.func"
    assert found.what.startswith(
        "a local function test_local_functions_classes_partials_and_collate_functions.<locals>.local_fn"
    )
    found = find_unpicklable(_spawn(LocalDataset()))
    assert found.path == "dataset" and found.what.startswith("an instance of the local class")
    found = find_unpicklable(_spawn(Transformed(), collate_fn=lambda batch: batch))
    assert found.path == "collate_fn" and found.what.startswith("a lambda")
    found = find_unpicklable(_spawn(Transformed(), worker_init_fn=local_fn))
    assert found.path == "worker_init_fn"
    found = find_unpicklable(_spawn(Transformed(Slotted(lambda x: x))))
    assert found.path == "dataset.transform.fn"
    found = find_unpicklable(_spawn(Transformed(table={"key": [1, threading.Lock()]})))
    assert found.path == "dataset.table['key'][1]" and "_thread.lock" in found.what


def test_picklable_loaders_pass_and_tensors_are_not_serialized():
    big = torch.zeros(2**27, dtype=torch.uint8)  # 128 MiB: stood in by None, not copied
    lock = multiprocessing.get_context("spawn").Lock()
    loader = _spawn(Transformed(Compose([double]), big=big, lock=lock))
    assert find_unpicklable(loader) is None
    check_picklable(loader)


def test_a_lock_made_in_the_fork_context_does_not_reach_spawned_workers():
    found = find_unpicklable(_spawn(Transformed(lock=multiprocessing.get_context("fork").Lock())))
    assert found.path == "dataset.lock" and "get_context('spawn')" in found.what


def test_no_check_without_workers_or_under_fork():
    unpicklable = Transformed(lambda x: x)
    check_picklable(DataLoader(unpicklable, batch_size=2))  # num_workers=0: nothing is pickled
    check_picklable(DataLoader(unpicklable, batch_size=2, num_workers=1, multiprocessing_context="fork"))
    assert find_unpicklable(DataLoader(unpicklable)).path == "dataset.transform"


def test_start_method_from_the_loader_or_the_process_default():
    assert (
        worker_start_method(DataLoader(CostlyItems(), num_workers=1, multiprocessing_context="forkserver"))
        == "forkserver"
    )
    context = multiprocessing.get_context("spawn")
    assert (
        worker_start_method(DataLoader(CostlyItems(), num_workers=1, multiprocessing_context=context))
        == "spawn"
    )
    default = multiprocessing.get_context().get_start_method()
    assert worker_start_method(DataLoader(CostlyItems())) == default
    assert worker_start_method([1, 2]) == default
