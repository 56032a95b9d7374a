"""Kernel maps planned ahead: a new batch builds the maps that the latest batches asked for at once.

A network asks the same maps of every batch (they depend on the coordinates alone), one layer at a
time: each new coordinate set, table and neighbour query was its own launches, and each stride's
``unique`` and each submanifold map's pair count a host sync of its own (a MinkUNet: 14 Warp
launches, 4 + 5 syncs). Remembering which maps the last two batches of a device asked for (as
strides, geometries and the generative convs that made a set, not set ids: :class:`~.prebuild.MapSpec`),
the first map request of a new batch builds them all (:func:`.prebuild.build`). A planned map no layer asks
for again is built for nothing, and the plan forgets it after two batches. A plan of one map (a lone layer)
is left to the lazy build: there is nothing to batch.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from .. import config
from . import prebuild
from .batch import MapUse
from .host_copy import HostCopy
from .kernel_map import FILL_VIEW, RANKS_VIEW, KernelMap, KernelMapKey, Triple
from .prebuild import MapSpec, copy_pair_counts
from .sets import CoordinateSets

if TYPE_CHECKING:
    import torch

HISTORY = 2
"""Batches whose requests make the plan: a tensor built for something else between two batches
(a loss, a visualisation) does not make the next batch lose the network's plan."""


_history: dict[tuple[str, Triple], collections.deque] = {}
_failed: set[tuple[str, Triple]] = set()
_trained: dict[tuple[str, Triple], dict[tuple[MapSpec, bool], int]] = {}
"""Per device and input stride, the forward products the latest training pass made on each map: what
a new batch's maps expect (:attr:`~.batch.MapUse.forward_left`), kept past inference batches (a validation
pass between training steps must not cost the next step its released plans, and its memory peak)."""
_lock = threading.Lock()
logger = logging.getLogger("sparseconv.coords")


