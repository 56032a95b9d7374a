"""Small device tensors copied to the host without waiting for the work queued after them (:class:`HostCopy`),
and torch's current stream per device, looked up cheaply (:func:`current_stream`)."""

from __future__ import annotations

import torch


class HostCopy:
    """A small device tensor's values on the host, copied without waiting for them: :meth:`values`
    waits for the copy alone (an event recorded after it), not for the work queued since, as
    ``tolist`` would. The map plan's pair counts: the host goes on to the views and the first
    layers while the GPU runs the neighbour queries, instead of idling until they finish
    (a training step's tuner keys read the counts; a layer's own build reads them at once)."""

    __slots__ = ("_host", "_event", "_values", "_slot")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event, self._values, self._slot = None, None, None
        if tensor.is_cuda:
            # Pinned memory (a copy from pageable memory would wait for the stream), from a few kept
            # slots with their events: a pinned allocation and a new event cost a batch ~25 µs of host time.
            self._slot = _take_slot(tensor)
            if self._slot is None:
                self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            else:
                buffer, self._event, _, views = self._slot
                self._host = views.get(tensor.shape)  # a slot keeps its views (a slice and a view: ~7 µs)
                if self._host is None:
                    if len(views) > 16:  # shapes of many kinds: do not hold them all
                        views.clear()
                    self._host = views[tensor.shape] = buffer[: tensor.numel()].view(tensor.shape)
            self._host.copy_(tensor, non_blocking=True)
            self._event.record(current_stream(tensor.get_device()))  # on the tensor's device's current stream
        else:
            self._host = tensor

    def values(self) -> list:
        """The values as a list (the copy waited for once)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
            self._give_back()
        return self._values

    def _give_back(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None and _SLOTS is not None:  # (None: the interpreter is shutting down)
            self._host = None
            free = _SLOTS.setdefault(slot[2], [])
            if len(free) < _KEPT_SLOTS:
                free.append(slot)

    def __del__(self) -> None:  # never read: its slot is taken again once its copy is done
        self._give_back()


_SLOT_ENTRIES = 512
"""int64 entries of a kept pinned slot (a MinkUNet batch's pair counts take ~200)."""
_KEPT_SLOTS = 4
_SLOTS: dict[int, list] = {}
"""Device index -> free (pinned int64 buffer, its event, device index, its views by shape) slots of :class:`HostCopy`."""


def _take_slot(tensor: torch.Tensor) -> tuple | None:
    """A kept slot for ``tensor`` (int64, at most :data:`_SLOT_ENTRIES` entries) whose last copy is done, else None."""
    if tensor.dtype != torch.int64 or tensor.numel() > _SLOT_ENTRIES:
        return None
    index = tensor.get_device()
    free = _SLOTS.get(index)
    while free:
        try:
            slot = free.pop()
        except IndexError:  # another thread took the last one
            break
        if slot[1].query():  # a slot given back unread may still be copying into
            return slot
    return (torch.empty(_SLOT_ENTRIES, dtype=torch.int64, pin_memory=True), torch.cuda.Event(), index, {})


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(index: int) -> torch.cuda.Stream:
    """torch's current stream on device ``index``, its object kept per raw stream: torch.cuda.current_stream
    builds a new one each call (~7 µs of host time; the raw stream's lookup is ~20x cheaper). The
    :class:`HostCopy` events and the Warp launches (:mod:`.hashing`) are recorded and queued on it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(index)
    key = (index, raw(index))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) > 256:  # streams made and dropped in a loop: do not hold them all
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream
