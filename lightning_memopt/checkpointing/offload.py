"""Activation offload that overlaps with compute: saved tensors go to pinned host memory on side streams.

The ``offload`` treatment of a block, on a CUDA device. Autograd's saved-tensor hooks see every tensor the
block keeps for backward; those worth moving go to the host while the forward goes on, and come back,
one block ahead, while the backward goes on. One :class:`Offloader` per device is shared by every
offloaded block (the prefetch needs to know which block ran before which).

Forward, ``pack(t)`` for a tensor of at least ``min_bytes`` that is not a parameter or buffer of the block
(a tensor the block saves twice, such as an input of two linear layers, moves once):

1. the device-to-host stream waits for the compute stream (``t`` is produced there);
2. on that stream ``t`` is copied into a pinned buffer taken from a pool, and an event is recorded;
3. ``t`` stays referenced until that event has completed: the caching allocator would otherwise hand its
   memory to the next kernel while the copy still reads it. These are the bytes *in flight*; past
   ``max_in_flight`` the host waits for the oldest copies, so offloading never holds more than that much
   extra device memory.

Backward, ``unpack(handle)``:

1. the first unpack waits for the copies still in flight (the forward is over: nothing to overlap with);
2. the first unpack of a block's tensor brings back all of that block's tensors *and* those of the block
   that ran just before it in forward (the next one backward reaches, prefetched while this one computes)
   on the host-to-device stream, which first waits for the compute stream (the destination memory is
   allocated on it);
3. the compute stream waits for the copy's event, and gets the tensor.

A pinned buffer goes back to the pool when autograd frees the saved tensor; the next copy into it waits
for the last copy out of it. Pinning memory synchronizes the device, so the pool allocates once per size
(a training step repeats its shapes) and reuses afterwards.

Everything that touches ``torch.cuda`` goes through :mod:`lightning_memopt.memory.device`, which tests fake
on CPU (CPU tensors then play the device's).

Combining with full checkpointing: a fully checkpointed block keeps only its inputs, and non-reentrant
checkpointing saves them through the saved-tensor hooks in force around it, so entering
:class:`OffloadHooks` around ``checkpoint(...)`` (:func:`offloading` does it around blocks) offloads
exactly those inputs; the recomputation in backward unpacks them. The planner does not offer that
combination as a treatment yet.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_memopt.memory.device import (
    current_stream,
    indexed,
    new_event,
    new_stream,
    pinned_empty,
    use_stream,
)
from lightning_memopt.memory.units import parse_bytes

__all__ = [
    "OFFLOAD_DEVICE_TYPES",
    "Offloader",
    "OffloadHooks",
    "overlapped_offload",
    "offloader_for",
    "offloading",
    "release_offloaders",
]

OFFLOAD_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Device types whose tensors the overlapped offload moves (tests add ``"cpu"`` with a faked ``torch.cuda``)."""

DEFAULT_MIN_BYTES = 2**20
# Enough to keep the link busy while several blocks compute (a PCIe 5 link moves ~50 MB in the millisecond
# a 1B model's block takes at sequence 4096), small next to a card: the planner does not count these bytes.
DEFAULT_MAX_IN_FLIGHT = 256 * 2**20


class _Host:
    """A pinned buffer, and the event after which the last copy out of it is done (None: never read)."""

    __slots__ = ("buffer", "read")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.read: Any = None


class _Pool:
    """Pinned buffers by exact byte size, allocated once and reused."""

    def __init__(self) -> None:
        self._free: dict[int, list[_Host]] = collections.defaultdict(list)
        self.pinned_bytes = 0  # all buffers the pool has allocated (free or in use)
        self.allocations = 0

    def take(self, nbytes: int) -> _Host:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.pinned_bytes += nbytes
        self.allocations += 1
        return _Host(pinned_empty(nbytes))

    def give(self, host: _Host) -> None:
        self._free[host.buffer.numel()].append(host)

    @property
    def free_bytes(self) -> int:
        return sum(n * len(hosts) for n, hosts in self._free.items())

    def clear(self) -> None:
        """Drop the free buffers (those in use go when autograd frees them; the pool then no longer counts
        them)."""
        self.pinned_bytes -= self.free_bytes
        self._free.clear()