class Record:
    """The maps one coordinate cache asks for, in order (the plan of the batches after it)."""

    def __init__(self, signature: tuple[str, Triple]) -> None:
        self.specs: list[MapSpec] = []
        self.views: dict[MapSpec, dict[Hashable, None]] = {}
        """Per map, the keys of the views its layers used that a view builder makes (:attr:`KernelMap.on_view`,
        :attr:`~.batch.Builders.view_kinds`), in order."""
        self.adjoint_views: dict[MapSpec, dict[Hashable, None]] = {}
        """The same for the adjoint of the map (a transposed conv's, :meth:`KernelMap.transposed`)."""
        self.calls: dict[tuple[MapSpec, bool], dict[Hashable, None]] = {}
        """Per (map, its adjoint?), the recipes of the products its layers' first calls prepared
        (:meth:`~.batch.MapUse.note_call`), in order."""
        self.forward_counts: dict[tuple[MapSpec, bool], list[int]] = {}
        """Per (map, its adjoint?), the forward products of training passes on it (:attr:`~.batch.MapUse.forward_count`)."""
        self.expected: dict[tuple[MapSpec, bool], int] = {}
        """What the latest training pass counted (:data:`_trained`): each new map's :attr:`~.batch.MapUse.forward_left`."""
        self.uses: dict[MapSpec, list[int]] = {}
        """Per map, the products made on it and on its adjoint (:attr:`~.batch.MapUse.uses`)."""
        self.lone: MapSpec | None = None
        """The map of a lone layer (:attr:`~.batch.MapUse.lone`): the one map each of the last two batches
        asked for, each making one product on it."""
        self.counts: dict[KernelMapKey, Counted] = {}
        """The pair counts of the maps this batch built itself (not ahead), on their way to the host without a
        wait, with each map's table slots: the next batch's maps under the same keys take their fill from them
        (:meth:`KernelMap.fill`)."""
        self.hints: dict[KernelMapKey, Counted] = {}
        """The last batch's :attr:`counts`."""
        self.keep_tables: set[Triple] = set()
        """Strides whose hash tables a query after the plan needed (here or in the last batches): the
        cache keeps them when it drops the others (:meth:`~.cache.CoordinateCache._drop_tables`)."""
        with _lock:
            _history.setdefault(signature, collections.deque(maxlen=HISTORY)).append(self)

    def note(self, cache: CoordinateSets, key: KernelMapKey, kernel_map: KernelMap, use: MapUse) -> None:
        """Record the batch's first request of ``key`` (its map ``kernel_map``, with its ``use`` in the batch):
        its spec, and the cells that count its products and keep the views and products its layers use."""
        spec = spec_of(cache, key)
        if not (kernel_map.each_input_once or kernel_map.each_output_once or kernel_map.transpose_of is not None
                or "offset_counts" in kernel_map.__dict__):  # (pairs known, an adjoint's, counted ahead)
            self._hint(key, kernel_map, spec is not None and spec == self.lone)
        kinds = cache.batch.builders.view_kinds
        if spec is not None and spec not in self.specs:
            self.specs.append(spec)
            kernel_map.on_view = _recorder(self.views.setdefault(spec, {}), kinds)
            use.recipes = self._calls_of(use, (spec, False))
            use.spec = spec
            use.uses = self.uses.setdefault(spec, [0])
            use.lone = spec == self.lone
            self._count(use, (spec, False))
            _replay(kernel_map)
        source = kernel_map.transpose_of
        source_use = None if spec is not None or source is None else cache.batch.uses.get(id(source))
        if source_use is not None and source_use.spec in self.views:
            spec = source_use.spec
            use.uses = self.uses.setdefault(spec, [0])  # its products are its source's
            kernel_map.on_view = _recorder(self.adjoint_views.setdefault(spec, {}), kinds)
            use.recipes = self._calls_of(use, (spec, True))
            self._count(use, (spec, True))
            _replay(kernel_map)

    def _hint(self, key: KernelMapKey, kernel_map: KernelMap, lone: bool) -> None:
        """A map built here, not ahead: its fill from the last batch's map under ``key`` (a network asks for its
        maps in the same order every batch, so the same keys name the same layers' maps), and its own counts
        started on their way to the host for the next batch. Its tuner keys then wait for no count of its own
        (a host sync a map: 8 of a detection backbone's 18 a pass, its maps on generated sets not planned).

        A lone map (:attr:`~.batch.MapUse.lone`) is not counted at all in :data:`RECOUNT` batches but one: it
        carries the count of the last batch that counted, as its fill and as the ranks of its row orders' offsets
        (:data:`~.kernel_map.RANKS_VIEW`). The count and its copy were a third of such a map's host time (street1,
        H200), and nothing else of its one product reads them; a map that more products share keeps its own
        (a wgrad reads them on the host)."""
        hint = self.hints.get(key)
        if hint is not None:
            fill = hint.fill()  # copied during an earlier batch: no wait
            kernel_map.offer(FILL_VIEW, fill)
            if lone and hint.age < RECOUNT - 1:
                kernel_map.offer(RANKS_VIEW, hint.device)
                self.counts[key] = Counted(hint.device, hint.slots, hint.age + 1, pairs=fill[0])
                return
        copy = copy_pair_counts([kernel_map])
        slots = kernel_map.num_out * kernel_map.kernel_volume
        self.counts[key] = Counted(kernel_map.offset_counts, slots, 0, copy=copy)

    def _calls_of(self, use: MapUse, which: tuple[MapSpec, bool]) -> dict[Hashable, None]:
        """The recipes kept for ``which``: those prepared on this map ahead (its layers' first calls then
        find them prepared and record nothing), and those its layers prepare themselves."""
        planned, use.planned = use.planned, None
        calls = self.calls.get(which)
        if calls is None:
            calls = self.calls[which] = {} if planned is None else planned.copy()  # a copy keeps the hashes
        elif planned is not None:
            calls.update(planned)
        return calls

    def _count(self, use: MapUse, which: tuple[MapSpec, bool]) -> None:
        use.forward_count = self.forward_counts.setdefault(which, [0])
        use.forward_left = self.expected.get(which, 0)


RECOUNT = 8
"""A lone map's pairs are counted every this many batches (:meth:`Record._hint`)."""


class Counted:
    """A map's pair counts for the next batch's map under its key (:meth:`Record._hint`): ``device``, the (K,)
    counts on the device; ``slots``, the map's table slots; ``age``, the batches since they were counted; their
    sum ``pairs``, or ``copy``, the counts on their way to the host (read once, by :meth:`fill`)."""

    __slots__ = ("device", "slots", "age", "pairs", "copy")

    def __init__(self, device: torch.Tensor, slots: int, age: int, pairs: int | None = None,
                 copy: HostCopy | None = None) -> None:
        self.device, self.slots, self.age, self.pairs, self.copy = device, slots, age, pairs, copy

    def fill(self) -> tuple[int, int]:
        """(pairs, table slots) of the counted map."""
        if self.pairs is None:
            self.pairs, self.copy = sum(self.copy.values()), None
        return self.pairs, self.slots


