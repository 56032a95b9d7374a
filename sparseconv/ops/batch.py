"""The builders a batch's maps are built with, named in one place, and the map request the operators make.

The coordinate floor builds maps alone (Warp hash queries, torch's ops); a batch's maps go faster with what
lives above it, which is passed in here rather than registered at import: the backends' Triton kernels for
a map's pair lists and pair counts, the map plan's view builders (a new batch's row orders and tile plans,
several maps' in one launch) and the tuner's call builder (the products the last batch's layers prepared,
prepared on the new maps ahead of the layers' first calls).
"""

from __future__ import annotations

from .. import tune
from ..backends import compiling, mask_views, planned_views
from ..coords.batch import Builders, MapUse
from ..coords.cache import CoordinateCache
from ..coords.kernel_map import KernelMap, KernelMapKey, MapKernels
from .dispatch import check_settings

BUILDERS = Builders(
    kernels=MapKernels(pair_lists=mask_views.pair_lists_on_gpu, pair_counts=planned_views.pair_counts_on_gpu),
    views=(planned_views.build_planned_orders, planned_views.build_planned_tile_plans),  # tile plans read the orders
    view_kinds=planned_views.VIEW_KINDS,
    prepare=tune.prepare_planned,
)
"""What the library builds a batch's maps with (:class:`~sparseconv.coords.batch.Builders`)."""

MAPS_ONLY = Builders(kernels=BUILDERS.kernels)
"""What a graphed pass's batches are built with (:mod:`sparseconv.nn.graphed`): the maps alone. Its convs build
their views inside the graph, so the views and prepared products of the eager layers would be built for
nothing (GPU sorts and tile plans, and the host's preparing of ~40 products a MinkUNet batch)."""


def kernel_map(cache: CoordinateCache, key: KernelMapKey, builders: Builders = BUILDERS
               ) -> tuple[KernelMap, MapUse, int]:
    """The kernel map of ``key`` in ``cache``'s batch (built with ``builders``, taken at the batch's first request),
    its use in the batch (:class:`~sparseconv.coords.batch.MapUse`: what the tuner and the plan keep of it) and the
    id of its output coordinate set. A batch's first request checks every product's settings first
    (:func:`check_settings`), and on a GPU starts the background compile workers if none run yet
    (:func:`~sparseconv.backends.compiling.prestart`)."""
    if cache.batch.record is None:
        check_settings()
        compiling.prestart(cache.device)
    found, out_id = cache.kernel_map(key, builders)
    return found, cache.batch.use(found), out_id
