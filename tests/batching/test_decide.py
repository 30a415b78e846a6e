"""The first batch's search decides whether to recompute at all, by the step time it measures."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_memopt.batching.errors import MicroBatchOOMError
from lightning_memopt.batching.sizes import MicroBatchSizes
from lightning_memopt.batching.split import micro_batch_sizes

HELD = 1_000


class FakeModel:
    """Blocks that hold ``kept`` bytes a sample kept, ``recomputed`` when recomputed; a micro-step costs
    ``launch + per_sample * n`` seconds kept, ``recompute`` more per sample when recomputed. With
    ``logits`` (bytes a sample), a chunked output head was installed: the model's own head (``"own head"``)
    holds ``logits`` more a sample and costs ``chunked`` less a sample than the chunked one. The trial's
    plan (``"plan"``: every block recomputed at its first turn, ``"full"``) recomputes ``planned`` of
    what recomputing every block does."""

    def __init__(
        self,
        *,
        kept=100,
        recomputed=25,
        launch=1.0,
        per_sample=0.1,
        recompute=0.03,
        logits=None,
        chunked=0.02,
        planned=1.0,
    ) -> None:
        self.kept, self.recomputed = kept, recomputed
        self.launch, self.per_sample, self.recompute = launch, per_sample, recompute
        self.logits, self.chunked, self.planned = logits, chunked, planned
        self.has_plan = False  # the trial's plan was made (AutoCheckpoint's state keeps it)
        self.own_head = logits is not None
        self.way = "full"  # AutoCheckpoint installs every block full before the first step
        self.said: list[tuple[str, str]] = []
        self.used: list[str] = []

    def seconds(self, samples: int) -> float:
        """A micro-step of ``samples`` in the way used now."""
        extra = self.recompute * samples * {"full": 1.0, "plan": self.planned}.get(self.way, 0.0)
        if self.own_head and self.way != "own head":
            extra += self.chunked * samples
        return self.launch + self.per_sample * samples + extra

    # Recompute (AutoCheckpoint's side)
    def use(self, way: str) -> None:
        self.way = way
        self.used.append(way)

    def try_plan(self, kept_peak=None) -> None:
        self.way = "plan" if self.has_plan else "full"
        self.has_plan = True
        self.used.append(self.way)
        self.kept_peak = kept_peak

    def decided(self, way: str, why: str, kept_peak=None) -> None:
        self.way = way
        self.said.append((way, why))
        self.kept_peak = kept_peak


class FakeProbes:
    device = torch.device("cpu")
    floor = 1
    evaluates = False
    seconds: float | None = None

    def __init__(self, model: FakeModel) -> None:
        self.model = model
        self.timed: list[tuple[str, int]] = []
        self.probed: list[tuple[str, int]] = []

    def peak(self, samples: int, evaluation: bool) -> int:
        m = self.model
        self.probed.append((m.way, samples))
        self.seconds = m.seconds(samples)
        per = {
            "own head": m.kept + (m.logits or 0),
            "keep": m.kept,
            "full": m.recomputed,
            "plan": m.recomputed,
        }[m.way]
        return HELD + samples * per

    def held(self) -> int:
        return HELD


def _decide(
    model: FakeModel,
    limit: int,
    total: int = 64,
    probes: FakeProbes | None = None,
    slower: dict[int, float] | None = None,
) -> tuple[MicroBatchSizes, int, FakeProbes]:
    """Steps of a batch of ``total`` until the decision is made: the search, then the trial's steps, each
    timed as the engine times one (its micro-steps' seconds together; ``slower``: by trial step, a factor
    its seconds read, a busy machine's); ``probes.timed`` gets each trial step's way and micro-batch."""
    sizes = MicroBatchSizes(max_memory=limit, headroom=0.0)
    sizes.recompute = model
    probes = probes or FakeProbes(model)
    while True:
        size, _, _ = sizes.plan(total=total, width=1, probes=probes)
        if not sizes.timing:
            return sizes, size, probes
        split = micro_batch_sizes(total, size)
        seconds = sum(model.seconds(n) for n in split) * (slower or {}).get(len(probes.timed), 1.0)
        probes.timed.append((model.way, max(split)))
        sizes.succeeded(retried=False, total=total, size=size, seconds=seconds)


def test_plain_micro_batches_win_where_larger_ones_gain_less_than_recompute_costs():
    # Time per sample falls a little with the size (a launch cost of 0.05 s a micro-step): recompute's one
    # micro-batch saves 3 launches, 0.15 s of 6.6, and costs 1.92 s.
    model = FakeModel(launch=0.05)
    sizes, size, probes = _decide(model, limit=HELD + 1_600)  # 16 kept, 64 recomputed
    assert size == 16 and model.way == "keep"
    # optimizer steps, taking turns, two each: recompute's first (the fit's first step) planned, its others
    # ran the plan
    assert probes.timed == [("full", 64), ("keep", 16), ("plan", 64), ("keep", 16), ("plan", 64)]
    # The recomputed search starts where the kept one ended (16 samples fit kept), not at one sample.
    first_full = next(i for i, (way, _) in enumerate(probes.probed) if way == "full")
    # Its next probe comes from the bytes the kept search measured not to grow with the size (its line's
    # intercept, 1,000 here): the line through them and 16's peak crosses the limit at 64, the whole batch.
    assert probes.probed[first_full:] == [("full", 16), ("full", 64)]
    # 8 and 16, the sizes the kept micro-step's line is drawn through, each timed once more (warm)
    searched = [("keep", 1), ("keep", 2), ("keep", 5), ("keep", 8), ("keep", 16)]
    assert probes.probed[:first_full] == [*searched, ("keep", 8), ("keep", 16)]
    assert model.said == [
        (
            "keep",
            "4 micro-batches of 16 without recompute: 6.6 s a step; 1 of 64 with the least recompute that fits "
            "them: 8.37 s",
        )
    ]
    assert sizes.step_seconds == pytest.approx(6.6)
    assert sizes.recompute is None  # decided once; nothing stays attached


def test_a_micro_step_costing_what_its_samples_do_is_neither_recomputed_nor_tried():
    # Time per sample does not fall with the size (no launch cost), as the search's timed probes measure:
    # fewer micro-batches save nothing, so recompute is neither searched nor profiled nor tried.
    model = FakeModel(launch=0.0)
    sizes, size, probes = _decide(model, limit=HELD + 1_600)  # 16 kept, 64 recomputed
    assert size == 16 and model.way == "keep" and model.used == ["keep"]
    searched = [("keep", 1), ("keep", 2), ("keep", 5), ("keep", 8), ("keep", 16)]
    assert probes.probed == [*searched, ("keep", 8), ("keep", 16)]  # the line's two sizes timed again
    # the step's seconds as the probes predict them: 4 micro-steps of 16 samples at 0.1 s each
    assert probes.timed == [] and sizes.step_seconds == pytest.approx(6.4)
    assert model.said == [
        (
            "keep",
            "4 micro-batches of 16 without recompute: fewer, larger micro-batches would save at most 0.0% of "
            "the step (a micro-step: 0.8 s at 8 samples, 1.6 s at 16)",
        )
    ]
    # With a launch cost of 0.02 s, one micro-batch would save 3 of them, 0.06 s of 6.48 (0.9%): still not
    # tried; of 0.03 s, 0.09 of 6.52 (1.4%): not; of 0.04 s, 0.12 of 6.56 (1.8%): not; 0.05 s: 2.3%, tried.
    for launch, tried in [(0.02, False), (0.03, False), (0.04, False), (0.05, True)]:
        model = FakeModel(launch=launch)
        _, _, probes = _decide(model, limit=HELD + 1_600)
        assert bool(probes.timed) is tried, launch
        assert ("full", 16) in probes.probed if tried else all(way == "keep" for way, _ in probes.probed)


def test_a_way_that_fits_two_samples_times_its_first_probe_again_to_tell():
    # The model's own head fits 2 samples (100 + 600 bytes a sample of 1,600): its search probes 1 and 2;
    # the first probe pays first-time costs and is left out; the line's two sizes, 1 and 2, are timed once
    # more (warm): a micro-step costs its samples alone, and neither the chunked head nor recompute is
    # searched or tried.
    model = FakeModel(logits=600, launch=0.0)
    sizes, size, probes = _decide(model, limit=HELD + 1_600)
    retimed = [("own head", 1), ("own head", 2), ("own head", 1), ("own head", 2)]
    assert probes.probed == retimed and probes.timed == []
    assert size == 2 and model.said == [
        (
            "own head",
            "32 micro-batches of 2 with the model's own head: fewer, larger micro-batches would save at most "
            "0.0% of the step (a micro-step: 0.1 s at 1 sample, 0.2 s at 2)",
        )
    ]
    assert sizes.step_seconds == pytest.approx(6.4)
    # with a launch cost, the same probes tell that fewer micro-batches would pay: the later ways are tried
    model = FakeModel(logits=600, launch=1.0)
    _, _, probes = _decide(model, limit=HELD + 1_600)
    assert probes.probed[:4] == retimed and probes.timed


def test_a_slow_run_of_a_size_the_line_is_drawn_through_is_outvoted_by_its_warm_run():
    # No launch cost: a micro-step costs its samples alone. The kept search's first run of 8 samples reads
    # 0.3 s slow (a busy moment, a shape's first run): the line through 8 and 16 would cross at 0.6 s a
    # micro-step, 1.8 s of 8.8 to save in 1 micro-batch instead of 4, and the later ways would be tried.
    # Each of the two sizes is timed once more and counted at its faster run: nothing to save, no trial.
    model = FakeModel(launch=0.0)
    probes = FakeProbes(model)
    peak, slow = probes.peak, {8: 0.3}

    def slowed(samples: int, evaluation: bool) -> int:
        bytes_ = peak(samples, evaluation)
        probes.seconds += slow.pop(samples, 0.0)
        return bytes_

    probes.peak = slowed
    sizes, size, probes = _decide(model, limit=HELD + 1_600, probes=probes)
    assert size == 16 and model.used == ["keep"] and probes.timed == []
    assert probes.probed[-2:] == [("keep", 8), ("keep", 16)]
    assert (
        "would save at most 0.0% of the step (a micro-step: 0.8 s at 8 samples, 1.6 s at 16)"
        in model.said[0][1]
    )
    # counted at its slow run, the same search tries the later ways
    model = FakeModel(launch=0.0)
    probes = FakeProbes(model)
    peak = probes.peak

    def always_slow_at_8(samples: int, evaluation: bool) -> int:
        bytes_ = peak(samples, evaluation)
        probes.seconds += 0.3 if samples == 8 else 0.0
        return bytes_

    probes.peak = always_slow_at_8
    _, _, probes = _decide(model, limit=HELD + 1_600, probes=probes)
    assert probes.timed  # the trial ran


def test_a_trial_whose_steps_spread_more_than_a_way_saves_runs_another_round():
    # kept: 4 micro-steps of 16 at 0.5 + 1.6 s, 8.4 s a step; the plan recomputes half of what every block
    # recomputed costs: one micro-step of 64 at 0.5 + 6.4 + 0.96 s, 7.86 s: 6.4% saved.
    model = FakeModel(launch=0.5, planned=0.5)
    turns = [("full", 64), ("keep", 16), ("plan", 64), ("keep", 16), ("plan", 64)]
    sizes, _, probes = _decide(model, limit=HELD + 1_600)
    assert probes.timed == turns and model.way == "full"  # steady steps: two rounds tell
    assert sizes.step_seconds == pytest.approx(7.86)
    # The kept way's second step reads 8% slow (a busy moment): 6.4% saved lies within 8% of the 2% bar,
    # the same steps again could choose the other way: a third round, whose kept step reads 8.4 again.
    model = FakeModel(launch=0.5, planned=0.5)
    _, _, probes = _decide(model, limit=HELD + 1_600, slower={3: 1.08})
    assert probes.timed == [*turns, ("keep", 16), ("plan", 64)] and model.way == "full"
    assert "4 micro-batches of 16 without recompute: 8.4 s a step" in model.said[0][1]
    # A spread that stays: at most two rounds more, then the fastest steps decide
    model = FakeModel(launch=0.5, planned=0.5)
    _, _, probes = _decide(model, limit=HELD + 1_600, slower={3: 1.08, 5: 1.16, 7: 1.24})
    assert len(probes.timed) == 1 + 2 * 4 and model.way == "full"
    # A saving well beyond the spread (recompute's whole cost: 9.32 s against 10.4, 10.4% saved; spread 5%)
    model = FakeModel(launch=1.0)
    _, _, probes = _decide(model, limit=HELD + 1_600, slower={3: 1.05})
    assert len(probes.timed) == 5 and model.way == "full"
    # A first step's one-time cost (a compile: 3x) counts as a spread of 15% at most: 10.4% saved, decided
    model = FakeModel(launch=1.0)
    _, _, probes = _decide(model, limit=HELD + 1_600, slower={1: 3.0})
    assert len(probes.timed) == 7 and model.way == "full"  # within 15% of the bar: one round more


def test_recompute_wins_where_larger_micro_batches_run_faster_per_sample():
    model = FakeModel(launch=1.0)
    sizes, size, _ = _decide(model, limit=HELD + 1_600)
    # keep: 4 x (1 + 1.6) = 10.4 s; full: 1 x (1 + 6.4 + 1.92) = 9.32 s
    assert size == 64 and model.way == "full"
    assert model.said[0][0] == "full" and sizes.step_seconds == pytest.approx(9.32)
    # every probe of the chosen way is kept for the shape model, none of the other's
    assert sizes.probes and all(peak == HELD + 25 * s for s, peak in sizes.probes)
    # What AutoCheckpoint plans with: the peaks measured with every block kept, and between or beyond them
    # the line through the two nearest (a sample kept holds 100 bytes here): the peak the fake would measure.
    assert all(model.kept_peak(s) == HELD + 100 * s for s in [1, 3, 16, 50, 64])


def test_the_whole_batch_fitting_kept_is_never_timed_nor_recomputed():
    model = FakeModel()
    _, size, probes = _decide(model, limit=HELD + 100 * 64)
    assert size == 64 and model.way == "keep" and probes.timed == []
    assert model.used == ["keep"] and model.said == [("keep", "the whole batch of 64 fits without recompute")]


def test_recompute_where_not_one_sample_fits_kept():
    model = FakeModel(kept=10_000)
    _, size, probes = _decide(model, limit=HELD + 1_600)
    assert size == 64 and model.way == "full" and probes.timed == []
    # the line says what the smallest probe measured against what the limit leaves (1,000 held + 10,000 kept)
    why = "not one sample fits without recompute (1 sample peaked at 10.74 KiB, over 2.54 KiB)"
    assert model.said == [("full", why)]


def test_nothing_fits_either_way_raises_and_leaves_blocks_recomputed():
    model = FakeModel(kept=10_000, recomputed=5_000)
    sizes = MicroBatchSizes(max_memory=HELD + 1_000, headroom=0.1)
    sizes.recompute = model
    # the error names the least limit that fits: one sample recomputed peaks at 1,000 + 5,000 bytes
    least = r"1 sample a micro-batch, peaked at 5.86 KiB: max_memory=6667 \(6.51 KiB\) or more fits it"
    with pytest.raises(
        MicroBatchOOMError, match=f"with or without recomputing every block. The least.*{least}"
    ):
        sizes.plan(total=64, width=1, probes=FakeProbes(model))
    assert model.way == "full" and sizes.recompute is None
    # and it does: one sample a micro-batch, recomputed
    fits = MicroBatchSizes(max_memory=6667, headroom=0.1)
    fits.recompute = FakeModel(kept=10_000, recomputed=5_000)
    assert fits.plan(total=64, width=1, probes=FakeProbes(fits.recompute))[0] == 1
    with pytest.raises(MicroBatchOOMError):  # a byte less does not
        MicroBatchSizes(max_memory=6666, headroom=0.1).plan(total=64, width=1, probes=FakeProbes(model))


def test_without_an_offer_the_search_is_as_before():
    model = FakeModel()
    sizes = MicroBatchSizes(max_memory=HELD + 1_600, headroom=0.0)
    size, _, _ = sizes.plan(total=64, width=1, probes=FakeProbes(model))
    assert size == 64 and model.used == [] and model.way == "full"  # probed as installed
    assert math.isclose(sizes.probes[-1][1], HELD + 64 * 25)


def test_recompute_is_priced_by_its_plan_not_by_every_block_recomputed():
    # keep: 4 x (0.3 + 1.6) = 7.6 s; every block recomputed: 1 x (0.3 + 6.4 + 1.92) = 8.62 s, slower; the plan
    # for 64 recomputes a quarter of that: 0.3 + 6.4 + 0.48 = 7.18 s, faster. Priced as every block
    # recomputed, plain micro-batches would run at 7.6 s where the plan runs at 7.18.
    model = FakeModel(launch=0.3, planned=0.25)
    sizes, size, probes = _decide(model, limit=HELD + 1_600)
    assert probes.timed == [("full", 64), ("keep", 16), ("plan", 64), ("keep", 16), ("plan", 64)]
    assert size == 64 and model.said == [
        (
            "full",
            "4 micro-batches of 16 without recompute: 7.6 s a step; 1 of 64 with the least recompute that fits "
            "them: 7.18 s",
        )
    ]
    assert sizes.step_seconds == pytest.approx(7.18)


def test_a_later_way_runs_only_where_it_saves_more_than_two_percent_of_the_step():
    # keep: 4 x (0.3 + 1.6) = 7.6 s; the plan for 64: 0.3 + 6.4 + 1.92 x planned. A plan 1% faster (7.53 s)
    # is within what a trial on a shared machine reads as noise: the blocks keep; 3% faster (7.37 s), it runs.
    for planned, way, seconds in [(0.43, "keep", 7.6), (0.35, "full", 7.372)]:
        model = FakeModel(launch=0.3, planned=planned)
        sizes, _, probes = _decide(model, limit=HELD + 1_600)
        assert probes.timed == [("full", 64), ("keep", 16), ("plan", 64), ("keep", 16), ("plan", 64)]
        assert model.said[0][0] == way and sizes.step_seconds == pytest.approx(seconds)


def test_each_way_is_timed_at_the_micro_batch_that_runs():
    # 15 samples fit kept: a batch of 48 runs as 4 x 12, so the kept way is timed at 12, not 15; 48 fit
    # recomputed (one micro-step).
    model = FakeModel(launch=1.0)
    sizes, size, probes = _decide(model, limit=HELD + 1_500, total=48)
    assert probes.timed == [("full", 48), ("keep", 12), ("plan", 48), ("keep", 12), ("plan", 48)]
    # keep: 4 x (1 + 1.2) = 8.8 s; full: 1 x (1 + 4.8 + 1.44) = 7.24 s
    assert model.said[0] == (
        "full",
        "4 micro-batches of 12 without recompute: 8.8 s a step; 1 of 48 with the least recompute that fits "
        "them: 7.24 s",
    )


def test_recompute_that_runs_as_many_micro_batches_is_not_timed():
    # 12 samples fit kept and 13 recomputed: both run a batch of 48 as 4 micro-batches; recomputing each
    # can only be slower, so nothing is timed and nothing recomputes.
    model = FakeModel(recomputed=90)
    sizes, size, probes = _decide(model, limit=HELD + 1_200, total=48)
    assert (size, model.way, probes.timed) == (12, "keep", [])
    assert model.said == [("keep", "recomputing runs the step in no fewer micro-batches")]


def test_the_model_own_head_where_the_whole_batch_fits_with_it():
    model = FakeModel(logits=50)
    _, size, probes = _decide(model, limit=HELD + 150 * 64)
    assert size == 64 and model.used == ["own head"] and probes.timed == []
    assert model.said == [("own head", "the whole batch of 64 fits with the model's own head")]


def test_the_model_own_head_where_the_chunked_head_runs_no_fewer_micro_batches():
    # own head: 150 bytes a sample, 10 fit: 7 micro-batches of 64 (10 or 9 each), 7 x 0.05 + 64 x 0.1 = 6.75 s;
    # chunked: 100, 15 fit: 5 of 13, 5 x 0.05 + 64 x 0.12 = 7.93 s; recomputed: 95, 15 fit: no fewer than 5.
    model = FakeModel(logits=50, recomputed=95, launch=0.05)
    _, size, probes = _decide(model, limit=HELD + 1_500)
    assert probes.timed == [("own head", 10), ("keep", 13)] * 2 and size == 10
    assert model.said == [
        (
            "own head",
            "7 micro-batches of 10 with the model's own head: 6.75 s a step; 5 of 13 with the chunked head, "
            "without recompute: 7.93 s",
        )
    ]
    # own head: 115 a sample, 13 fit: 5 micro-batches, as many as chunked (15) and recomputed (15): untimed
    model = FakeModel(logits=15, recomputed=95)
    _, size, probes = _decide(model, limit=HELD + 1_500)
    assert (size, probes.timed) == (13, [])
    assert model.said == [
        ("own head", "the chunked head and recomputing run the step in no fewer micro-batches")
    ]


def test_the_chunked_head_where_its_larger_micro_batches_make_the_step_faster():
    # A step's seconds: its micro-steps' together. own head: 400 bytes a sample, 3 fit: 22 micro-batches of
    # 64 (20 of 3, 2 of 2), 20 x 1.3 + 2 x 1.2 = 28.4 s; chunked, kept: 15 fit: 13, 13, 13, 13 and 12,
    # 4 x 2.56 + 2.44 = 12.7 s; recomputed: 60 fit: 2 x 32, 2 x (1 + 3.2 + 0.96 + 0.64) = 11.6 s (the
    # search stops at 32: 33 to 60 would run 2 micro-batches all the same)
    model = FakeModel(logits=300)
    _, size, probes = _decide(model, limit=HELD + 1_500)
    assert probes.timed == [("full", 32)] + [("own head", 3), ("keep", 13), ("plan", 32)] * 2
    assert model.said == [
        (
            "full",
            "22 micro-batches of 3 with the model's own head: 28.4 s a step; 5 of 13 with the chunked head, "
            "without recompute: 12.7 s; 2 of 32 with the least recompute that fits them: 11.6 s",
        )
    ]
    assert size == 32 and all(model.kept_peak(s) == HELD + 100 * s for s in [1, 13])  # the chunked head's


def test_the_ways_take_turns_at_real_steps_and_each_way_s_fastest_step_counts():
    """The search ends with recompute in use, every block recomputed (nothing timed apart from training):
    that turn, the fit's first step, measures the step for the plan and does not price it; the ways then
    take turns at the next steps, two each, recompute's running its plan; the step after the last runs the
    fastest way, each priced at its fastest step (the first of a way pays first-time costs: here 5 s
    more). A step that trained without seconds measured does not end its turn."""
    model = FakeModel(launch=1.0)
    sizes = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)
    sizes.recompute = model
    probes = FakeProbes(model)
    ran = []
    for seconds in (5.0, None, 8.8 + 5, 7.24 + 5, 8.8, 7.24, 7.24):
        size, count, _ = sizes.plan(total=48, width=1, probes=probes)
        ran.append((model.way, size, count, sizes.timing))
        sizes.succeeded(retried=False, total=48, size=size, seconds=seconds)
    keep, full, plan = ("keep", 12, 4, True), ("full", 48, 1, True), ("plan", 48, 1, True)
    assert ran == [full, keep, keep, plan, keep, plan, ("full", 48, 1, False)]
    assert model.used[-5:] == ["full", "keep", "plan", "keep", "plan"]  # the trial's (the search's before)
    assert model.said == [
        (
            "full",
            "4 micro-batches of 12 without recompute: 8.8 s a step; 1 of 48 with the least recompute that fits "
            "them: 7.24 s",
        )
    ]  # not the 5 s of the step that planned
    assert sizes.recompute is None and sizes.step_seconds == pytest.approx(7.24)
    # The shape model is the way's that runs: after the decision, the recomputed probes' (25 bytes a sample)
    assert all(peak == HELD + 25 * s for s, peak in sizes.probes)


def test_trial_steps_on_batches_of_other_lengths_are_priced_as_the_first_batch():
    """Seconds per token: a step of half the tokens a sample (or half the samples) that took half the time
    costs as much as the first batch's; a way is not faster for the shorter batch it happened to get."""
    model = FakeModel(launch=1.0)
    sizes = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)  # the first batch: 8 tokens a sample
    sizes.recompute = model
    probes = FakeProbes(model)
    # recomputing, as planned: 4.5 s twice for half the tokens a sample, 9 s as the first batch; kept: 9 s,
    # then 4.4 s for half the samples, 8.8 s as the first batch. Taken as measured, recompute would win at
    # 4.5 s. (Its first turn, which planned, prices nothing.)
    for width, total, seconds in [(8, 48, 9.5), (8, 48, 9.0), (4, 48, 4.5), (8, 24, 4.4), (4, 48, 4.5)]:
        size, _, _ = sizes.plan(total=total, width=width, probes=probes)
        sizes.succeeded(retried=False, total=total, size=size, seconds=seconds)
    sizes.plan(total=48, width=8, probes=probes)
    assert model.said[0][0] == "keep" and sizes.step_seconds == pytest.approx(8.8)
    assert (
        "without recompute: 8.8 s a step; 1 of 48 with the least recompute that fits them: 9 s"
        in (model.said[0][1])
    )


