"""BatchNorm → GroupNorm: normalization that does not depend on how a batch is split.

BatchNorm normalizes each channel with the mean and variance of the *batch*, so when a batch is cut
into micro-batches (gradient accumulation, OOM backoff) every slice is normalized with statistics of
fewer samples and training changes. GroupNorm normalizes every sample on its own (over groups of
channels and the spatial positions), so ``gn(x)[:1] == gn(x[:1])`` and splitting is invisible.

:func:`convert_batchnorm` replaces the BatchNorm layers of a model, in place, by :class:`SwappedGroupNorm`
layers that *reuse* the BatchNorm's ``weight``/``bias`` Parameter objects (so device, dtype,
``requires_grad``, meta tensors and optimizer references survive) and keep ``eps``, ``affine`` and the
training flag. :func:`revert_groupnorm` puts the original BatchNorm layers back, with the same
Parameters. Choices made for the user, each reported in the returned :class:`ConversionReport`:

- Groups: the largest divisor of the channel count ``C`` not above ``num_groups`` (default 32), or
  ``C // group_size`` for an explicit ``group_size`` (which must divide every layer's ``C``); an explicit
  per-layer plan (``groups=``) is used as given and must divide ``C``. So a count that 32 does not divide
  still converts, to the largest count not above 32 that divides it: 48 → 24 groups of 2 channels,
  56 → 28 of 2, 144 → 24 of 6, 336 → 28 of 12; ``C`` up to 32 → one group per channel (InstanceNorm with
  the per-channel affine); a prime ``C`` above 32 → 1 group (LayerNorm over the channels and positions).
- A group never holds a single value per sample (its output would be 0, erasing the data): a layer
  whose input has no spatial extent, like ``BatchNorm1d`` on ``(N, C)``, becomes ``GroupNorm(1, C)``,
  which normalizes over the features and keeps the per-channel affine. Input shapes are learned by one
  no-grad forward of ``example_input``; without it every ``BatchNorm1d`` is assumed to see ``(N, C)``
  and a warning names them; a ``BatchNorm2d``/``3d`` is assumed to see spatial extent, and a layer that
  then gets a single value per group (1x1 maps at the end of a CNN on small images) raises a clear
  error at its first forward instead of silently outputting a constant.
- Frozen layers (``FrozenBatchNorm2d`` of torchvision/timm, or a BatchNorm whose parameters all have
  ``requires_grad=False``) use fixed statistics in practice and are left alone, reported as skipped.
- A BatchNorm subclass that overrides ``forward`` is refused (converting it would drop its behaviour)
  unless a converter was registered for it with :func:`register_converter`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils._pytree import tree_map

from lightning_memopt._checks import check_positive_int
from lightning_memopt._compat import is_dtensor

__all__ = [
    "ConversionReport",
    "ConvertedLayer",
    "SkippedLayer",
    "SwappedGroupNorm",
    "convert_batchnorm",
    "register_converter",
    "revert_groupnorm",
]

# _BatchNorm is the base of BatchNorm1d/2d/3d, SyncBatchNorm and the LazyBatchNorm classes.
_BATCHNORMS = (_BatchNorm,)
# forwards that implement plain BatchNorm; a subclass with any other forward does something extra.
_PLAIN_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
_DEFAULT_GROUPS = 32  # the GroupNorm paper's choice (Wu & He, 2018)

Converter = Callable[[nn.Module, int], nn.Module]
_CONVERTERS: dict[type, Converter] = {}


def register_converter(cls: type[nn.Module], converter: Converter) -> None:
    """Tell :func:`convert_batchnorm` how to convert a BatchNorm subclass that overrides ``forward``.

    Args:
        cls: the BatchNorm subclass; the converter is also used for subclasses of ``cls``.
        converter: ``converter(batchnorm, num_groups) -> nn.Module``, returning the batch-independent
            module that replaces ``batchnorm``; ``num_groups`` is the group count chosen for the layer.
            Modules it returns are not reverted by :func:`revert_groupnorm`.

    Raises:
        TypeError: ``cls`` is not a BatchNorm class, or ``converter`` is not callable.

    Example::

        class BatchNormReLU(nn.BatchNorm2d):
            def forward(self, x):
                return torch.relu(super().forward(x))

        register_converter(
            BatchNormReLU,
            lambda bn, groups: nn.Sequential(
                SwappedGroupNorm.from_batchnorm(bn, groups), nn.ReLU()
            ),
        )
    """
    if not (isinstance(cls, type) and issubclass(cls, _BatchNorm)):
        raise TypeError(f"register_converter expects a BatchNorm subclass, got {cls!r}")
    if not callable(converter):
        raise TypeError(f"converter must be callable as converter(batchnorm, num_groups), got {converter!r}")
    _CONVERTERS[cls] = converter


class SwappedGroupNorm(nn.GroupNorm):
    """A GroupNorm made from a BatchNorm by :func:`convert_batchnorm`; loads the BatchNorm's checkpoints.

    Its state_dict has exactly the BatchNorm's keys: ``weight`` and ``bias`` (when affine) and the
    BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked`` (when it tracked them),
    registered as buffers of this layer, the very tensors the BatchNorm had. GroupNorm does not read
    them; they are kept so that the swap changes no key: a checkpoint saved before the swap loads
    strictly, one saved after it loads strictly into the original BatchNorm model, and
    :func:`revert_groupnorm` gives back the statistics. A state_dict without the statistics (saved by an
    earlier version, which dropped them) still loads: the missing statistics keep their values.

    The original BatchNorm module is held (not as a submodule, so it is in neither ``state_dict()`` nor
    ``modules()``) so that :func:`revert_groupnorm` can restore it faithfully.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True) -> None:
        # Built without parameters, so nothing is allocated (not even on meta): from_batchnorm registers the
        # BatchNorm's own. Built directly, an affine layer gets fresh ones (ones/zeros, like GroupNorm).
        super().__init__(num_groups, num_channels, eps=eps, affine=False)
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.ones(num_channels))
            self.bias = nn.Parameter(torch.zeros(num_channels))
        self.__dict__["_batchnorm"] = None
        self.layer_name = ""
        """The layer's name in the converted model, for error messages (set by :func:`convert_batchnorm`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # A group holding one value per sample normalizes it to 0: the layer outputs its bias whatever the
        # input. This happens when the swap could not see the input shape (no example input) and the
        # layer sees no spatial extent, e.g. BatchNorm2d on the 1x1 maps at the end of a CNN on small
        # images. Refuse loudly instead of training a layer that erased its input.
        if input.dim() >= 2 and input.shape[0] > 0 and math.prod(input.shape[1:]) == self.num_groups:
            where = f"{self.layer_name}: " if self.layer_name else ""
            raise ValueError(
                f"{where}GroupNorm({self.num_groups}, {self.num_channels}) swapped for a BatchNorm got input of "
                f"shape {tuple(input.shape)}: each group holds a single value per sample, so the layer would "
                "output a constant. Let the swap see the input shape (set example_input_array on the "
                "LightningModule, or pass example_input= to convert_batchnorm): the layer then gets 1 group"
            )
        return super().forward(input)

    @classmethod
    def from_batchnorm(cls, bn: nn.Module, num_groups: int) -> SwappedGroupNorm:
        """A GroupNorm with ``num_groups`` groups that shares ``bn``'s Parameters, eps, affine and mode."""
        gn = cls(num_groups, bn.num_features, eps=bn.eps, affine=False)
        gn.affine = bn.affine
        # Assigning a Parameter (or None) to a module registers that very object: no copy, no new memory.
        for name in ("weight", "bias"):
            param = getattr(bn, name, None)
            if param is None:
                gn.register_parameter(name, None)
            else:
                setattr(gn, name, param)
        # The statistics stay in the state_dict under their keys (same tensors, nothing allocated).
        for name in _RUNNING_STATS:
            buf = getattr(bn, name, None)
            if isinstance(buf, torch.Tensor):
                gn.register_buffer(name, buf)
        gn.train(bn.training)
        gn.__dict__["_batchnorm"] = bn
        return gn

    @property
    def batchnorm(self) -> nn.Module | None:
        """The BatchNorm this layer replaced (``None`` if it was built directly)."""
        return self.__dict__.get("_batchnorm")

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        absent = [
            prefix + name
            for name in _RUNNING_STATS
            if name in self._buffers and prefix + name not in state_dict
        ]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # Statistics GroupNorm never reads are not worth failing a strict load for (earlier versions of
        # the swap saved none); every other key stays as strict as the caller asked.
        missing_keys[:] = [k for k in missing_keys if k not in absent]


