"""The public names DESIGN.md fixes (code outside the project imports them) and what importing costs."""

import subprocess
import sys

import lightning.pytorch as pl

import lightning_memopt


def test_fixed_public_names_import_and_callbacks_need_no_arguments():
    from lightning_memopt import (
        AutoAccumulation,
        AutoCheckpoint,
        BatchNormToGroupNorm,
        DataLoaderMonitor,
        MemoryMonitor,
        MicroBatchOOMError,
        OOMBackoff,
        SplitNotExactError,
        SplitNotExactWarning,
    )
    from lightning_memopt.checkpointing import (  # noqa: F401
        apply_checkpointing,
        find_blocks,
        plan_checkpointing,
        remove_checkpointing,
    )
    from lightning_memopt.head import linear_cross_entropy  # noqa: F401
    from lightning_memopt.memory import MemoryTracker  # noqa: F401
    from lightning_memopt.norm import convert_batchnorm  # noqa: F401

    callbacks = [
        AutoCheckpoint,
        AutoAccumulation,
        OOMBackoff,
        BatchNormToGroupNorm,
        MemoryMonitor,
        DataLoaderMonitor,
    ]
    errors = [MicroBatchOOMError, SplitNotExactError, SplitNotExactWarning]
    assert sorted(c.__name__ for c in [*callbacks, *errors]) == sorted(lightning_memopt.__all__)
    assert issubclass(SplitNotExactWarning, UserWarning) and issubclass(SplitNotExactError, RuntimeError)
    for cls in callbacks:
        assert isinstance(cls(), pl.Callback)
        assert cls.__module__ == lightning_memopt._PUBLIC[cls.__name__]
    # the error users catch: one class, wherever it is imported from
    from lightning_memopt.batching.engine import MicroBatchOOMError as from_engine

    assert MicroBatchOOMError is from_engine and issubclass(MicroBatchOOMError, RuntimeError)
    assert MicroBatchOOMError.__module__ == lightning_memopt._PUBLIC["MicroBatchOOMError"]


def test_unknown_attribute_is_an_attribute_error():
    try:
        lightning_memopt.AutoCheckpointing  # noqa: B018
    except AttributeError as error:
        assert "has no attribute 'AutoCheckpointing'" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def test_plain_torch_cores_do_not_import_lightning():
    code = (
        "import sys; import lightning_memopt.memory, lightning_memopt.norm, lightning_memopt.checkpointing, "
        "lightning_memopt.batching.split, lightning_memopt.batching.size_search, lightning_memopt.data, "
        "lightning_memopt.head, lightning_memopt.head.causal_lm, lightning_memopt.batching.loss; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_test_oracle_nor_pre_release_shim_ships():
    """Exhaustive searches live in tests/oracles.py; nothing is kept for versions that were never released."""
    import inspect

    import lightning_memopt.checkpointing as checkpointing
    from lightning_memopt import AutoCheckpoint
    from lightning_memopt.planning.search import Planner

    assert not [n for n in checkpointing.__all__ if "brute" in n or "deprecated" in n]
    assert not hasattr(Planner, "brute_force")
    assert "budget" not in inspect.signature(AutoCheckpoint).parameters