def test_a_run_resumed_during_the_trial_goes_on_with_it():
    """A checkpoint saved after the trial's second step: the resumed sizes run the trial's next turns
    (the way applied again first), with the seconds saved, and take the same decision as the run that
    went on; nothing is searched again."""

    def steps(sizes: MicroBatchSizes, model: FakeModel, probes: FakeProbes, n: int, seconds: dict) -> list:
        ran = []
        for _ in range(n):
            size, count, _ = sizes.plan(total=48, width=1, probes=probes)
            ran.append((model.way, size, count))
            sizes.succeeded(retried=False, total=48, size=size, seconds=seconds[model.way])
        return ran

    seconds = {"keep": 8.8, "full": 7.24, "plan": 7.24}
    model = FakeModel(launch=1.0)
    sizes = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)
    sizes.recompute = model
    probes = FakeProbes(model)
    first = steps(sizes, model, probes, 2, seconds)
    saved = sizes.state()
    went_on = steps(sizes, model, probes, 5, seconds)

    resumed_model = FakeModel(launch=1.0)
    resumed_model.way = "keep"  # what a resumed AutoCheckpoint installs is not the way the trial is at
    resumed_model.has_plan = True  # the trial's plan, made at the step before the save: in its state
    resumed = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)
    resumed.load(torch.load(_saved(saved), weights_only=True))  # through a checkpoint file's round trip
    resumed.recompute = resumed_model
    resumed_probes = FakeProbes(resumed_model)
    assert resumed.probed and resumed.timing
    assert steps(resumed, resumed_model, resumed_probes, 5, seconds) == went_on
    assert (
        first + went_on == [("full", 48, 1)] + [("keep", 12, 4), ("plan", 48, 1)] * 2 + [("full", 48, 1)] * 2
    )
    assert resumed_probes.probed == [] and resumed_model.said == model.said
    assert resumed.step_seconds == sizes.step_seconds == pytest.approx(7.24)