@dataclass(frozen=True)
class ConvertedLayer:
    """One BatchNorm that was replaced."""

    names: tuple[str, ...]
    """Qualified names of the layer in the model (several when two parents share it; ``""`` = root)."""
    kind: str
    """Class of the BatchNorm, qualified (``torch.nn.modules.batchnorm.BatchNorm2d``)."""
    num_channels: int
    num_groups: int
    input_shape: tuple[int, ...] | None
    """Input shape seen by the probe forward, ``None`` when not probed."""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class SkippedLayer:
    """A BatchNorm-like layer that was left in place, and why."""

    names: tuple[str, ...]
    kind: str
    reason: str

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class ConversionReport:
    """What :func:`convert_batchnorm` did."""

    module: nn.Module | None
    """The converted model: the module passed in, or its replacement when the root was a BatchNorm
    (``None`` in the report :class:`~lightning_memopt.BatchNormToGroupNorm` keeps after fit)."""
    converted: list[ConvertedLayer] = field(default_factory=list)
    skipped: list[SkippedLayer] = field(default_factory=list)
    unprobed: list[str] = field(default_factory=list)
    """BatchNorm1d layers (as displayed names) converted without a known input shape: assumed ``(N, C)``."""

    @property
    def groups(self) -> dict[str, int]:
        """Every converted layer name → group count; pass it as ``groups=`` to redo the same swap."""
        return {name: layer.num_groups for layer in self.converted for name in layer.names}

    def __str__(self) -> str:
        lines = [f"BatchNorm→GroupNorm: {len(self.converted)} converted, {len(self.skipped)} skipped"]
        for layer in self.converted:
            shape = "" if layer.input_shape is None else f", input {tuple(layer.input_shape)}"
            lines.append(
                f"  {_display(layer.names)}: {layer.kind.rsplit('.', 1)[-1]}({layer.num_channels})"
                f" -> GroupNorm({layer.num_groups}, {layer.num_channels}){shape}"
            )
        for layer in self.skipped:
            lines.append(
                f"  {_display(layer.names)}: {layer.kind.rsplit('.', 1)[-1]} skipped: {layer.reason}"
            )
        return "\n".join(lines)


