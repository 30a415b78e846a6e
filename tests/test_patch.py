"""lightning_memopt._patch: instance-level method patches that stack and come off in any order."""

import pickle

from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_memopt._patch import patch


class Thing:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def step(self, x: int) -> int:
        self.calls.append("step")
        return x + 1


def tagging(tag: str):
    def wrapper(original, *args, **kwargs):
        return original(*args, **kwargs) * 10 if tag == "x10" else original(*args, **kwargs) + 100

    return wrapper


def test_patch_wraps_and_undo_restores_the_instance():
    thing = Thing()
    undo = patch(thing, "step", tagging("x10"))
    assert thing.step(1) == 20
    assert "step" in vars(thing)
    undo()
    assert "step" not in vars(thing)
    assert thing.step(1) == 2
    undo()  # twice is safe
    assert "step" not in vars(thing)
    pickle.dumps(thing)  # nothing local left on it


def test_patches_stack_and_come_off_in_any_order():
    thing = Thing()
    undo_inner = patch(thing, "step", tagging("x10"))
    undo_outer = patch(thing, "step", tagging("+100"))
    assert thing.step(1) == 120  # (1 + 1) * 10 + 100
    undo_inner()  # the inner one now only passes calls on
    assert thing.step(1) == 102
    undo_outer()
    assert "step" not in vars(thing)
    assert thing.step(1) == 2


def test_removing_the_outer_patch_first_keeps_the_inner_one():
    thing = Thing()
    undo_inner = patch(thing, "step", tagging("x10"))
    undo_outer = patch(thing, "step", tagging("+100"))
    undo_outer()
    assert thing.step(1) == 20
    undo_inner()
    assert "step" not in vars(thing)


def test_patch_over_an_instance_attribute_puts_it_back():
    thing = Thing()
    thing.step = lambda x: x - 1
    own = thing.step
    undo = patch(thing, "step", tagging("x10"))
    assert thing.step(1) == 0
    undo()
    assert thing.step is own


def test_a_patched_hook_counts_as_overridden_so_lightning_calls_it():
    """AutoCheckpoint patches ``configure_model`` to act after it; Lightning calls that hook only if the
    module overrides it."""
    from lightning.pytorch import LightningModule

    class Without(LightningModule):
        pass

    module = Without()
    assert not is_overridden("configure_model", module)
    undo = patch(module, "configure_model", lambda original, *a, **k: original(*a, **k))
    assert is_overridden("configure_model", module)
    undo()
    assert not is_overridden("configure_model", module)
