"""Find the repeated blocks of a model: the units activation checkpointing wraps."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

__all__ = ["find_blocks", "candidate_classes"]


def _runs(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """Every maximal run of consecutive same-class children of a ModuleList/Sequential, with its parent."""
    runs = []
    for parent_name, parent in model.named_modules():
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        run: list[tuple[str, nn.Module]] = []
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if run and type(run[-1][1]) is type(child):
                run.append((full, child))
            else:
                if len(run) >= 2:
                    runs.append((parent_name, run))
                run = [(full, child)]
        if len(run) >= 2:
            runs.append((parent_name, run))
    return runs


def candidate_classes(model: nn.Module) -> list[str]:
    """Names of the classes that appear two or more times in a row in a ModuleList/Sequential of ``model``."""
    return sorted({type(run[0][1]).__name__ for _, run in _runs(model)})


def find_blocks(
    model: nn.Module, blocks: Sequence[type[nn.Module] | str] | type[nn.Module] | str | None = None
) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``, as ``(qualified name, module)`` in forward order.

    Without ``blocks``, the longest run of same-class children of an ``nn.ModuleList`` or
    ``nn.Sequential`` is taken (GPT-2's ``h``, a ViT's ``blocks``, ``nn.TransformerEncoder.layers``);
    runs of equal length are broken by the number of parameters they hold, so a ResNet picks its largest
    stage. Blocks are never nested: a module inside a chosen block is not returned.

    Args:
        blocks: Override the discovery: module classes, class names, or ``fnmatch`` patterns on module
            names (``"layers.*"``, ``"encoder.layer.?"``). A string matches a class name first, then module
            names. With an override, every matching module in the model is a block (outermost wins).

    Returns:
        The blocks; an empty list when ``blocks`` is None and no repeated block exists.

    Raises:
        ValueError: If ``blocks`` is given and matches no module; the message lists the candidate classes.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), *[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        >>> [name for name, _ in find_blocks(model)]
        ['1', '2', '3']
    """
    if blocks is None:
        runs = _runs(model)
        if not runs:
            return []

        def size(run):
            return len(run[1]), sum(p.numel() for _, m in run[1] for p in m.parameters())

        return list(max(runs, key=size)[1])

    specs = [blocks] if isinstance(blocks, (str, type)) else list(blocks)
    for spec in specs:
        if not isinstance(spec, str) and not (isinstance(spec, type) and issubclass(spec, nn.Module)):
            raise ValueError(
                f"blocks must be module classes, class names or name patterns, got {spec!r}; "
                "pass e.g. blocks=[MyBlock] or blocks=['layers.*']"
            )
    chosen: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if any(_matches(spec, name, module) for spec in specs):
            chosen.append((name, module))
            inside.update(id(m) for m in module.modules())
    if not chosen:
        raise ValueError(
            f"blocks={blocks!r} matched no module of {type(model).__name__}; candidate block classes found: "
            f"{candidate_classes(model) or 'none'}. Pass classes, class names or module-name patterns."
        )
    return chosen


def _matches(spec: type[nn.Module] | str, name: str, module: nn.Module) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return type(module).__name__ == spec or (bool(name) and fnmatch.fnmatchcase(name, spec))
