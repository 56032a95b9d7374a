"""One batch's shared state beside its maps: what its layers keep while they run, in one object.

A :class:`~.cache.CoordinateCache` holds a batch's coordinate sets, tables and kernel maps; its :class:`Batch`
holds the rest of what the batch's layers share: the map plan's record of the batch and the maps it built
ahead, the builders the floor above passed in (:class:`Builders`), and per map a :class:`MapUse` (the
tuner's prepared products on it, the plan's counts of its products, whether it serves one product alone). A
:class:`~.kernel_map.KernelMap` is the map and its views; nothing here is stored on it but its device kernels (the
plan's estimates of its counts are views it offers the map: :data:`~.kernel_map.FILL_VIEW`).

Nothing is registered at import: the floor above names its builders in one place
(:mod:`sparseconv.ops.batch`) and passes them with each map request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import NamedTuple

from .kernel_map import KernelMap, KernelMapKey, MapKernels

ViewBuilder = Callable[[list[tuple[KernelMap, list[Hashable]]]], None]
"""builder([(map, keys of the views its counterpart in the last batches used)]): builds those of the views it
knows together and :meth:`~.kernel_map.KernelMap.offer` s them (the plan knows a key by its kind alone)."""

CallBuilder = Callable[[list[tuple[KernelMap, "MapUse", list[Hashable]]]], None]
"""builder([(map, its use, recipes of the products its counterpart's layers prepared in the last batch)]):
prepares them on the new maps ahead of the layers' first calls, into :attr:`MapUse.calls`."""


class Builders(NamedTuple):
    """What a batch's maps are built with beyond coords' own kernels, passed in by the floor above (the
    library's: :data:`sparseconv.ops.batch.BUILDERS`): the maps' pair kernels, the view builders the map plan
    runs on a new batch's maps (in order: a later one may read an earlier one's views), the first items of
    the view keys they make (what the plan records of the layers' views), and the call builder the plan
    runs after them. A cache given none builds maps alone, pairs and counts by torch's ops."""

    kernels: MapKernels | None = None
    views: tuple[ViewBuilder, ...] = ()
    view_kinds: frozenset = frozenset()
    prepare: CallBuilder | None = None


class MapUse:
    """One map's use in its batch: the products prepared on it and the map plan's bookkeeping of it.

    ``calls``: the tuner's memo of the products prepared on the map (each one's settled choice and prepared
    call): a layer's later calls on the map go straight to its kernels. The rest is the plan's: ``spec``, what
    it knows the map by (:class:`~.prebuild.MapSpec`; None for an adjoint, recorded under its source's);
    ``uses``, the products made on the map (a cell of the plan's record, read by the next batches:
    :attr:`lone`); ``recipes``, where the products prepared at layers' first calls are recorded
    (prepared ahead on the next batch's map); ``forward_count`` / ``forward_left``, the forward products of a
    training pass on the map and how many are still expected (:meth:`forward_done`)."""

    __slots__ = ("map", "_batch", "calls", "spec", "uses", "recipes", "planned", "forward_count", "forward_left",
                 "lone")

    def __init__(self, kernel_map: KernelMap, batch: Batch) -> None:
        # The batch by a weak reference: a cycle between it and its uses would hold a batch's maps, views and
        # prepared products (GPU memory) until a full garbage collection, batch after batch.
        self.map, self._batch = kernel_map, weakref.ref(batch)
        self.calls: dict[Hashable, object] = {}
        self.spec: Hashable | None = None  # (a MapSpec: the plan sits above this module)
        self.uses: list[int] | None = None
        self.recipes: dict[Hashable, None] | None = None
        self.planned: dict[Hashable, None] | None = None
        """Recipes prepared on this map ahead (by the plan's call builder): its record keeps them."""
        self.forward_count: list[int] | None = None
        self.forward_left = 0
        self.lone = False
        """The map serves one product a batch, built alone: the last two batches asked for this map and no other,
        and made one product on it (a lone layer's inference). Set by the map plan; the layer's problem then says
        so (:attr:`~sparseconv.backends.problem.ConvProblem.lone`), and the tuner times its candidates with the
        views they build (:meth:`~.kernel_map.KernelMap.unviewed`), which no other product shares."""

    def used(self) -> None:
        """Count a product made on the map (every product: forward, dgrad and wgrad)."""
        uses = self.uses
        if uses is not None:
            uses[0] += 1

    def note_call(self, recipe: Hashable) -> None:
        """Record a product a layer's first call prepared on the map (``recipe``: opaque here): the next
        batch's map has it prepared ahead."""
        recipes = self.recipes
        if recipes is not None:
            recipes.setdefault(recipe)

    def forward_done(self) -> None:
        """Count a forward product of a training pass on this map; after the last one the last batches made,
        release the releasable views and drop the prepared products that hold them (:meth:`release`): what
        only backward reads again need not wait in memory through the rest of the forward pass, where the
        activations peak. A later product restores them (a network that changed between batches costs time,
        never a wrong result)."""
        count = self.forward_count
        if count is not None:
            count[0] += 1
        left = self.forward_left
        if left > 0:
            self.forward_left = left - 1
            if left == 1:
                self.release()

    def release(self) -> None:
        """Release the map's releasable views (:meth:`KernelMap.release_views`) and forget the calls prepared
        on it and on its adjoint, which may hold them: the next product is prepared again."""
        batch = self._batch()
        for kernel_map in self.map.release_views():
            use = None if batch is None else batch.uses.get(id(kernel_map))
            if use is not None:
                use.calls.clear()


class Batch:
    """One batch's shared state (a :class:`~.cache.CoordinateCache` holds one): the builders it was given,
    the map plan's :class:`~.plan.Record` of it (None until its first map request), the maps the plan built
    ahead that no layer asked for yet, and each map's :class:`MapUse`."""

    def __init__(self) -> None:
        self.builders = Builders()
        self.record = None  # (a plan.Record: the plan sits above this module)
        self.planned: dict[KernelMapKey, tuple[KernelMap, int]] = {}
        self.uses: dict[int, MapUse] = {}
        """By the map's id: a use holds its map, so no other map takes the id while the batch lives."""
        self.capacity = None
        """What runs the convs of a graphed pass (:class:`sparseconv.ops.capacity.CapacityMaps`, above this floor: its
        fixed-size maps) or of its recording (:class:`~sparseconv.ops.capacity.MapRecorder`); None otherwise."""

    def use(self, kernel_map: KernelMap) -> MapUse:
        """The map's :class:`MapUse` in this batch (made on first use)."""
        use = self.uses.get(id(kernel_map))
        if use is None:
            use = self.uses[id(kernel_map)] = MapUse(kernel_map, self)
        return use
