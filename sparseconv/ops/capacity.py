"""Capacity passes: a network's convolutions over neighbour tables of fixed sizes, for CUDA-graph capture.

A captured pass replays the same launches with the same sizes on every point cloud, so what changes between
clouds must live in buffers the launches read. In a capacity pass every coordinate set of the batch has a
*capacity* (rows of its features: at least its count) and every kernel map is a (capacity of its output set, K)
int32 neighbour table whose rows past the map's output count hold -1 (:class:`CapacityMaps`). A conv is then
mask_implicit_gemm's product over its table (:meth:`CapacityMaps.conv`; a row of -1 reads nothing and stores
zeros), its views built on the device from the table, sized by the capacities, never by the cloud, with no host
synchronisation. Rows past a set's count hold whatever the pass computes there; no valid row reads them (a
table's valid rows name valid rows only) and row-wise operations (norms, activations, 1x1 convs,
concatenations, residual sums) keep rows apart, so they never change a result.

Before each replay the batch's maps are queried straight into the tables with no host synchronisation where
the network's maps are those of the input's power-of-two floors and their transposes (a MinkUNet's:
:meth:`CapacityMaps.build`, :mod:`sparseconv.coords.fixed`), else built eagerly (the map plan, host syncs and
all) and copied in (:meth:`CapacityMaps.load`); what is captured is everything after that: the features' whole
pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from .. import tune
from ..backends import mask_triton, table_gemm
from ..backends.problem import layer_problem
from ..coords.batch import Batch
from ..coords.cache import CoordinateCache
from ..coords.fixed import FixedMaps
from ..coords.host_copy import HostCopy
from ..coords.kernel_map import KernelMap, KernelMapKey, Triple
from ..coords.prebuild import ALIGN
from ..tune.timing import Timer, TimingPlan
from . import batch

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

TIMING = TimingPlan(warmup=1, repeats=5, flush_l2=False, min_repeats=3)
"""How a capacity conv's table tiles are timed where the tuner does not choose (once per layer and bucket)."""

PRODUCT = "AB_gather_scatter"
PIN = ("mask_implicit_gemm",)
"""What a capacity pass's convs run: the backend whose views (row orders, tile plans) are built on the device
from the table alone, so that a captured pass builds them again from each new table."""

SLACK = 256
"""Rows every set's capacity keeps beyond its count at least: the coarse sets of a network (hundreds of rows)
vary between clouds by more than a margin's share of them."""