def test_a_run_resumed_during_a_round_the_trial_added_goes_on_with_it():
    """The trial added a round (the kept way's steps read 8.0 and 8.6 s, the plan's 7.7: 3.75% saved lies
    within that 7.5% spread of the 2% bar); a checkpoint saved in that round resumes it, to the same
    decision."""
    readings = {"keep": [8.0, 8.6, 8.0, 8.0], "plan": [7.7, 7.7, 7.7, 7.7], "full": [9.0]}

    def steps(sizes: MicroBatchSizes, model: FakeModel, probes: FakeProbes, n: int, taken: dict) -> list:
        ran = []
        for _ in range(n):
            size, count, _ = sizes.plan(total=48, width=1, probes=probes)
            ran.append((model.way, size, count))
            seconds = None
            if sizes.timing:
                seconds = readings[model.way][taken.get(model.way, 0)]
                taken[model.way] = taken.get(model.way, 0) + 1
            sizes.succeeded(retried=False, total=48, size=size, seconds=seconds)
        return ran

    model = FakeModel(launch=1.0)
    sizes = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)
    sizes.recompute = model
    probes, taken = FakeProbes(model), {}
    first = steps(sizes, model, probes, 6, taken)  # the planning turn, two rounds, the added round's first
    assert sizes._trial is not None and sizes._trial.rounds == 3
    saved, taken_then = sizes.state(), dict(taken)
    went_on = steps(sizes, model, probes, 3, taken)

    resumed_model = FakeModel(launch=1.0)
    resumed_model.way, resumed_model.has_plan = "keep", True
    resumed = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)
    resumed.load(torch.load(_saved(saved), weights_only=True))
    resumed.recompute = resumed_model
    assert steps(resumed, resumed_model, FakeProbes(resumed_model), 3, taken_then) == went_on
    assert first + went_on == (
        [("full", 48, 1)] + [("keep", 12, 4), ("plan", 48, 1)] * 3 + [("full", 48, 1)] * 2
    )
    assert resumed_model.said == model.said and resumed.step_seconds == pytest.approx(7.7)


