"""Find the repeated blocks of a model: the units activation checkpointing wraps."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from torch import nn

from lightning_memopt._compat import fsdp_module_type, is_dtensor
from lightning_memopt._text import listed
from lightning_memopt.checkpointing.written import treatment_state

__all__ = ["find_blocks", "blocks_run", "candidate_classes", "check_blocks"]


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


# Where a mixture of experts keeps its router: a child of the module holding the experts, by name.
_ROUTER_NAMES = ("router", "gate", "gating")


def _experts(container: nn.Module, parent: nn.Module | None) -> bool:
    """Whether ``container`` holds a mixture of experts, recognised by its router: a sibling named like
    one (``router``, ``gate``, ``gating``; not a ``*_proj`` projection) with a weight of one row per
    member (a ``Linear`` with one output per expert, or a bare ``(experts, hidden)`` weight). Experts run
    side by side on different tokens; they are parts of a block, not a stack of blocks. A classifier head
    with as many classes as there are blocks is not a router."""
    if parent is None:
        return False
    n = len(container)
    for name, child in parent.named_children():
        lowered = name.lower()
        if child is container or lowered.endswith("_proj") or not any(r in lowered for r in _ROUTER_NAMES):
            continue
        if any(p.dim() == 2 and p.shape[0] == n for p in child.parameters()):
            return True
    return False


def _expert_containers(model: nn.Module) -> set[int]:
    """ids of the ModuleLists/Sequentials of ``model`` that hold mixtures of experts (:func:`_experts`)."""
    parents = {id(c): m for m in model.modules() for c in m.children()}
    return {id(m) for m in model.modules() if _is_container(m) and _experts(m, parents.get(id(m)))}


def _runs(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """Every maximal run of two or more consecutive same-class children, holding parameters, of a
    ModuleList/Sequential (mixtures of experts left out), with the container's name."""
    experts = _expert_containers(model)
    runs = []
    for parent_name, parent in model.named_modules():
        if not _is_container(parent) or id(parent) in experts:
            continue
        run: list[tuple[str, nn.Module]] = []
        for name, child in [*parent.named_children(), ("", None)]:  # a sentinel ends the last run
            if run and child is not None and type(run[-1][1]) is type(child):
                run.append((f"{parent_name}.{name}" if parent_name else name, child))
                continue
            if len(run) >= 2 and any(True for _ in run[0][1].parameters()):
                runs.append((parent_name, run))
            run = [(f"{parent_name}.{name}" if parent_name else name, child)] if child is not None else []
    return runs


def candidate_classes(model: nn.Module) -> list[str]:
    """Names of the classes that appear two or more times in a row in a ModuleList/Sequential of ``model``."""
    return sorted({type(run[0][1]).__name__ for _, run in _runs(model)})


def _weight_layers(module: nn.Module) -> int:
    """How many modules inside ``module`` own a weight matrix or kernel (Linear, Conv, attention)."""
    return sum(any(p.dim() >= 2 for p in m.parameters(recurse=False)) for m in module.modules())


def _numel(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _discover(module: nn.Module, prefix: str, rule: _Rule, nested: bool) -> list[tuple[str, nn.Module]]:
    """The blocks under ``module`` (see :func:`find_blocks` for the rule), in registration order."""
    found: list[tuple[str, nn.Module]] = []
    stacked = _is_container(module) and id(module) not in rule.experts
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        layer = not nested and _weight_layers(child) >= 2 and any(True for _ in child.children())
        is_block = stacked and (type(child) in rule.repeated or layer)
        if is_block and nested and _weight_layers(child) < 2:
            is_block = False  # inside a block, one conv + norm + activation is a layer, not a block
        if not is_block:
            found += _discover(child, full, rule, nested)
            continue
        if type(child) not in rule.repeated:  # rule 2b: a layer only where nothing inside is a block
            inner = _discover(child, full, rule, nested)
            if not inner:
                rule.provisional.add(full)
            found += inner or [(full, child)]
            continue
        inner = _discover(child, full, rule, nested=True)
        # A stage or tower made mostly of blocks is a container: its blocks are the finer, better units.
        found += inner if inner and 2 * _numel(m for _, m in inner) >= _numel([child]) else [(full, child)]
    return found


class _Rule:
    """What discovery needs to know of the whole model: the block classes, the experts' containers, and
    (filled while discovering) the blocks taken as layers of a stack whatever their class (rule 2b)."""

    def __init__(self, model: nn.Module) -> None:
        self.repeated = {type(run[0][1]) for _, run in _runs(model)}
        self.experts = _expert_containers(model)
        self.provisional: set[str] = set()


def _discovered(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], set[str]]:
    """The units of rules 1-5 and the names of those that rule 6 checks for shape."""
    rule = _Rule(model)
    found = _discover(model, "", rule, nested=False)
    stem = _stem(model, found[0][0]) if found else None
    units = [stem, *found] if stem is not None else found
    return units, rule.provisional & {n for n, _ in found}


