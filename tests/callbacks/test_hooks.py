import itertools

import pytest

from lightning_memopt.callbacks._hooks import wrap_instance_hook


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