class _Group:
    """The tensors one call of an offloaded block saved, and the group of the block that ran before it."""

    def __init__(self, prev: _Group | None) -> None:
        # Weak references only: the handles autograd holds keep their group alive, never the reverse, so a
        # freed graph returns its buffers to the pool.
        self.prev = weakref.ref(prev) if prev is not None else None
        self.saved: weakref.WeakSet[_Saved] = weakref.WeakSet()
        # id(tensor) -> (the tensor, its _Saved), both weakly: a tensor saved twice (by two ops) moves once
        self.by_tensor: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        # id(base) -> (the base, the _Saved of a tensor that is its whole storage), both weakly: another view
        # of that storage (attention weights saved as (B, h, T, T) and as (B * h, T, T)) moves with it
        self.by_base: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self.fetched = False  # its tensors' copies back to the device are queued
        self.started = False  # backward has unpacked one of its tensors


class _Saved:
    """One offloaded tensor: its pinned copy and where it is on its round trip."""

    __slots__ = (
        "group",
        "host",
        "shape",
        "dtype",
        "version",
        "uses",
        "pending",
        "copied",
        "on_device",
        "arrived",
        "__weakref__",
    )

    def __init__(self, group: _Group, host: _Host, t: torch.Tensor, copied: Any) -> None:
        self.group = group
        self.host = host
        self.shape, self.dtype, self.version = t.shape, t.dtype, t._version
        self.uses = self.pending = 1  # packs that returned this handle / unpacks left in this backward
        self.copied = copied  # event: the copy to the host is done
        self.on_device: torch.Tensor | None = None  # brought back, not yet handed to autograd
        self.arrived: Any = None  # event: the copy back is done

    def host_view(self) -> torch.Tensor:
        return self.host.buffer.view(self.dtype).view(self.shape)


class _View:
    """A saved tensor that shares the storage of an offloaded one (:class:`_Saved` ``base``, which is its whole
    storage): nothing more is copied; backward gets the same view of the base brought back."""

    __slots__ = ("base", "shape", "stride", "offset")

    def __init__(self, base: _Saved, t: torch.Tensor) -> None:
        self.base, self.shape, self.stride, self.offset = base, t.shape, t.stride(), t.storage_offset()


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage, all of it, in order: any view of that storage can be made from a copy of
    ``t`` (with ``as_strided``)."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
        return None