def capacity_of(rows: int, margin: float) -> int:
    """The capacity bucket of a set of ``rows`` rows: ``rows * margin`` (at least ``rows`` + :data:`SLACK`)
    rounded up to a multiple of its largest power of two over 8 (6-12% steps): clouds whose sets grow by less
    than the margin fit the bucket of the first, and the 1x1 products' row buckets divide it (one cuBLAS shape)."""
    target = max(int(rows * margin), rows + SLACK) + 1
    step = 1 << max(0, target.bit_length() - 4)
    return -(-target // step) * step


class CapacityMaps:
    """One capture's kernel maps as fixed-size neighbour tables.

    ``requests``: the maps a recorded pass asked for, in order, as (key, id of its output set) with set ids
    of the recorded batch; ``capacities``: rows per set id of the recorded batch. Each request gets a
    (capacity of its output set, K) int32 table filled with -1
    (:attr:`tables`) and a :class:`KernelMap` over it whose input count is its source set's capacity.
    """

    def __init__(self, requests: Sequence[tuple[KernelMapKey, int]], capacities: Mapping[int, int],
                 device: torch.device, strides: Mapping[int, Triple] | None = None, input_id: int = 0) -> None:
        self.capacities = dict(capacities)
        self.out_ids = {key: out_id for key, out_id in requests}
        bases, size = {}, 0
        for key, out_id in requests:  # (each table aligned as the map plan aligns its own)
            bases[key] = size
            size += -(-capacities[out_id] * math.prod(key.kernel_size) // ALIGN) * ALIGN
        self.flat = torch.full((size,), -1, dtype=torch.int32, device=device)
        """Every table, one after the other (one fill empties them all)."""
        self.tables: dict[KernelMapKey, torch.Tensor] = {}
        self.maps: dict[KernelMapKey, KernelMap] = {}
        for key, out_id in requests:
            volume = math.prod(key.kernel_size)
            table = self.flat[bases[key]: bases[key] + capacities[out_id] * volume].view(capacities[out_id], volume)
            self.tables[key] = table
            self.maps[key] = KernelMap(table, capacities[key.source], key.kernel_size)
        self.fixed = None if strides is None else FixedMaps.plan(requests, strides, input_id, capacities, bases, device)
        """What builds a batch's maps straight into the tables (:meth:`build`), None where it cannot (the
        network's maps are not all the input's floors' and their transposes: :meth:`FixedMaps.plan`)."""
        self.products: dict[tuple, Product] = {}
        self.params: dict[tuple, Mapping | None] = {}
        """Per (key, layer): the parameters its product runs (None: torch's ops), chosen in the warm-up pass."""
        self.real: Mapping[KernelMapKey, KernelMap] | None = None
        """The batch's own maps while the warm-up pass chooses the parameters (:meth:`choose_on`)."""

    def choose_on(self, maps: Mapping[KernelMapKey, KernelMap] | None) -> None:
        """Choose each layer's parameters in the next pass on the batch's own ``maps`` (by the recorded keys),
        through the tuner (None: stop choosing)."""
        self.real = maps

    def renew(self) -> None:
        """Forget the products and the views built on the tables (keeping the chosen parameters): the pass that
        runs next builds them again, so that a capture holds their building, redone on each replay from the
        tables' new contents (a view cached from the warm-up would be the warm-up batch's)."""
        self.maps = {key: KernelMap(table, self.maps[key].num_in, key.kernel_size) for key, table in self.tables.items()}
        self.products.clear()

    def fits(self, rows: Mapping[int, int]) -> bool:
        """Whether every set of a batch (``rows``: count per set id of the recorded batch) fits its capacity."""
        return all(rows[set_id] <= capacity for set_id, capacity in self.capacities.items())

    def build(self, cache: CoordinateCache, input_set: int) -> HostCopy | None:
        """Build a batch's maps (``cache``'s input set ``input_set``, at most its capacity's rows) into the tables
        (:attr:`fixed`), launches alone: returns the coarse sets' counts on their way to the host
        (:meth:`FixedMaps.counts` reads them; a set past its capacity leaves the tables unusable)."""
        return self.fixed.build(cache, input_set, self.flat)

    def load(self, maps: Mapping[KernelMapKey, KernelMap]) -> None:
        """Copy a batch's maps (by the recorded keys) into the tables, -1 past each map's output count: the
        launches of a replay read them. One fill of every table, then a copy a map; no host synchronisation."""
        self.flat.fill_(-1)
        for key, table in self.tables.items():
            neighbors = maps[key].neighbors
            table[: neighbors.shape[0]].copy_(neighbors)

    def conv(self, cache, feats: torch.Tensor, weight: torch.Tensor, key: KernelMapKey, layer: tuple
             ) -> tuple[torch.Tensor, int]:
        """feats (capacity of the source set, C_in), weight (K, C_in, C_out) -> (capacity of the output set,
        C_out) over ``key``'s table, and the output set's id; ``layer``: the conv's problem description
        (:func:`~sparseconv.backends.problem.layer_problem`); ``cache``: the input's (a :class:`CapacityCache`)."""
        kernel_map = self.maps.get(key)
        if kernel_map is None:
            raise ValueError(f"sparseconv.graphed: a layer asked for the kernel map {key}, which the recorded pass "
                             f"did not: a graphed network must ask the same maps of every batch (known: "
                             f"{list(self.maps)})")
        if feats.shape[0] != kernel_map.num_in:
            raise ValueError(f"sparseconv.graphed: a conv's input has {feats.shape[0]} rows where its set's "
                             f"capacity is {kernel_map.num_in}: every tensor of a graphed pass must come from "
                             "its input through the network's layers")
        product = self.products.get((key, layer))
        if product is None:
            product = self.products[(key, layer)] = self._product(key, layer, feats, weight)
        return product(feats.contiguous(), weight.contiguous()), self.out_ids[key]

    def _product(self, key: KernelMapKey, layer: tuple, feats: torch.Tensor, weight: torch.Tensor) -> Product:
        """The layer's product over its table: mask_implicit_gemm's where Triton runs, with the parameters chosen
        for the layer (:meth:`_choose`), else torch's ops."""
        kernel_map = self.maps[key]
        problem = layer_problem(kernel_map, layer)
        if (key, layer) not in self.params:
            supported = mask_triton.MASK_IMPLICIT_GEMM.supports(problem) is None
            self.params[(key, layer)] = self._choose(key, problem, layer, feats, weight) if supported else None
        params = self.params[(key, layer)]
        if params is None:
            return gathered_product(kernel_map.neighbors)
        return mask_triton.MASK_IMPLICIT_GEMM.prepare(PRODUCT, problem, params, kernel_map)

    def _choose(self, key: KernelMapKey, problem, layer: tuple, feats: torch.Tensor, weight: torch.Tensor) -> Mapping:
        """The layer's parameters: on CUDA, what the tuner picks among :data:`PIN`'s for the layer on the batch's
        own map (its pool, timings, cache and guard, as an eager call's, outside the timing budget; the valid rows
        of the capacity buffer are the batch's features), else the first table tile (the CPU's interpreter)."""
        real = None if self.real is None else self.real[key]
        if feats.is_cuda and real is not None:
            a, problem_of_batch = feats[: real.num_in], layer_problem(real, layer)
            tuner = tune.get_tuner()
            for _ in range(2):
                with tuner.budget.waived():  # timed now: a provisional pick would run at every replay
                    candidate, _ = tuner.choose(PRODUCT, problem_of_batch, PIN, a, weight, real)
                if candidate.backend == PIN[0]:
                    return candidate.params_dict
                tune.wait_for_compiles()  # the reference stood in while the pick compiled
        tiles = mask_triton.table_tiles(problem)
        if feats.is_cuda and len(tiles) > 1:
            timer = Timer(feats.device, TIMING)
            a, w = feats.contiguous(), weight.contiguous()
            timed = []
            for params in tiles:
                product = mask_triton.MASK_IMPLICIT_GEMM.prepare(PRODUCT, problem, params, self.maps[key])
                timed.append((timer.median(lambda p=product: p(a, w))[0], len(timed), params))
            return min(timed)[2]
        return tiles[0]


class MapRecorder:
    """The convs of a recording pass (a graphed module's first call, on a batch's real cache): each asks for its
    kernel map as an eager call would (built as a graphed batch builds them: :data:`~.batch.MAPS_ONLY`) and
    returns zeros of its output's shape, so that the pass learns the maps the network asks for, in order,
    without running or tuning a product."""

    def conv(self, cache, feats: torch.Tensor, weight: torch.Tensor, key: KernelMapKey, layer: tuple
             ) -> tuple[torch.Tensor, int]:
        kernel_map, _, out_id = batch.kernel_map(cache, key, batch.MAPS_ONLY)
        return feats.new_zeros((kernel_map.num_out, weight.shape[2])), out_id


def gathered_product(table: torch.Tensor) -> Product:
    """A table's product in torch's ops (where Triton does not run): sum over offsets k of the rows
    ``table[:, k]`` of a (-1: a zero row) times W_k (:func:`.table_gemm.table_product`); no host synchronisation."""
    return lambda a, w: table_gemm.table_product(a, table, w)


class CapacityCache:
    """What a capacity pass's tensors hold as their coordinate cache: the capture's :class:`CapacityMaps` (read by
    the convs through :attr:`Batch.capacity`). It builds no map and knows no coordinates:
    an operation that needs them (pooling, per-sample norms, ``coords``, ``batch_size``) raises, naming graph mode."""

    def __init__(self, maps: CapacityMaps, device: torch.device) -> None:
        self.device = device
        self.batch = Batch()
        self.batch.capacity = maps

    def __getattr__(self, name: str):
        raise AttributeError(
            f"sparseconv.graphed: a layer read the coordinate cache's {name!r}, which a graphed pass does not have "
            "(it runs on fixed-size buffers, without coordinates): only convolutions, 1x1 products, norms over "
            "channels (BatchNorm in eval mode), activations, concatenations and sums of tensors on one set run there")