def _stem(model: nn.Module, first: str) -> tuple[str, nn.Module] | None:
    """The stem before the block named ``first`` (see :func:`find_blocks`, rule 5), or None."""
    modules = dict(model.named_modules())
    parts = first.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # from the block's container up to the model
        parent = ".".join(parts[:depth])
        before = []
        for name, child in modules[parent].named_children():
            if name == parts[depth]:
                break
            before.append((f"{parent}.{name}" if parent else name, child))
        holding = [(n, c) for n, c in before if any(True for _ in c.parameters())]
        if holding:  # the nearest module with parameters registered before the stacks decides
            name, child = holding[-1]
            composite = any(True for _ in child.children()) and not isinstance(child, nn.ModuleList)
            unit = composite and _weight_layers(child) >= 1 and not _sharded_by_ancestor(child)
            return (name, child) if unit else None
    return None


def _sharded_by_ancestor(module: nn.Module) -> bool:
    """Whether an enclosing ``fully_shard`` (FSDP2) owns ``module``'s parameters: outside that module's
    forward they are shards, so ``module`` cannot be profiled alone (a block is its own FSDP unit)."""
    fsdp = fsdp_module_type()
    if fsdp is None:  # torch without FSDP2
        return False
    return not isinstance(module, fsdp) and any(is_dtensor(p) for p in module.parameters())