def _recorder(keys: dict[Hashable, None], kinds: frozenset) -> Callable[[Hashable], None]:
    """A map's :attr:`KernelMap.on_view`: keeps in ``keys`` the views a builder makes (keys ``(kind, ...)``
    of a kind in ``kinds``, :attr:`~.batch.Builders.view_kinds`). A layer's other views (its problem, its tuner key, its prepared
    products: ~8 a map, keys holding dataclasses) were kept too, and merging two batches' keys compared
    them field by field: ~0.5 ms of a new batch's plan (room2, H200)."""

    def on_view(key: Hashable) -> None:
        if type(key) is tuple and key and key[0] in kinds:
            keys.setdefault(key)

    return on_view


def _replay(kernel_map: KernelMap) -> None:
    """Record the views a planned map holds before its first layer asks for it: those view builders
    made from others (a tile plan reads a row order), which the layers then never build or take, and
    which the next batch's builders need all the same."""
    for key in kernel_map.view_keys():
        kernel_map.on_view(key)


def begin(cache: CoordinateSets) -> tuple[Record, dict[KernelMapKey, tuple[KernelMap, int]]]:
    """At a cache's first map request: its record, and the maps of the plan built at once (none if
    the cache holds more than its input set, or SPARSECONV_PLAN_MAPS=0)."""
    first = cache.coord_set(0)
    signature = (str(cache.device), first.stride)
    with _lock:
        earlier = list(_history.get(signature, ()))
    plan = list(dict.fromkeys(spec for record in earlier for spec in record.specs))
    record = Record(signature)
    with _lock:
        for earlier_record in earlier:  # oldest first
            counts = {which: count[0] for which, count in earlier_record.forward_counts.items() if count[0]}
            if counts:
                _trained[signature] = counts
            record.keep_tables |= earlier_record.keep_tables
        record.expected = _trained.get(signature, {})
    lone = len(plan) == 1 and len(earlier) == HISTORY
    if lone and all(r.specs == plan and r.uses[plan[0]] == [1] for r in earlier):
        record.lone = plan[0]
    if earlier:
        record.hints = earlier[-1].counts
    fresh = cache.set_count() == 1 and first.canonical and first.coords.shape[0] > 0
    # A plan of one map batches nothing, and the layer's own build of it takes fewer host steps (a lone
    # conv on new coordinates: 0.07-0.2 ms less for a submanifold map, 0.35-0.41 ms for a strided one,
    # whose planned query also makes the transposed table; H200, street1 to street4).
    if not (len(plan) > 1 and fresh and config.plan_maps()) or signature in _failed:
        return record, {}
    views: dict[tuple[MapSpec, bool], dict[Hashable, None]] = {}  # by (map, its adjoint?)
    for earlier_record in earlier:
        for adjoint, by_spec in ((False, earlier_record.views), (True, earlier_record.adjoint_views)):
            for spec, keys in by_spec.items():
                views.setdefault((spec, adjoint), {}).update(keys)
    calls = next((r.calls for r in reversed(earlier) if r.calls), {})  # the latest batch's, unmerged (read only)
    try:
        return record, prebuild.build(cache, plan, views, calls)
    except Exception as error:  # noqa: BLE001 - a plan must never cost a batch its maps
        # The sets registered before the failure are complete (registered after their tables),
        # so the layers build the rest as without a plan. Planning stays off for this device.
        _failed.add(signature)
        logger.warning("sparseconv: building the planned kernel maps failed on %s (%s: %s); each map is "
                       "built when a layer asks for it from now on", signature[0], type(error).__name__, error)
        return record, {}


def spec_of(cache: CoordinateSets, key: KernelMapKey) -> MapSpec | None:
    """The plannable description of ``key``, or None: transposed maps are adjoints of strided ones; a set
    neither canonical nor generated from one depends on more than the input, and so does the output of a
    strided, not generative map from a generated set."""
    if key.transposed:
        return None
    source = cache.coord_set(key.source)
    origin = () if source.canonical else cache.origin(key.source)
    if origin is None or (origin and not key.generative and key.stride != (1, 1, 1)):
        return None
    return MapSpec(source.stride, key.kernel_size, key.stride, key.dilation, origin, key.generative)