def convert_batchnorm(
    module: nn.Module,
    *,
    num_groups: int | None = None,
    group_size: int | None = None,
    groups: Mapping[str, int] | None = None,
    example_input: Any = None,
) -> ConversionReport:
    """Replace every BatchNorm in ``module`` by a GroupNorm sharing its Parameters, in place.

    Matches ``BatchNorm1d/2d/3d``, ``SyncBatchNorm`` and their subclasses (with ``isinstance``). Each
    becomes a :class:`SwappedGroupNorm` that reuses the BatchNorm's ``weight`` and ``bias`` Parameter
    objects and keeps ``eps``, ``affine`` and ``training``. A BatchNorm shared by two parents becomes one
    GroupNorm; running the conversion twice changes nothing. The ``state_dict`` keys do not change: the
    running statistics stay as unused buffers of the GroupNorm (see :class:`SwappedGroupNorm`), so
    checkpoints load strictly in both directions, before and after the swap.

    Args:
        module: the model; converted in place. When it is itself a BatchNorm, the replacement is returned
            as ``report.module``.
        num_groups: upper bound on the group count: a layer with ``C`` channels gets the largest divisor
            of ``C`` not above it. Default ``None``: 32 (the GroupNorm paper's choice) unless ``group_size``
            or ``groups`` is given; pass at most one of the three.
        group_size: channels per group instead: every converted layer gets ``C // group_size`` groups, and
            it must divide every converted layer's ``C`` (checked for all of them, probed or not).
        groups: an explicit plan, layer name → group count (as in ``report.groups``). Only the named
            layers are converted; each count must divide the layer's ``C``.
        example_input: an input for one no-grad, eval-mode forward that records each BatchNorm's input
            shape (RNG and training flags are restored); a tuple is passed as positional arguments and a
            dict as keyword arguments, as Lightning's ``example_input_array``; its tensors are moved to the
            model's device (``meta`` included) and float dtype when all parameters share one. Layers whose input has no
            spatial extent, such as ``BatchNorm1d`` on ``(N, C)``, get one group.

    Returns:
        A :class:`ConversionReport`: the converted model, the converted layers (names, ``C``, groups,
        probed input shape), the skipped ones and why.

    Raises:
        ValueError: a bad argument, more than one of ``num_groups``/``group_size``/``groups``, a name in
            ``groups`` that is not a BatchNorm, a count or size that does not divide ``C`` (the message
            names the layer and lists the valid ones), an uninitialized lazy BatchNorm, or a layer that
            sees a single value per sample.
        TypeError: ``module`` is not a module, or a BatchNorm subclass overrides ``forward`` and no converter
            is registered for it.
        RuntimeError: the probe forward with ``example_input`` failed.

    Example::

        model = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.ReLU())
        report = convert_batchnorm(model, example_input=torch.randn(2, 3, 8, 8))
        print(report)  # '1': BatchNorm2d(48) -> GroupNorm(24, 48), input (2, 48, 6, 6)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_batchnorm expects a torch.nn.Module, got {type(module).__name__}")
    num_groups = _check_group_options(num_groups, group_size, groups)
    found, names = _find_batchnorms(module, groups)
    report = ConversionReport(module=module)
    todo = _to_convert(found, names, groups, report)
    # Probe the input shape of every layer to convert, so no group ends up with a single value.
    shapes = _probe_input_shapes(module, todo, example_input) if todo and example_input is not None else {}
    replacements: dict[int, nn.Module] = {}
    for sub in todo:
        layer_names = tuple(names[id(sub)])
        count = _group_count(sub, layer_names, shapes.get(id(sub)), num_groups, group_size, groups, report)
        converter = _converter_for(type(sub))
        new = SwappedGroupNorm.from_batchnorm(sub, count) if converter is None else converter(sub, count)
        if isinstance(new, SwappedGroupNorm):
            new.layer_name = _display(layer_names)
        replacements[id(sub)] = new
        report.converted.append(
            ConvertedLayer(layer_names, _qualname(type(sub)), sub.num_features, count, shapes.get(id(sub)))
        )
    if report.unprobed:
        warnings.warn(
            f"BatchNorm1d layer(s) {', '.join(report.unprobed)} became GroupNorm(1, C), assuming (N, C) "
            "input; pass example_input (Lightning: set example_input_array) so their input shape is "
            "probed and layers that see (N, C, L) get more groups",
            UserWarning,
            stacklevel=2,
        )
    # Swap in place, in every parent (a shared layer is replaced by the same new module everywhere).
    report.module = _replace(module, replacements)
    return report


def _find_batchnorms(
    module: nn.Module, groups: Mapping[str, int] | None
) -> tuple[dict[int, nn.Module], dict[int, list[str]]]:
    """Every BatchNorm-like layer of ``module`` by id, with every name it has (a shared layer has several);
    a name in ``groups`` that is none of them is refused."""
    names: dict[int, list[str]] = {}
    found: dict[int, nn.Module] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, _BATCHNORMS) or _is_frozen_batchnorm_class(sub):
            found.setdefault(id(sub), sub)
            names.setdefault(id(sub), []).append(name)
    if groups is not None:
        all_names = {n for ns in names.values() for n in ns}
        unknown = sorted(set(groups) - all_names)
        if unknown:
            raise ValueError(
                f"groups names {unknown} that are not BatchNorm layers of the {type(module).__name__}; "
                f"its BatchNorm layers are {sorted(all_names)}"
            )
    return found, names


def _to_convert(
    found: dict[int, nn.Module],
    names: dict[int, list[str]],
    groups: Mapping[str, int] | None,
    report: ConversionReport,
) -> list[nn.Module]:
    """The layers to convert; the others go to ``report.skipped`` with why; what cannot be converted
    faithfully is refused."""
    todo: list[nn.Module] = []
    lazy: list[str] = []
    for key, sub in found.items():
        layer_names, kind = tuple(names[key]), _qualname(type(sub))
        if _is_frozen_batchnorm_class(sub):
            report.skipped.append(
                SkippedLayer(layer_names, kind, "frozen: fixed statistics, batch-independent")
            )
            continue
        params = [p for p in (getattr(sub, "weight", None), getattr(sub, "bias", None)) if p is not None]
        if params and not any(p.requires_grad for p in params):
            report.skipped.append(
                SkippedLayer(layer_names, kind, "frozen: requires_grad=False on weight and bias")
            )
            continue
        if groups is not None and not any(n in groups for n in layer_names):
            report.skipped.append(SkippedLayer(layer_names, kind, "not listed in groups"))
            continue
        if isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params():
            lazy.append(_display(layer_names))
            continue
        if _converter_for(type(sub)) is None and type(sub).forward not in _PLAIN_FORWARDS:
            raise TypeError(
                f"{_display(layer_names)} is a {kind}, a BatchNorm subclass that overrides forward; "
                "a GroupNorm would silently drop what its forward adds. Register a converter with "
                f"lightning_memopt.norm.register_converter({type(sub).__name__}, fn) or replace it yourself"
            )
        if any(is_dtensor(p) for p in params):
            raise ValueError(
                f"{_display(layer_names)} has sharded (DTensor) parameters; convert BatchNorm layers before "
                "sharding the model (before fully_shard / the strategy wraps it)"
            )
        todo.append(sub)
    if lazy:
        raise ValueError(
            f"lazy BatchNorm layer(s) {', '.join(lazy)} are not initialized yet, so their channel count is "
            "unknown; run one forward first, then convert"
        )
    return todo


def _group_count(
    sub: nn.Module,
    layer_names: tuple[str, ...],
    shape: tuple[int, ...] | None,
    num_groups: int | None,
    group_size: int | None,
    groups: Mapping[str, int] | None,
    report: ConversionReport,
) -> int:
    """The group count of one layer to convert (noted in ``report.unprobed`` where its shape is assumed)."""
    channels = sub.num_features
    spatial = None if shape is None else _prod(shape[2:])
    explicit = None
    if groups is not None:
        counts = {groups[n] for n in layer_names if n in groups}
        if len(counts) > 1:
            raise ValueError(
                f"groups gives different counts {sorted(counts)} to the shared layer {layer_names}"
            )
        (explicit,) = counts
    if spatial is None and isinstance(sub, nn.BatchNorm1d) and explicit is None:
        # BatchNorm1d sees (N, C) or (N, C, L); for (N, C) only one group avoids erasing the data.
        _check_group_size(_display(layer_names), channels, group_size)
        report.unprobed.append(_display(layer_names))
        return 1
    return _choose_groups(_display(layer_names), channels, spatial, num_groups, group_size, explicit)


def revert_groupnorm(module: nn.Module) -> nn.Module:
    """Put back the BatchNorm layers that :func:`convert_batchnorm` replaced, in place.

    Each :class:`SwappedGroupNorm` is replaced by the BatchNorm it was made from: same class and
    attributes (``eps``, ``momentum``, ``track_running_stats``, subclass state), the GroupNorm's current
    ``weight``/``bias`` Parameter objects and training flag, and the running statistics the BatchNorm
    had at the swap (or those loaded from a pre-swap checkpoint since), moved to the weight's device and
    floating dtype (reset to zeros/ones when the model was materialized from meta after the swap).

    Args:
        module: the converted model.

    Returns:
        The model: ``module`` itself, or the BatchNorm when ``module`` was a swapped GroupNorm.

    Example::

        report = convert_batchnorm(model)
        model = revert_groupnorm(report.module)
    """
    replacements: dict[int, nn.Module] = {}
    for sub in module.modules():
        if isinstance(sub, SwappedGroupNorm) and sub.batchnorm is not None:
            bn = sub.batchnorm
            for name in ("weight", "bias"):
                param = getattr(sub, name)
                if param is None:
                    bn.register_parameter(name, None)
                else:
                    setattr(bn, name, param)
            _restore_statistics(bn, sub)
            bn.train(sub.training)
            replacements[id(sub)] = bn
    return _replace(module, replacements)


def _restore_statistics(bn: nn.Module, gn: SwappedGroupNorm) -> None:
    """Give the held BatchNorm the statistics its GroupNorm carried (moved and cast with the model since)."""
    materialized = False
    for name in _RUNNING_STATS:
        held, carried = getattr(bn, name, None), gn._buffers.get(name)
        if isinstance(held, torch.Tensor) and carried is not None:
            materialized |= held.is_meta and not carried.is_meta
            setattr(bn, name, carried)
    if materialized and getattr(bn, "track_running_stats", False):
        bn.reset_running_stats()  # materialized from meta (to_empty) after the swap: fresh statistics


def _replace(root: nn.Module, replacements: dict[int, nn.Module]) -> nn.Module:
    if not replacements:
        return root
    for parent in root.modules():
        for child_name, child in parent._modules.items():
            if child is not None and id(child) in replacements:
                parent._modules[child_name] = replacements[id(child)]
    return replacements.get(id(root), root)


def _choose_groups(
    name: str,
    channels: int,
    spatial: int | None,
    num_groups: int,
    group_size: int | None,
    explicit: int | None,
) -> int:
    """Group count for a layer with ``channels`` channels and ``spatial`` values per channel (None=unknown)."""
    if spatial is not None and channels * spatial == 1:
        raise ValueError(
            f"{name} sees a single value per sample (1 channel, no spatial extent); any GroupNorm would "
            "output a constant. Remove the layer or convert the model with groups= leaving it out"
        )
    if explicit is not None:
        if channels % explicit:
            raise ValueError(
                f"groups gives {name} {explicit} groups, which does not divide its {channels} channels; "
                f"valid group counts: {_divisors(channels)}"
            )
        if spatial is not None and channels // explicit * spatial == 1:
            raise ValueError(
                f"groups gives {name} {explicit} groups, which leaves one value per group (output 0) for "
                f"its input without spatial extent; use 1 group or any of {_divisors(channels)[:-1]}"
            )
        return explicit
    _check_group_size(name, channels, group_size)
    if spatial == 1:
        return 1  # no spatial extent: normalize over all the features, like LayerNorm
    if group_size is not None:
        return channels // group_size
    return max(d for d in _divisors(channels) if d <= num_groups)


def _check_group_size(name: str, channels: int, group_size: int | None) -> None:
    # Checked for every layer before any shape rule (a layer without spatial extent gets 1 group): an
    # explicit group_size that does not fit a layer is a mistake to report, not to replace quietly.
    if group_size is not None and channels % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the {channels} channels of {name}; "
            f"valid group sizes: {_divisors(channels)}"
        )


def _probe_input_shapes(
    root: nn.Module, layers: list[nn.Module], example_input: Any
) -> dict[int, tuple[int, ...]]:
    shapes: dict[int, tuple[int, ...]] = {}

    def record(layer: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            shapes.setdefault(id(layer), tuple(args[0].shape))

    # Run where the model is and in its float dtype (when it has one device and one float dtype): a model
    # built on meta is probed with meta inputs, for free; a bf16 model gets bf16 inputs.
    devices = {p.device for p in root.parameters()}
    dtypes = {p.dtype for p in root.parameters() if p.is_floating_point()}
    device = next(iter(devices)) if len(devices) == 1 else None
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

    example_input = tree_map(move, example_input)
    handles = [layer.register_forward_pre_hook(record) for layer in layers]
    modes = [(m, m.training) for m in root.modules()]
    try:
        # eval: BatchNorm must not update its running statistics (and accepts a batch of one)
        root.eval()
        with torch.no_grad(), torch.random.fork_rng():
            if isinstance(example_input, tuple):
                root(*example_input)
            elif isinstance(example_input, dict):
                root(**example_input)
            else:
                root(example_input)
    except Exception as err:
        raise RuntimeError(
            f"probing BatchNorm input shapes with example_input failed ({type(err).__name__}: {err}); "
            "fix the example input or convert without it"
        ) from err
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training
    return shapes


def _converter_for(cls: type) -> Converter | None:
    for base in cls.__mro__:
        if base in _CONVERTERS:
            return _CONVERTERS[base]
    return None


def _is_frozen_batchnorm_class(module: nn.Module) -> bool:
    # torchvision.ops.FrozenBatchNorm2d and timm's FrozenBatchNorm2d/FrozenBatchNormAct2d, without importing
    # either: they are plain modules with fixed statistics in buffers.
    return any("FrozenBatchNorm" in cls.__name__ for cls in type(module).__mro__)


def _check_group_options(num_groups: Any, group_size: Any, groups: Any) -> int:
    """Check the three ways of choosing groups (at most one may be given); return the num_groups to use."""
    given = [
        name
        for name, value in (("num_groups", num_groups), ("group_size", group_size), ("groups", groups))
        if value is not None
    ]
    if len(given) > 1:
        # Otherwise one would silently win over the other(s).
        raise ValueError(
            f"pass one of num_groups=, group_size= or groups=, not {' and '.join(given)} "
            f"(got num_groups={num_groups!r}, group_size={group_size!r}, groups={groups!r})"
        )
    if num_groups is not None:
        check_positive_int("num_groups", num_groups)
    if group_size is not None:
        check_positive_int("group_size", group_size)
    if groups is not None:
        if not isinstance(groups, Mapping):
            raise ValueError(
                f"groups must be a mapping of layer name to group count (like report.groups), got {groups!r}"
            )
        for name, count in groups.items():
            check_positive_int(f"groups[{name!r}]", count)
    return _DEFAULT_GROUPS if num_groups is None else num_groups


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _display(names: tuple[str, ...] | list[str]) -> str:
    return " = ".join(repr(n) if n else "<root>" for n in names)