def _saved(state: dict):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_a_way_that_runs_out_of_memory_at_one_sample_during_the_trial_leaves_it_to_recompute():
    """A longer batch than the first, during the trial: the model's own head cannot run one sample of it.
    The fit goes on: the trial ends, and recompute (which holds the least) runs from the retry on, where
    the error said that splitting further could not help; recompute itself failing there still raises."""
    model = FakeModel(logits=300)  # own head: 3 fit; the chunked head: 13; recomputed: 32 (of 64)
    sizes = MicroBatchSizes(max_memory=HELD + 1_500, headroom=0.0)
    sizes.recompute = model
    probes = FakeProbes(model)
    size, _, _ = sizes.plan(total=64, width=1, probes=probes)  # the search, then the planning turn
    assert (model.way, size) == ("full", 32)
    sizes.succeeded(retried=False, total=64, size=size, seconds=10.0)
    size, _, _ = sizes.plan(total=64, width=1, probes=probes)
    assert (model.way, size) == ("own head", 3)
    sizes.failed(1, total=64, floor=1, failure="OutOfMemoryError")  # backed off to 1, out of memory again
    assert sizes.plan(total=64, width=1, probes=probes)[0] == 32  # the retry, every rank agreeing
    assert not sizes.timing and model.way == "full"
    assert model.said == [
        (
            "full",
            "the trial's step with the model's own head ran out of memory at the fewest samples: with the "
            "least recompute that fits them from now on",
        )
    ]
    with pytest.raises(MicroBatchOOMError, match="one sample per micro-batch"):
        sizes.failed(1, total=64, floor=1, failure="OutOfMemoryError")