def find_blocks(
    model: nn.Module, blocks: Sequence[type[nn.Module] | str] | type[nn.Module] | str | None = None
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model``: every stack of layers, and the stem before them, as ``(qualified name,
    module)`` in registration (forward) order. Blocks are what the training forward runs: this finds the
    candidates in the module tree; :func:`blocks_run` keeps those that the first forward ran (rule 6).

    The discovery rule, without ``blocks``:

    1. A *block class* is a class of which two or more instances, holding parameters, follow each other
       as children of an ``nn.ModuleList`` or ``nn.Sequential`` (GPT-2's ``h``, ``nn.TransformerEncoder``'s
       ``layers``, a ResNet stage's layers). A mixture of experts is not a stack, and is recognised by its
       router, not by counting: a container beside a module named ``router``, ``gate`` or ``gating`` with
       one weight row per member (a classifier with as many classes as there are blocks is no router).
    2. Every child of a ``ModuleList``/``Sequential`` that is of a block class is a block, wherever it is:
       all stages of a CNN, encoder *and* decoder, several towers; a stage holding a single block too.
       2b. So is, outside blocks, every child of a ``ModuleList``/``Sequential`` with submodules and two or
       more weight layers, whatever its class: a hybrid stack whose layer classes alternate (Mamba and
       attention, local and global attention), a stack of one layer. Rule 6 keeps it only where it maps
       its input to an output of the same shape (a layer of a stack maps the hidden state to the hidden
       state).
    3. A block that contains blocks holding at least half of its parameters is a container (a ResNet,
       ConvNeXt or Swin stage): the inner blocks are taken instead. Inside a block, only modules with two
       or more weight layers (Linear, convolution, attention projections) count as blocks, so a ResNet's
       conv + norm + activation units are not mistaken for its residual blocks.
    4. Blocks are never nested.
    5. The *stem*: the module with parameters registered nearest before the first block, looking in the
       first block's container, then in its parent, and so on up to ``model`` (the first level that has
       one decides), is a unit too, listed first, if it holds a weight layer and submodules of its own
       (a ResNet's or EfficientNet's convolution + norm + activation (+ pooling), a ViT's or Swin's
       patch embedding, BERT's embeddings; not a bare ``Embedding`` or ``Linear``). It runs at the
       highest resolution, where a CNN holds most of its activations, and no stack contains it. Like a
       block, it is profiled under every treatment and planned; where checkpointing it saves nothing,
       ``keep`` is chosen (``keep`` is always allowed). A stem whose parameters an enclosing
       ``fully_shard`` (FSDP2) owns is left out: it cannot run alone to be profiled.
    6. At the first training forward (:func:`blocks_run`): a unit the forward never calls (an image
       tokenizer's encoder in a text-only forward) is not a block, silently; a unit called as
       ``unit.forward(...)`` (its module hooks never fire, so it cannot be measured) is kept as it is,
       with a note; so is a unit that runs with gradients off (a reversible layer, which its model
       recomputes itself); a rule-2b candidate whose output shape differs from its input's is not a block.
       Blocks whose recomputation would not reproduce their forward (they write state) are kept later,
       when profiled (``profile_blocks``).

    Args:
        model: The model (a LightningModule or any ``nn.Module``).
        blocks: Override the discovery: module classes, class names, or ``fnmatch`` patterns on module
            names (``"layers.*"``, ``"encoder.layer.?"``). A pattern matches a name relative to ``model``
            or to any submodule holding the blocks (``"layer?"`` matches ``"model.layer1"``). A string
            matches a class name first, then module names. Every matching module is a block (outermost
            wins).

    Returns:
        The units (the stem, if any, then the blocks); an empty list when ``blocks`` is None and no
        block exists (then no stem is looked for either).

    Raises:
        ValueError: If ``blocks`` is not classes, class names or patterns, or matches no module; the
            message lists the discovered blocks and the candidate classes.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), *[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        >>> [name for name, _ in find_blocks(model)]
        ['1', '2', '3']
    """
    if blocks is None:
        return _discovered(model)[0]
    return _given(model, blocks)


def _given(model: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """The modules matching ``blocks`` (outermost wins), or ``ValueError`` listing what was found."""
    specs = check_blocks(blocks)
    chosen: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if any(_matches(spec, name, module) for spec in specs):
            chosen.append((name, module))
            inside.update(id(m) for m in module.modules())
    if not chosen:
        found = [n for n, _ in find_blocks(model)]
        raise ValueError(
            f"blocks={blocks!r} matched no module of {type(model).__name__}; candidate block classes found: "
            f"{candidate_classes(model) or 'none'}; discovered blocks: [{listed(found)}]. Pass classes, class names or "
            "module-name patterns (relative to the model or to the module holding the blocks)."
        )
    return chosen


def check_blocks(blocks) -> list[type[nn.Module] | str]:
    """``blocks`` as a list of specs, or ``ValueError`` unless it is None, a class, a string or a list of them."""
    if blocks is None:
        return []
    specs = [blocks] if isinstance(blocks, (str, type)) else blocks
    if not isinstance(specs, (list, tuple)):
        specs = [specs]
    for spec in specs:
        if not isinstance(spec, str) and not (isinstance(spec, type) and issubclass(spec, nn.Module)):
            raise ValueError(
                f"blocks must be module classes, class names or name patterns, got {spec!r}; "
                "pass e.g. blocks=[MyBlock] or blocks=['layers.*']"
            )
    return list(specs)


def _matches(spec: type[nn.Module] | str, name: str, module: nn.Module) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    if type(module).__name__ == spec:
        return True
    # Relative to the model or to any submodule: "layer?" matches "layer1" and "model.layer1".
    parts = name.split(".") if name else []
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), spec) for i in range(len(parts)))


_FORWARD_CALLED = (
    "called as .forward(): module hooks never fire, so it cannot be measured; it keeps its activations"
)
_NO_GRAD = (
    "runs with gradients off in the training forward (a reversible layer, recomputed by its own model): "
    "it holds nothing to checkpoint"
)


def blocks_run(
    model: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    seen: Mapping[str, object],
    *,
    discovered: bool = True,
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The blocks the first training forward ran (:func:`find_blocks`, rule 6), and a note per block left
    out that the user may want to know of.

    Args:
        model: The model ``blocks`` were found in.
        blocks: The candidates, as from :func:`find_blocks`.
        seen: What the forward recorded per block name (``profile.record_block_inputs``): a block missing
            here was not called through its module hooks; an entry's ``same_shape`` says whether its
            output had its input's shape.
        discovered: Whether ``blocks`` were discovered (rule 2b's shape check applies) or given by the user.

    Example::

        >>> from lightning_memopt.checkpointing import capture_block_inputs
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
        >>> seen = capture_block_inputs(model, find_blocks(model)[:1], torch.randn(2, 8))
        >>> [n for n, _ in blocks_run(model, find_blocks(model), seen)[0]]
        ['0']
    """
    provisional = _discovered(model)[1] if discovered else set()
    kept: list[tuple[str, nn.Module]] = []
    left: dict[str, list[str]] = {}
    for name, block in blocks:
        state = treatment_state(block)
        if name not in seen:
            if state is not None and state.calls > 0:  # its checkpointed forward ran: called as .forward()
                left.setdefault(f"({type(block).__name__}): {_FORWARD_CALLED}", []).append(name)
        elif getattr(seen[name], "grad_inputs", ()) is None:
            left.setdefault(f"({type(block).__name__}): {_NO_GRAD}", []).append(name)
        elif name not in provisional or getattr(seen[name], "same_shape", True):
            kept.append((name, block))
    notes = [f"{', '.join(names)} {why}" for why, names in left.items()]
    return kept, notes
