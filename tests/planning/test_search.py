"""The best-first search finds the cheapest configuration that fits, as brute force over the grid does."""

from __future__ import annotations

import pytest

from lightning_memopt.planning.build import build_fake, fake_mode, parse_batch_spec
from lightning_memopt.planning.search import Config, Planner, Prices
from tests.oracles import brute_force_config
from tests.planning.modules import TinyLM


@pytest.fixture(scope="module")
def planner():
    mode = fake_mode()

    def build():
        return build_fake(mode, lambda: TinyLM(width=32, layers=3), what="TinyLM")

    module, batch = build(), parse_batch_spec(["4x16"], mode)
    # Micro-batches priced high, so that checkpointing plans are chosen at some budgets.
    p = Planner(
        module,
        batch,
        usable=1,
        world_size=2,
        prices=Prices(per_micro_batch=0.5),
        allow_offload=False,
        fresh=build,
    )
    with mode:
        yield mode, p


@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.35, 0.05])
def test_cheapest_equals_brute_force(planner, fraction):
    mode, p = planner
    base = p.predict(Config("32-true", 4, "ddp")).peak_bytes
    p.usable = int(base * fraction)
    best, reference = p.cheapest(), brute_force_config(p)
    if reference is None:
        assert best is None
        return
    assert best.config == reference.config
    assert best.cost == reference.cost
    assert best.peak_bytes <= p.usable
    assert all(e.cost >= best.cost for e in map(p.evaluate, p.grid()) if e.fits)


def test_checkpointing_is_chosen_and_its_peak_is_a_fake_run(planner):
    mode, p = planner
    base = p.predict(Config("32-true", 4, "ddp")).peak_bytes
    p.usable = base - 1  # any plan that recomputes anything fits
    e = p.evaluate(Config("32-true", 4, "ddp", "recompute"))
    assert e.fits and e.plan is not None
    assert e.cost > p.base_cost(e.config)  # priced by its recompute (here pointwise bytes)
    assert set(e.plan.choices.values()) - {"keep"}
    # The prediction is the fake step with the plan applied, not the planner's estimate.
    assert e.prediction is p.predict(e.config, e.plan.choices)
    assert e.peak_bytes < base


def test_grid_and_prices():
    mode = fake_mode()
    module = build_fake(mode, lambda: TinyLM(), what="TinyLM")
    p = Planner(module, parse_batch_spec(["6x4"], mode), usable=10, precision="bf16-mixed", world_size=1)
    assert p.micro_batch_grid() == [6, 3, 2, 1]
    assert p.precisions() == ["bf16-mixed", "bf16-true"]
    assert p.strategies() == ["ddp"]
    assert p.base_cost(Config("bf16-true", 2, "ddp")) == pytest.approx(0.05 + 2 * 0.05)


def test_the_chunked_head_is_a_knob_of_causal_lms_and_the_search_agrees_with_brute_force():
    from tests.planning.modules import TinyGPT2

    mode = fake_mode()
    module = build_fake(mode, TinyGPT2, what="TinyGPT2")
    # bf16-true: one precision in the grid (precisions only go down from the configured one), so brute force
    # predicts 12 configurations (3 micro-batch sizes x 2 checkpoint modes x 2 heads), not 36
    batch = parse_batch_spec(["4x32"], mode)
    p = Planner(module, batch, usable=1, precision="bf16-true", allow_offload=False)
    with mode:
        assert p.heads() == ["own", "chunked"]
        assert {c.head for c in p.grid()} == {"own", "chunked"} and len(p.grid()) == 12
        own = p.predict(Config("bf16-true", 4, "ddp"))
        chunked = p.predict(Config("bf16-true", 4, "ddp", head="chunked"))
        assert chunked.peak_bytes < own.peak_bytes
        assert chunked.head_bytes < own.head_bytes
        assert p.base_cost(Config("bf16-true", 4, "ddp", head="chunked")) == Prices().chunked_head == 0.0
        p.usable = chunked.peak_bytes  # only the chunked head fits without another change
        best, reference = p.cheapest(), brute_force_config(p)
        assert best.config == reference.config == Config("bf16-true", 4, "ddp", head="chunked")


def test_a_recompute_plan_that_cannot_fit_names_what_the_step_holds_outside_the_blocks(planner):
    """Where the step outside the blocks (its states and the activations outside them) leaves the blocks
    nothing, recompute cannot help: the note says what those bytes are, not that the states alone fill it
    (an output head's logits, 19.6 GiB of a 1.3B-shaped step's 23.7, made that note false)."""
    mode, p = planner
    c = Config("32-true", 4, "ddp", "recompute")
    base = p.predict(Config("32-true", 4, "ddp"))
    p.usable = base.record["optimizer"] + 1  # the optimizer step fits; with the activations outside the
    # blocks beside the states, nothing does
    e = p.evaluate(c)
    assert not e.fits and e.plan is None
    assert e.note.startswith("what the step holds outside the blocks (") and e.note.endswith(") does not fit")
