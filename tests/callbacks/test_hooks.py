import itertools

import pytest

from lightning_memopt.callbacks._hooks import Attachments, forget_module, wrap_instance_hook


class Module:
    def configure_model(self):
        calls.append("original")


calls: list[str] = []


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_wrappers_nest_and_unwrap_in_any_order(order):
    module = Module()
    removers = [
        wrap_instance_hook(module, "configure_model", after=lambda i=i: calls.append(f"after{i}"))
        for i in range(3)
    ]
    calls.clear()
    module.configure_model()
    assert calls == ["original", "after0", "after1", "after2"]
    for step, i in enumerate(order):
        removers[i]()
        calls.clear()
        module.configure_model()
        alive = sorted(set(range(3)) - set(order[: step + 1]))
        assert calls == ["original"] + [f"after{j}" for j in alive]
    assert "configure_model" not in vars(module)  # the instance is as it was


def test_before_gets_the_arguments_and_an_existing_instance_attribute_comes_back():
    module = Module()
    own = lambda: calls.append("own")  # noqa: E731
    module.configure_model = own
    seen = []
    remove = wrap_instance_hook(module, "configure_model", before=lambda *a, **k: seen.append((a, k)))
    module.configure_model()
    assert seen == [((), {})]
    remove()
    assert module.configure_model is own


def test_attachments_detach_everything_once_and_the_model_methods_lightning_bound():
    module, other = Module(), Module()
    attached = Attachments()
    attached.wrap(module, "configure_model", after=lambda: calls.append("after"))
    attached.wrap(module, "configure_model", after=lambda: calls.append("twice"))  # same hook: ignored
    attached.wrap(other, "configure_model", before=lambda: calls.append("before"))
    calls.clear()
    module.configure_model()
    other.configure_model()
    assert calls == ["original", "after", "before", "original"]

    class Callback:
        pass

    callback = Callback()
    callback.log, callback.log_dict = (
        Module().configure_model,
        Module().configure_model,
    )  # bound, as Lightning does
    attached.detach(callback)
    attached.detach(callback)  # a second call (teardown after on_exception) does nothing
    assert "configure_model" not in vars(module) and "configure_model" not in vars(other)
    assert "log" not in vars(callback) and "log_dict" not in vars(callback)


def test_forget_module_keeps_values_that_are_not_bound_methods():
    class Callback:
        pass

    callback = Callback()
    callback.log = True  # a user's own option under that name
    forget_module(callback)
    assert callback.log is True