class Offloader:
    """Streams, pinned pool and in-flight queue of the overlapped offload on one device.

    Args:
        device: The device whose saved tensors move to the host.
        min_bytes: Tensors smaller than this stay on the device (a copy's launch costs more than they save).
            Bytes, or a string such as ``"1MiB"``. Default 1 MiB.
        max_in_flight: Bytes of device tensors that may wait for their copy to the host before the forward
            waits for the oldest. Bounds the extra device memory offloading holds. Default 256 MiB.

    Raises:
        ValueError: a ``min_bytes`` or ``max_in_flight`` that is not a byte size (``min_bytes`` may be 0).

    Example::

        >>> offloader = Offloader("cuda", min_bytes="1MiB", max_in_flight="512MiB")  # doctest: +SKIP
        >>> with OffloadHooks(offloader, block):  # doctest: +SKIP
        ...     out = block(x)
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        min_bytes: int | str = DEFAULT_MIN_BYTES,
        max_in_flight: int | str = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self.device = indexed(device)
        self.min_bytes = 0 if min_bytes == 0 else parse_bytes(min_bytes, name="min_bytes")
        self.max_in_flight = parse_bytes(max_in_flight, name="max_in_flight")
        self.to_host = new_stream(self.device)
        self.to_device = new_stream(self.device)
        self.pool = _Pool()
        self._in_flight: collections.deque[tuple[Any, torch.Tensor, int]] = collections.deque()
        self.in_flight_bytes = 0
        self.waits = 0  # times the forward waited because too many bytes were in flight
        self.offloaded_bytes = 0  # bytes copied to the host since creation
        self._last: weakref.ref[_Group] | None = None

    def new_group(self) -> _Group:
        """Start the saved tensors of one block call (the prefetch in backward goes group by group)."""
        group = _Group(self._last() if self._last is not None else None)
        self._last = weakref.ref(group)
        return group

    def offloads(self, t: torch.Tensor, keep: set[int | None]) -> bool:
        """Whether ``pack`` moves ``t``: a plain tensor on this device, large enough, not in ``keep``."""
        return (
            type(t) is torch.Tensor  # parameters, and subclasses such as DTensor, stay
            and t.device == self.device
            and t.numel() > 0
            and t.numel() * t.element_size() >= self.min_bytes
            # an expanded view (a broadcast mask) would come back materialized, larger than it left
            and t.numel() * t.element_size() <= t.untyped_storage().nbytes()
            and _storage_ptr(t) not in keep
        )

    def pack(self, t: torch.Tensor, group: _Group) -> _Saved | _View:
        """Start copying ``t`` to a pinned buffer on the device-to-host stream (once per tensor, and once per
        storage where a tensor saved before is that whole storage: a :class:`_View` of it)."""
        tensor_ref, saved_ref = group.by_tensor.get(id(t), (None, None))
        saved = saved_ref() if saved_ref is not None else None
        if tensor_ref is not None and tensor_ref() is t and saved is not None and saved.version == t._version:
            saved.uses += 1
            saved.pending += 1
            return saved
        # A view holds its base alive: the same base object alive means the same storage
        base = t._base if t._base is not None else t
        base_ref, saved_ref = group.by_base.get(id(base), (None, None))
        saved = saved_ref() if saved_ref is not None else None
        if (
            base_ref is not None
            and base_ref() is base
            and saved is not None
            and saved.version == t._version
            and saved.dtype == t.dtype
        ):
            saved.uses += 1
            saved.pending += 1
            return _View(saved, t)
        nbytes = t.numel() * t.element_size()
        host = self.pool.take(nbytes)
        self.to_host.wait_stream(current_stream(self.device))
        if host.read is not None:
            self.to_host.wait_event(host.read)  # the buffer's last copy back must be done
        with torch.no_grad(), use_stream(self.to_host):
            host.buffer.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            copied = new_event()
            copied.record(self.to_host)
        saved = _Saved(group, host, t, copied)
        group.saved.add(saved)
        group.by_tensor[id(t)] = (weakref.ref(t), weakref.ref(saved))
        if _whole_storage(t):
            group.by_base[id(base)] = (weakref.ref(base), weakref.ref(saved))
        weakref.finalize(saved, self.pool.give, host)
        self._in_flight.append((copied, t, nbytes))
        self.in_flight_bytes += nbytes
        self.offloaded_bytes += nbytes
        self._retire(bound=self.max_in_flight)
        return saved

    def unpack(self, packed: Any) -> torch.Tensor:
        """The device tensor of ``packed`` (anything ``pack`` did not move comes back as it is)."""
        if isinstance(packed, _View):
            return self.unpack(packed.base).as_strided(packed.shape, packed.stride, packed.offset)
        if not isinstance(packed, _Saved):
            return packed
        self._retire(bound=-1)  # backward has begun: wait for what the forward left in flight
        group = packed.group
        if not group.started:  # backward reached this block: bring it back, and the one it reaches next
            group.started = True
            prev = group.prev() if group.prev is not None else None
            self._fetch([g for g in (group, prev) if g is not None and not g.fetched])
        if packed.on_device is None:  # unpacked before (a retained graph): bring it back again
            self._fetch_saved([packed])
        t = packed.on_device
        packed.pending -= 1
        if packed.pending <= 0:  # its last use in this backward: autograd alone holds the device tensor now
            packed.on_device, packed.pending = None, packed.uses
        current_stream(self.device).wait_event(packed.arrived)
        return t

    def _retire(self, *, bound: int) -> None:
        """Drop finished copies from the in-flight queue; wait for the oldest while over ``bound`` bytes."""
        while self._in_flight:
            event = self._in_flight[0][0]
            if not event.query():
                if self.in_flight_bytes <= bound:
                    break
                self.waits += bound >= 0  # waits for the bound, not the drain at the start of backward
                event.synchronize()
            _, _, nbytes = self._in_flight.popleft()
            self.in_flight_bytes -= nbytes

    def _fetch(self, groups: Iterable[_Group]) -> None:
        saved = []
        for group in groups:
            group.fetched = True
            saved += [s for s in group.saved if s.on_device is None]
        self._fetch_saved(saved)

    def _fetch_saved(self, saved: list[_Saved]) -> None:
        """Copy ``saved`` back to the device on the host-to-device stream, behind one event."""
        if not saved:
            return
        # Allocated on the compute stream, outside the copy stream's context, so that the caching
        # allocator ties the memory to the stream that uses and frees it; the copy stream waits for the
        # compute stream so it never writes memory that queued kernels still read.
        targets = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in saved]
        self.to_device.wait_stream(current_stream(self.device))
        with torch.no_grad(), use_stream(self.to_device):
            for s, target in zip(saved, targets):
                self.to_device.wait_event(s.copied)
                target.copy_(s.host_view(), non_blocking=True)
            arrived = new_event()
            arrived.record(self.to_device)
        for s, target in zip(saved, targets):
            s.on_device, s.arrived, s.host.read = target, arrived, arrived

    def release(self) -> None:
        """Wait for copies in flight and free the pool's unused pinned buffers."""
        self._retire(bound=-1)
        self.pool.clear()


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload what one block saves through ``offloader``.

    Args:
        offloader: The device's :class:`Offloader`.
        block: The block whose parameters and buffers (and views of them) are never moved; None: none.
        notify: Called with each pinned host copy (``observe_saved`` counts them as transfer bytes).
    """

    def __init__(
        self,
        offloader: Offloader,
        block: nn.Module | None = None,
        notify: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.offloader = offloader
        keep: set[int | None] = set()
        if block is not None:
            keep = {_storage_ptr(p) for p in block.parameters()} | {_storage_ptr(b) for b in block.buffers()}
        self._group: _Group | None = None

        def pack(t: torch.Tensor):
            if not offloader.offloads(t, keep):
                return t
            saved = offloader.pack(t, self._group)
            if notify is not None and isinstance(saved, _Saved) and saved.uses == 1:  # a new copy
                notify(saved.host_view())
            return saved

        super().__init__(pack, offloader.unpack)

    def __enter__(self) -> None:
        self._group = self.offloader.new_group()
        super().__enter__()


_OFFLOADERS: dict[torch.device, Offloader] = {}


def offloader_for(device: torch.device | str, **options: Any) -> Offloader:
    """The shared :class:`Offloader` of ``device``; ``options`` (those of :class:`Offloader`) replace it."""
    device = indexed(device)
    if options or device not in _OFFLOADERS:
        if device in _OFFLOADERS:
            _OFFLOADERS[device].release()
        _OFFLOADERS[device] = Offloader(device, **options)
    return _OFFLOADERS[device]


def release_offloaders() -> None:
    """Forget every shared :class:`Offloader` and free their pinned pools (after training)."""
    while _OFFLOADERS:
        _OFFLOADERS.popitem()[1].release()


def overlapped_offload(
    block: nn.Module, inputs: Any, notify: Callable[[torch.Tensor], None] | None = None
) -> OffloadHooks | None:
    """The overlapped offload of ``block`` called on ``inputs``, or None when no input tensor is on a device
    of :data:`OFFLOAD_DEVICE_TYPES` (the caller then copies without overlap, or not at all)."""
    device = next(
        (
            t.device
            for t in tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.device.type in OFFLOAD_DEVICE_TYPES
        ),
        None,
    )
    if device is None:
        return None
    return OffloadHooks(offloader_for(device), block, notify)


@contextlib.contextmanager
def offloading(blocks: Iterable[nn.Module], offloader: Offloader) -> Iterator[None]:
    """Offload what each of ``blocks`` saves for backward while the context lasts, whatever treatment
    :func:`~lightning_memopt.checkpointing.apply_checkpointing` gave it.

    Around a fully checkpointed block this offloads only the block's inputs (all that it keeps): the
    cheapest large saving, as the inputs are few bytes to move and the rest is recomputed.

    Example::

        >>> apply_checkpointing(model, {name: "full" for name, _ in blocks})  # doctest: +SKIP
        >>> with offloading([b for _, b in blocks], offloader_for("cuda")):  # doctest: +SKIP
        ...     loss = model(x).sum()
    """
    entered: list[OffloadHooks] = []

    def enter(block: nn.Module, args) -> None:
        hooks = OffloadHooks(offloader, block)
        hooks.__enter__()
        entered.append(hooks)

    def leave(block: nn.Module, args, output) -> None:
        entered.pop().__exit__(None, None, None)

    handles = []
    try:
        for block in blocks:
            handles.append(block.register_forward_pre_hook(enter))
            # always_call: a forward that raises still pops its hooks
            handles.append(block.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
