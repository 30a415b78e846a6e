import lightning.pytorch as pl
import pytest

from lightning_memopt._lightning import LIGHTNING_NAMES, has_name


@pytest.mark.parametrize(("owner", "name"), LIGHTNING_NAMES, ids=lambda x: getattr(x, "__name__", x))
def test_each_lightning_name_read_outside_the_engine_exists(owner, name):
    assert has_name(owner, name), f"{owner.__name__}.{name} is gone: update lightning_memopt/_lightning.py"


def test_the_names_exist_on_a_live_trainer():
    # has_name reads __init__'s source for instance attributes: check the real objects agree.
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    source = trainer.fit_loop._data_source
    assert isinstance(trainer.fit_loop, LIGHTNING_NAMES[0][0]) and isinstance(source, LIGHTNING_NAMES[1][0])
    assert source.instance is None  # set by fit(): the loaders or the module that makes them


def test_has_name_finds_class_attributes_fields_and_init_assignments_only():
    class Plain:
        kind = "class attribute"

        def __init__(self):
            self.assigned = 1

    assert has_name(Plain, "kind") and has_name(Plain, "assigned")
    assert has_name(LIGHTNING_NAMES[1][0], "instance") and has_name(LIGHTNING_NAMES[1][0], "name")
    assert not has_name(Plain, "missing")
    assert not has_name(LIGHTNING_NAMES[0][0], "_no_such_source")
