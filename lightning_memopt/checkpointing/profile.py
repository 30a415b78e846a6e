"""Profile blocks: what each treatment holds for backward, and what it costs to recompute.

How. The model runs forward once, recording the graph but keeping no tensor, to capture every block's
inputs (and to tell whether a block's input is the previous block's output, or is already held for
backward by an op outside the blocks). Each block is then run alone on its captured
inputs, once per treatment, forward and backward (``torch.autograd.grad``: parameters' ``.grad`` are
left alone; RNG and buffers are restored afterwards):

- activation bytes: a :class:`~lightning_memopt.memory.MemoryTracker` entered around the forward, with
  the tensors cached by selective checkpointing marked as activations (they bypass saved-tensor hooks);
  its ``activations`` bytes when the forward returns are what the block holds for backward.
- recompute cost: the compute-heavy FLOPs (:mod:`~lightning_memopt.checkpointing.flops`) and the bytes moved by every
  other op (pointwise ops are memory-bound: they cost bytes, not FLOPs) run during backward, minus the
  same numbers for ``keep``; that difference is exactly the recomputation.
- transfer bytes: bytes copied to CPU by ``offload`` (they come back, so twice that crosses the bus).
- seconds (where a clock is given): each treatment's forward and backward timed on the device, as what it
  adds over ``keep`` (:mod:`~lightning_memopt.checkpointing.timing`; plans are priced in them). A treatment
  that holds no less than ``keep`` (its input, output and the rest), which no plan can choose, is not
  timed: it is priced as a pass of the whole block.

Inputs several blocks take (an attention mask, T5's position bias, the encoder output every decoder block
attends to) are held once: they count in the first block that takes them. A Hugging Face key/value cache
is not recorded (a block re-run on its inputs would append to it again). Blocks with the same class,
configuration (``repr``), parameter shapes, input shapes and shared inputs are profiled once. Everything runs in the precision context given (autocast), so bf16 activations count half.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_memopt._text import first_line
from lightning_memopt._tree import tensors
from lightning_memopt.checkpointing.apply import apply_checkpointing, observe_saved, remove_checkpointing
from lightning_memopt.checkpointing.calls import call_signature, storage_key
from lightning_memopt.checkpointing.capture import BlockInputs, capture_block_inputs
from lightning_memopt.checkpointing.costs import CHOICES, BlockProfile, OptionCost
from lightning_memopt.checkpointing.flops import OpCounter
from lightning_memopt.checkpointing.timing import time_treatments
from lightning_memopt.checkpointing.written import Snapshot, detach_state, treatment_state
from lightning_memopt.data.clock import Clock
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.device import is_out_of_memory

__all__ = ["UnprofilableBlockError", "profile_blocks", "profile_blocks_run"]


def profile_blocks(
    model: nn.Module,
    blocks: Iterable[tuple[str, nn.Module]],
    *args,
    inputs: dict[str, BlockInputs] | None = None,
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
    choices: Iterable[str] = CHOICES,
    clock: Clock | None = None,
    **kwargs,
) -> list[BlockProfile]:
    """Profile every block under every treatment in ``choices``.

    Args:
        model: The model; run once forward on ``*args, **kwargs`` to capture block inputs, unless
            ``inputs`` (from :func:`capture_block_inputs`) are given.
        blocks: ``(name, module)`` pairs, e.g. from :func:`~lightning_memopt.checkpointing.find_blocks`.
        inputs: Captured block inputs to profile on instead of running the model.
        context: A callable returning the precision context to run under (autocast), or None.
        choices: Treatments to profile; ``keep`` is always profiled (recompute is measured against it).
        clock: Where given, each treatment is also timed on it (``OptionCost.seconds``; the extra passes
            this costs: :mod:`~lightning_memopt.checkpointing.timing`), e.g. ``step_clock(device)``.

    Returns:
        One :class:`BlockProfile` per block, in the order given.

    Raises:
        ValueError: If a block was not called by the model's forward.
        torch.OutOfMemoryError: If a block's profile ran out of memory; raised after every block was
            gathered (FSDP2), as on a rank that did not run out.

    Example::

        >>> from lightning_memopt.checkpointing import find_blocks
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
        >>> profiles = profile_blocks(model, find_blocks(model), torch.randn(4, 8))
        >>> profiles[0].options["full"].internal_bytes, profiles[0].options["full"].saves_input
        (0, True)
    """
    blocks = list(blocks)
    if inputs is None:
        inputs = capture_block_inputs(model, blocks, *args, context=context, **kwargs)
    choices = ["keep"] + [c for c in choices if c != "keep"]
    cache: dict[tuple, BlockProfile] = {}
    profiles = []
    out_of_memory = None  # where a block's profile ran out of memory: what it said
    for name, block in blocks:
        if name not in inputs:
            raise ValueError(
                f"block {name!r} was not called during the model's forward; it cannot be profiled"
            )
        captured = inputs[name]
        key = _signature(block, captured)
        # Every block is gathered, profiled or not: the ranks all-gather the same blocks in the same order,
        # also once this rank ran out of memory (another rank that did not goes on gathering).
        with _gathered(block) as call:
            if key not in cache and out_of_memory is None:
                try:
                    cache[key] = _profile_block(name, block, call, captured, choices, context, clock)
                except Exception as error:  # noqa: BLE001 - re-raised unless out of memory
                    if not is_out_of_memory(error):
                        raise
                    out_of_memory = str(error)  # its message only: its frames hold tensors
        if out_of_memory is not None:
            continue
        computed, held = cache[key]
        profile = copy.deepcopy(computed)
        profile.name, profile.chained, profile.input_held = name, captured.chained, captured.input_held
        for choice, option in profile.options.items():  # inputs held once count in the first block only
            option.internal_bytes -= sum(held[choice].get(i, 0) for i in captured.shared)
        profiles.append(profile)
    if out_of_memory is not None:
        raise torch.OutOfMemoryError(out_of_memory)
    return profiles


class UnprofilableBlockError(RuntimeError):
    """A block that does not run alone on the inputs it took in the model's forward (a reversible layer
    that its model runs inside its own autograd function, a block that reads state the forward set)."""

    def __init__(self, name: str, err: BaseException) -> None:
        super().__init__(f"block {name!r} does not run alone on its recorded inputs: {first_line(err, 160)}")
        self.name = name
        self.reason = (
            f"it does not run alone on its recorded inputs ({type(err).__name__}: {first_line(err, 160)})"
        )


def profile_blocks_run(
    model: nn.Module,
    blocks: Iterable[tuple[str, nn.Module]],
    inputs: dict[str, BlockInputs],
    *,
    discovered: bool = True,
    profile: Callable[..., list[BlockProfile]] | None = None,
    **options,
) -> tuple[list[tuple[str, nn.Module]], list[BlockProfile], list[str]]:
    """Profile the blocks a training forward ran, never raising for one that cannot be profiled.

    The blocks the forward did not run are left out (``find_blocks``' rule 6, :func:`~lightning_memopt.
    checkpointing.blocks_run`) and their treatment taken off; every block left is profiled
    (:func:`profile_blocks` with ``options``), those whose recomputation would not reproduce the forward
    with ``keep`` alone (``BlockProfile.note``). ``profile``: what profiles (default :func:`profile_blocks`).

    Returns:
        The blocks kept, their profiles, and one note per reason a block keeps its activations (blocks of
        one class for one reason share a note).
    """
    from lightning_memopt.checkpointing.blocks import blocks_run

    blocks = list(blocks)
    kept, notes = blocks_run(model, blocks, inputs, discovered=discovered)
    names = {n for n, _ in kept}
    _take_off([b for n, b in blocks if n not in names])
    while True:  # a block that does not run alone keeps its activations; the others are profiled
        try:
            profiles = (profile or profile_blocks)(model, kept, inputs=inputs, **options)
            break
        except UnprofilableBlockError as err:
            block = dict(kept)[err.name]
            notes.append(f"{err.name} ({type(block).__name__}) keeps its activations: {err.reason}")
            kept = [(n, b) for n, b in kept if n != err.name]
            _take_off([block])
    grouped: dict[tuple[str, str], list[str]] = {}
    for (name, block), profile in zip(kept, profiles):
        if profile.note is not None:
            grouped.setdefault((type(block).__name__, profile.note), []).append(name)
    notes += [f"{', '.join(n)} ({cls}) keep their activations: {note}" for (cls, note), n in grouped.items()]
    return kept, profiles, notes


def _take_off(blocks: list[nn.Module]) -> None:
    """Take the treatment off ``blocks`` (apply.py's instance ``forward``)."""
    holder = nn.Module()
    for i, block in enumerate(blocks):
        holder.add_module(str(i), block)
    remove_checkpointing(holder)


def _signature(block: nn.Module, captured: BlockInputs) -> tuple:
    """What a block's profile runs: blocks alike in it are profiled (and timed) once. Which inputs an
    earlier block holds already (``captured.shared``) changes only what the block counts, not what runs:
    the first layer of a stack, which counts the attention mask and position embeddings, is profiled with
    the others. The inputs' strides do change what runs (torch's ``TransformerEncoder`` hands its first
    layer a transposed view, which its first op copies: that layer does not hold its input, the next do)."""
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    inputs = call_signature((captured.args, captured.kwargs))
    strides = tuple(t.stride() for t in tensors((captured.args, captured.kwargs)))
    return (type(block), repr(block), block.training, params, inputs, strides, captured.grad_inputs)


@contextlib.contextmanager
def _gathered(block: nn.Module) -> Iterator[Callable]:
    """Yield how to call ``block`` for a profile run that involves no other rank.

    A plain block is called as usual. An FSDP2 (``fully_shard``) block gets its parameters all-gathered
    once (``unshard``; a collective, so every rank gathers every block in the same order) and its
    ``forward`` is called directly, past FSDP's hooks, whose gathers and gradient reduce-scatters would
    otherwise run out of step with the other ranks; it is resharded afterwards.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()  # noqa: N806
    if not isinstance(block, FSDPModule):
        yield block
        return
    block.unshard()
    try:
        yield block.forward
    finally:
        block.reshard()


def _profile_block(
    name, block, call, captured: BlockInputs, choices, context, clock
) -> tuple[BlockProfile, dict[str, dict[int, int]]]:
    """The block's profile, its options' ``internal_bytes`` counting every input the block holds, and
    by option the bytes of each other input held (by position, as ``BlockInputs.shared``): a block for
    which an earlier one holds some takes them off (:func:`profile_blocks`)."""
    state = treatment_state(block)
    before = state.choice if state is not None else None
    fake_model = nn.Module()  # apply_checkpointing works on a model; give the block a one-entry tree
    fake_model.add_module("b", block)
    options: dict[str, OptionCost] = {}
    held: dict[str, dict[int, int]] = {}
    keep_bwd = (0, 0)
    forward_flops = in_bytes = out_bytes = 0
    seconds = None
    note = state.unrepeatable if state is not None else None
    try:
        for choice in choices if note is None else ["keep"]:
            try:
                cost, fwd_flops, bwd, sizes, held[choice], written = _run_choice(
                    fake_model, choice, call, captured, context
                )
            except Exception as err:  # noqa: BLE001 - whatever fails, the block keeps and the fit goes on
                if is_out_of_memory(err):
                    raise
                if choice == "keep":  # not even as in the model's forward: it cannot be profiled at all
                    raise UnprofilableBlockError(name, err) from err
                note, options = f"its recomputation fails ({type(err).__name__}: {first_line(err, 160)})", {}
                break  # profiled again below, keep alone
            if choice == "keep":
                keep_bwd, forward_flops, (in_bytes, out_bytes) = bwd, fwd_flops, sizes
                if written:  # the forward writes state: no recomputation can reproduce it (written.py)
                    note = f"its forward writes state ({', '.join(written[:4])})"
            cost.recompute_flops = max(bwd[0] - keep_bwd[0], 0)
            cost.recompute_bytes = max(bwd[1] - keep_bwd[1], 0)
            options[choice] = cost
            if note is not None:
                break
        if note is not None and not options:
            cost, forward_flops, keep_bwd, (in_bytes, out_bytes), held["keep"], _ = _run_choice(
                fake_model, "keep", call, captured, context
            )
            options["keep"] = cost
        if clock is not None:
            seconds = _time_options(fake_model, call, captured, context, options, clock)
    finally:
        if before is None:
            remove_checkpointing(fake_model)
        else:
            state.choice = before
        del fake_model._modules["b"]
    profile = BlockProfile(
        name, forward_flops, in_bytes, out_bytes, captured.chained, options, captured.input_held, seconds
    )
    profile.note = None if note is None else f"{note}: a recomputation would not reproduce the forward"
    return profile, held


def _run_choice(fake_model: nn.Module, choice: str, call, captured: BlockInputs, context):
    """One profile run of the block under ``choice``: :func:`_run`'s figures and what the run wrote
    (attributes, buffers, random draws: written.py). The block's state is put back afterwards."""
    block = fake_model.b
    apply_checkpointing(fake_model, {"b": choice})
    original = Snapshot(block)
    detach_state(block)
    before = Snapshot(block, values=True)
    buffers = {n: b.detach().clone() for n, b in block.named_buffers()}  # BatchNorm's statistics too
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return (*_run(block, call, captured, context), before.written())
    finally:
        before.restore()
        original.restore()
        with torch.no_grad():
            for n, b in block.named_buffers():
                b.copy_(buffers[n])


def _fresh_inputs(captured: BlockInputs) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Copies of the captured inputs, requiring grad as in the model's forward (what autograd saves
    depends on it), and those that do."""
    args, kwargs = tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (captured.args, captured.kwargs)
    )
    for i, t in enumerate(tensors((args, kwargs))):
        if t.is_floating_point() and (captured.grad_inputs is None or i in captured.grad_inputs):
            t.requires_grad_(True)
    return args, kwargs, [t for t in tensors((args, kwargs)) if t.requires_grad]


def _time_options(fake_model, call, captured: BlockInputs, context, options: dict, clock) -> float:
    """Set each option's ``seconds``: its timed forward and backward beyond ``keep``'s (timing.py).
    Returns keep's seconds."""
    block = fake_model.b
    params = [p for p in block.parameters() if p.requires_grad]
    buffers = {n: b.detach().clone() for n, b in block.named_buffers()}
    before = Snapshot(block)  # attributes a forward writes (written.py)

    def prepare(choice):
        apply_checkpointing(fake_model, {"b": choice})
        args, kwargs, leaves = _fresh_inputs(captured)

        def run():
            with (context or contextlib.nullcontext)():
                outs = [t for t in tensors(call(*args, **kwargs)) if t.requires_grad]
            if outs:
                torch.autograd.grad(sum(o.float().sum() for o in outs), leaves + params, allow_unused=True)

        return run

    # A treatment that holds no less than keep (pointwise in a block whose pointwise modules' outputs are
    # saved anyway: every ResNet block) can never be chosen: it is not timed, and is priced as a pass of
    # the whole block (more than nothing: never chosen for free).
    keep = options["keep"]
    timed = [c for c, o in options.items() if c == "keep" or not _holds_no_less(o, keep)]
    with torch.random.fork_rng(devices=[]):
        timings = time_treatments(prepare, timed, clock)
    before.restore()
    with torch.no_grad():
        for n, b in block.named_buffers():
            b.copy_(buffers[n])
    for choice, option in options.items():
        # Never below keep: a treatment only adds work to the block, and a negative extra is the noise of
        # a busy machine (it would make the planner pick a treatment that saves nothing for free).
        option.seconds = max(timings[choice].extra, 0.0) if choice in timings else timings["keep"].median
    return timings["keep"].median


def _holds_no_less(option: OptionCost, keep: OptionCost) -> bool:
    """Whether ``option`` holds for backward at least what ``keep`` holds: its input, output and the rest."""
    return (
        option.internal_bytes >= keep.internal_bytes
        and option.saves_input >= keep.saves_input
        and option.saves_output >= keep.saves_output
    )


def _run(block, call, captured: BlockInputs, context):
    args, kwargs, leaves = _fresh_inputs(captured)
    primary_in = next(iter(tensors((args, kwargs))), None)
    tracker = MemoryTracker(block)
    offloaded = [0]

    def seen(kind, t):
        if kind == "cached":
            tracker.mark(t, "activations")
        else:
            offloaded[0] += t.untyped_storage().nbytes()

    counter = OpCounter()
    with tracker, observe_saved(seen), counter, (context or contextlib.nullcontext)():
        out = call(*args, **kwargs)
    outs = [t for t in tensors(out) if t.requires_grad]
    primary_out = next(iter(tensors(out)), None)
    acts = tracker.current_breakdown["activations"]
    saves_in = primary_in is not None and tracker.category_of(primary_in) == "activations"
    saves_out = primary_out is not None and tracker.category_of(primary_out) == "activations"
    in_bytes = primary_in.untyped_storage().nbytes() if primary_in is not None else 0
    out_bytes = primary_out.untyped_storage().nbytes() if primary_out is not None else 0
    if (
        primary_in is not None
        and primary_out is not None
        and storage_key(primary_in) == storage_key(primary_out)
    ):
        saves_out = False  # one storage: count it once, as the input
    internal = acts - in_bytes * saves_in - out_bytes * saves_out
    # the other inputs held for backward, by position: those an earlier block holds come off per block
    held = {
        i: t.untyped_storage().nbytes()
        for i, t in enumerate(tensors((args, kwargs)))
        if i > 0 and tracker.category_of(t) == "activations"
    }
    cost = OptionCost(internal, saves_in, saves_out, transfer_bytes=offloaded[0])
    params = [p for p in block.parameters() if p.requires_grad]
    bwd_counter = OpCounter()
    if outs:
        loss = sum(o.float().sum() for o in outs)
        # Not held through backward, as in the model's backward: the profile's peak stays below the step's.
        del out, outs, primary_out
        with bwd_counter:
            torch.autograd.grad(loss, leaves + params, allow_unused=True)
    return cost, counter.flops, (bwd_counter.flops, bwd_counter.bytes), (in_bytes, out_bytes), held
