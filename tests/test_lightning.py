import lightning.pytorch as pl
import pytest
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource

from lightning_memopt._lightning import LIGHTNING_NAMES, has_name
from lightning_memopt.batching.surface import LIGHTNING_SURFACE


@pytest.mark.parametrize(("owner", "name"), LIGHTNING_NAMES, ids=lambda x: getattr(x, "__name__", x))
def test_each_lightning_name_read_outside_the_engine_exists(owner, name):
    assert has_name(owner, name), f"{owner.__name__}.{name} is gone: update lightning_memopt/_lightning.py"


def test_the_names_exist_on_a_live_trainer():
    # has_name reads __init__'s source for instance attributes: check the real objects agree.
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    source = trainer.fit_loop._data_source
    assert isinstance(trainer.fit_loop, _FitLoop) and isinstance(source, _DataLoaderSource)
    assert source.instance is None  # set by fit(): the loaders or the module that makes them


def test_has_name_finds_class_attributes_fields_and_init_assignments_only():
    class Plain:
        kind = "class attribute"

        def __init__(self):
            self.assigned = 1

    assert has_name(Plain, "kind") and has_name(Plain, "assigned")
    assert has_name(_DataLoaderSource, "instance") and has_name(_DataLoaderSource, "name")
    assert not has_name(Plain, "missing")
    assert not has_name(_FitLoop, "_no_such_source")


def test_the_one_list_holds_the_engines_names_too():
    assert set(LIGHTNING_SURFACE) <= set(LIGHTNING_NAMES) and (_FitLoop, "_data_source") in LIGHTNING_NAMES
