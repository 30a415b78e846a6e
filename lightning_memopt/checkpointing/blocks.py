"""Find the repeated blocks of a model: the units activation checkpointing wraps."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

__all__ = ["find_blocks", "candidate_classes", "check_blocks"]


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def _experts(container: nn.Module, parent: nn.Module | None) -> bool:
    """Whether ``container`` holds a mixture of experts: its parent routes with a ``Linear`` that has one
    output per member. Experts run side by side on different tokens; they are parts of a block, not a
    stack of blocks."""
    n = len(container)
    return parent is not None and any(
        isinstance(c, nn.Linear) and c.out_features == n for c in parent.children()
    )


def _runs(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """Every maximal run of two or more consecutive same-class children, holding parameters, of a
    ModuleList/Sequential (mixtures of experts left out), with the container's name."""
    parents = {id(c): m for m in model.modules() for c in m.children()}
    runs = []
    for parent_name, parent in model.named_modules():
        if not _is_container(parent) or _experts(parent, parents.get(id(parent))):
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


def _discover(
    module: nn.Module, prefix: str, repeated: set[type], nested: bool
) -> list[tuple[str, nn.Module]]:
    """The blocks under ``module`` (see :func:`find_blocks` for the rule), in registration order."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        is_block = _is_container(module) and type(child) in repeated
        if is_block and nested and _weight_layers(child) < 2:
            is_block = False  # inside a block, one conv + norm + activation is a layer, not a block
        if not is_block:
            found += _discover(child, full, repeated, nested)
            continue
        inner = _discover(child, full, repeated, nested=True)
        # A stage or tower made mostly of blocks is a container: its blocks are the finer, better units.
        found += inner if inner and 2 * _numel(m for _, m in inner) >= _numel([child]) else [(full, child)]
    return found


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
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without FSDP2
        return False
    return not isinstance(module, FSDPModule) and any(isinstance(p, DTensor) for p in module.parameters())


def find_blocks(
    model: nn.Module, blocks: Sequence[type[nn.Module] | str] | type[nn.Module] | str | None = None
) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``, every stack of them, and the stem before them, as
    ``(qualified name, module)`` in registration (forward) order.

    The discovery rule, without ``blocks``:

    1. A *block class* is a class of which two or more instances, holding parameters, follow each other
       as children of an ``nn.ModuleList`` or ``nn.Sequential`` (GPT-2's ``h``, ``nn.TransformerEncoder``'s
       ``layers``, a ResNet stage's layers). Mixtures of experts are not stacks: a container whose parent
       owns a ``Linear`` router with one output per member is skipped.
    2. Every child of a ``ModuleList``/``Sequential`` that is of a block class is a block, wherever it is:
       all stages of a CNN, encoder *and* decoder, several towers; a stage holding a single block too.
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

    Args:
        model: The model (a LightningModule or any ``nn.Module``).
        blocks: Override the discovery: module classes, class names, or ``fnmatch`` patterns on module
            names (``"layers.*"``, ``"encoder.layer.?"``). A pattern matches a name relative to ``model``
            or to any submodule holding the blocks (``"layer?"`` matches ``"model.layer1"``). A string
            matches a class name first, then module names. Every matching module is a block (outermost
            wins).

    Returns:
        The units (the stem, if any, then the blocks); an empty list when ``blocks`` is None and no
        repeated block exists (then no stem is looked for either).

    Raises:
        ValueError: If ``blocks`` is not classes, class names or patterns, or matches no module; the
            message lists the discovered blocks and the candidate classes.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), *[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        >>> [name for name, _ in find_blocks(model)]
        ['1', '2', '3']
    """
    if blocks is None:
        repeated = {type(run[0][1]) for _, run in _runs(model)}
        found = _discover(model, "", repeated, nested=False) if repeated else []
        stem = _stem(model, found[0][0]) if found else None
        return [stem, *found] if stem is not None else found
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
        shown = ", ".join(found[:8]) + (f", ... ({len(found)} in all)" if len(found) > 8 else "")
        raise ValueError(
            f"blocks={blocks!r} matched no module of {type(model).__name__}; candidate block classes found: "
            f"{candidate_classes(model) or 'none'}; discovered blocks: [{shown}]. Pass classes, class names or "
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
