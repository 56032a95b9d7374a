"""graphed: a network's inference replayed from a CUDA graph on new point clouds, one graph per capacity bucket.

An eager pass spends most of its time on the host (Python per layer, the tuner's dispatch, small launches); a
replayed CUDA graph issues the whole pass in one call. A graph replays fixed sizes, so the pass it captures runs
on fixed-size buffers (:mod:`sparseconv.ops.capacity`): each coordinate set of the batch has a capacity (its
count times ``margin``, rounded up to a bucket) and each kernel map a neighbour table of its output set's capacity.
Per call the batch's maps are built into the tables of the smallest captured graph whose input capacity the
batch fits, with no host synchronisation (:meth:`~sparseconv.ops.capacity.CapacityMaps.build`), the features
copied in, the graph replayed and the output's valid rows copied out once the sets' counts arrive; a batch
whose coarse sets outgrew that graph's capacities, or a network whose maps that build does not make, has its
maps built eagerly (the map plan, with its host syncs) and copied into the tables of a graph it fits; a batch
that fits no graph is captured into a new one.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn

from .. import tune
from ..coords.kernel_map import KernelMap, KernelMapKey, Triple
from ..ops import batch
from ..ops.capacity import CapacityCache, CapacityMaps, MapRecorder, capacity_of
from ..tensor import SparseTensor


def graphed(module: nn.Module, margin: float = 1.1, capture: bool | None = None, max_buckets: int = 4
            ) -> GraphedModule:
    """``module``'s inference on new point clouds, replayed from CUDA graphs: a callable taking the
    SparseTensor ``module`` takes and returning what it returns, a SparseTensor or tuples, lists, named tuples or
    dicts of them (equal to the eager pass's, but for the rounding of differently ordered sums: its convs run
    mask_implicit_gemm alone, with the parameters the tuner picks for that backend).

    The module must be in eval mode; its pass may use convolutions (any kind: submanifold, strided, transposed,
    generative), 1x1 convs, BatchNorm, activations, concatenations and residual sums, but not pooling or
    per-sample norms, and must ask the same kernel maps of every batch. Parameters and buffers are read where they
    live at each replay: update them in place (``load_state_dict``, an optimiser), never by assigning new tensors.

    ``margin``: each coordinate set's capacity is its count on the captured batch times ``margin``, rounded up
    (:func:`~sparseconv.ops.capacity.capacity_of`): clouds whose sets are at most that much larger replay the
    same graph. Each captured graph holds its own memory (the pass's activations at capacity, the tables).
    ``max_buckets``: the graphs kept at most; a new one past it replaces the one used least recently (a data set
    of widely varying cloud sizes would otherwise keep a graph, and its memory, per size met). A cloud runs on
    the smallest graph it fits. ``capture``: capture CUDA graphs (default: on CUDA; on the CPU, where a replay saves nothing, the default
    runs the module itself); ``capture=False``: the same fixed-size pass runs eagerly, uncaptured (what CI
    checks on the CPU).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not margin >= 1.0:
        raise ValueError(f"margin must be a number >= 1.0, got {margin!r}")
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise ValueError(f"max_buckets must be an int >= 1, got {max_buckets!r}")
    return GraphedModule(module, float(margin), capture, max_buckets)


class Bucket(NamedTuple):
    """One captured graph: ``capacities``, rows per coordinate set (in the recorded order); ``seconds``, what its
    capture took (the tuner's picks on the batch's maps, a warm-up pass, the capture); ``memory_bytes``, the CUDA
    memory torch reserved for it (its buffers, tables and the graph's pool of activations; 0 off CUDA)."""

    capacities: list[int]
    seconds: float
    memory_bytes: int


class GraphedModule:
    """What :func:`graphed` returns: call it like the module. ``captures``: the graphs captured so far;
    ``buckets``: the :class:`Bucket` of each graph held now (a bucket that grew replaced the one it grew from)."""

    def __init__(self, module: nn.Module, margin: float, capture: bool | None, max_buckets: int = 4) -> None:
        self.module, self.margin, self._capture, self.max_buckets = module, margin, capture, max_buckets
        self._requests: list[tuple[KernelMapKey, int]] | None = None
        self._input_id = 0
        self._strides: dict[int, Triple] = {}
        """The stride of each canonical set of the recorded batch, by id."""
        self._graphs: list[_Graph] = []
        self.captures = 0

    @property
    def buckets(self) -> list[Bucket]:
        return [graph.bucket for graph in self._graphs]

    def __call__(self, input: SparseTensor) -> object:
        if not isinstance(input, SparseTensor):
            raise TypeError(f"input must be a SparseTensor, got {type(input).__name__}")
        if self.module.training:
            raise ValueError("sparseconv.graphed runs inference: call module.eval() first (a training pass's "
                             "BatchNorm reads statistics of the batch, which a graph over padded rows cannot)")
        with torch.no_grad():
            if self._capture is None and not input.feats.is_cuda:
                return self.module(input)
            if self._requests is None:
                self._record(input)
            graph = min((g for g in self._graphs if g.maps.fixed is not None and g.takes_features(input)
                         and len(input) <= g.maps.capacities[self._input_id]), key=_Graph.size, default=None)
            if graph is not None:
                out = graph.run_fixed(input)
                if out is not None:
                    self._graphs.remove(graph)
                    self._graphs.append(graph)
                    return out
            maps, rows, sets = self._build_maps(input)
            graph = min((g for g in self._graphs if g.takes(input, rows)), key=_Graph.size, default=None)
            if graph is None:
                graph = self._new_graph(input, maps, rows)
            else:  # the most recently used last: the first is what a new graph past max_buckets replaces
                self._graphs.remove(graph)
                self._graphs.append(graph)
            return graph.run(input, maps, rows, sets)

    def _record(self, input: SparseTensor) -> None:
        """Run the module once with convs that only ask for their maps (:class:`~sparseconv.ops.capacity.MapRecorder`)
        and keep the kernel maps it asked for, in order (the next batches' maps are requested in that order, so
        that each set gets the same place)."""
        input.cache.batch.capacity = MapRecorder()
        try:
            _check_output(self.module(input), input.cache)
        finally:
            input.cache.batch.capacity = None
        cache = input.cache
        self._requests = [(key, cache.built_map(key)[1]) for key in cache.built_keys()]
        self._input_id = input.coord_id
        self._strides = {set_id: cache.coord_set(set_id).stride for set_id in range(cache.set_count())
                         if cache.coord_set(set_id).canonical}

    def _build_maps(self, input: SparseTensor) -> tuple[dict[KernelMapKey, KernelMap], dict[int, int], dict[int, int]]:
        """This batch's maps by the recorded keys, the rows of its sets and their ids, by recorded set id."""
        sets = {self._input_id: input.coord_id}
        rows = {self._input_id: len(input)}
        maps = {}
        for key, out_id in self._requests:
            kernel_map, _, sets[out_id] = batch.kernel_map(input.cache, key._replace(source=sets[key.source]),
                                                           batch.MAPS_ONLY)
            maps[key] = kernel_map
            rows[out_id] = kernel_map.num_out
        return maps, rows, sets

    def _new_graph(self, input: SparseTensor, maps: dict[KernelMapKey, KernelMap], rows: dict[int, int]) -> _Graph:
        """A graph for a batch that fits none. Where a graph's input capacity takes the batch's but another of
        its sets' does not (clouds of one size whose coarse sets vary more than the margin: a street's
        stride-2 set by 20% between scenes of equal size), the new graph's capacities are the larger of both
        and it replaces that graph: one graph per input size that grows, not one per cloud that overflowed."""
        capacities = {set_id: capacity_of(count, self.margin) for set_id, count in rows.items()}
        grown = next((g for g in self._graphs if g.takes_features(input)
                      and g.maps.capacities[self._input_id] >= capacities[self._input_id]), None)
        if grown is not None:
            capacities = {set_id: max(rows_, grown.maps.capacities[set_id]) for set_id, rows_ in capacities.items()}
            self._graphs.remove(grown)  # its buffers and the graph's memory go with it
        capture = self._capture is not False
        if capture and not input.feats.is_cuda:
            raise ValueError(f"capture=True needs a CUDA input, got features on {input.feats.device}")
        del self._graphs[: max(0, len(self._graphs) - self.max_buckets + 1)]  # the least recently used go first
        cuda = input.feats.is_cuda
        if cuda:  # (the capture empties torch's cache: emptied first too, the difference is the bucket's own)
            torch.cuda.synchronize(input.device)
            torch.cuda.empty_cache()
        begin, reserved = time.perf_counter(), torch.cuda.memory_reserved(input.device) if cuda else 0
        maps_of_graph = CapacityMaps(self._requests, capacities, input.device, self._strides, self._input_id)
        graph = _Graph(self.module, maps_of_graph, input, self._input_id)
        graph.prepare(maps, capture)
        if cuda:
            torch.cuda.synchronize(input.device)
        memory = torch.cuda.memory_reserved(input.device) - reserved if cuda else 0
        graph.bucket = Bucket(list(capacities.values()), time.perf_counter() - begin, memory)
        self._graphs.append(graph)
        self.captures += 1
        return graph


class _Graph:
    """One capacity bucket: its tables, the input buffer, and the captured graph (or, without capture, the
    module to run over them)."""

    def __init__(self, module: nn.Module, maps: CapacityMaps, input: SparseTensor, input_id: int) -> None:
        self.module, self.maps = module, maps
        self.feats = input.feats.new_zeros((maps.capacities[input_id], input.feats.shape[1]))
        self.input = SparseTensor._derived(self.feats, CapacityCache(maps, input.device), input_id)
        self.input_id = input_id
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: object = None
        """The captured pass's output (SparseTensors on the bucket's buffers, in the module's structure)."""

    def size(self) -> int:
        """Rows of every set's capacity together (what a pass over this graph's buffers costs, roughly)."""
        return sum(self.maps.capacities.values())

    def takes(self, input: SparseTensor, rows: dict[int, int]) -> bool:
        """Whether a batch (its ``rows`` per recorded set id) runs on this graph."""
        return self.takes_features(input) and self.maps.fits(rows)

    def takes_features(self, input: SparseTensor) -> bool:
        feats = input.feats
        return (feats.dtype == self.feats.dtype and feats.shape[1] == self.feats.shape[1]
                and feats.device == self.feats.device)

    def prepare(self, maps: dict[KernelMapKey, KernelMap], capture: bool) -> None:
        """A warm-up pass over the tables loaded with ``maps`` (each conv's parameters chosen by the tuner on the
        batch's own map, its kernels compiled); then, with ``capture``, the pass captured once the kernels
        compiling in the background are in, its convs' views built inside the graph (:meth:`CapacityMaps.renew`)."""
        self.maps.load(maps)
        self.maps.choose_on(maps)
        try:
            self.out = self._pass()
        finally:
            self.maps.choose_on(None)
        if not capture:
            return
        tune.wait_for_compiles()
        self.maps.renew()
        self._pass()  # the views' kernels and what compiled in the background run once before the capture
        torch.cuda.synchronize(self.feats.device)
        self.maps.renew()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.feats.device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out = self._pass()  # (on the input's GPU, whichever is current)
        self.graph = graph

    def _pass(self) -> object:
        return _check_output(self.module(self.input), self.input.cache)

    def run(self, input: SparseTensor, maps: dict[KernelMapKey, KernelMap], rows: dict[int, int],
            sets: dict[int, int]) -> object:
        """The pass on ``input`` (its ``maps``, the ``rows`` of its sets, its set ids: by recorded set id): the
        module's output structure, each SparseTensor's valid rows on the batch's own set."""
        self.feats[: len(input)].copy_(input.feats)
        self.maps.load(maps)
        return self._outputs(self._replay(), input, rows, sets.__getitem__)

    def run_fixed(self, input: SparseTensor) -> object | None:
        """The pass on ``input`` (at most the input capacity's rows) with its maps built into the tables without a
        host synchronisation (:meth:`CapacityMaps.build`): the host waits only for the sets' counts, after the
        replay is queued. None where a coarse set outgrew its capacity (the replay's result is then void)."""
        fixed = self.maps.fixed
        ends = self.maps.build(input.cache, input.coord_id)
        self.feats[: len(input)].copy_(input.feats)
        out = self._replay()
        rows = fixed.counts(ends, len(input))
        input.cache.settle()  # bad coordinates raise here, as at an eager batch's first map
        if not self.maps.fits(rows):
            return None
        sets = {self.input_id: input.coord_id}

        def set_of(set_id: int) -> int:  # a coarse output's set, registered on the batch from the build's rows
            if set_id not in sets:
                sets[set_id] = input.cache.add(fixed.coords(set_id, rows[set_id]), fixed.strides[set_id], canonical=True)
            return sets[set_id]

        return self._outputs(out, input, rows, set_of)

    def _replay(self) -> object:
        if self.graph is not None:
            with torch.cuda.device(self.feats.device):
                self.graph.replay()
            return self.out
        self.maps.renew()  # the views on the tables built again, as a replay builds them
        return self._pass()

    @staticmethod
    def _outputs(out: object, input: SparseTensor, rows: dict[int, int], set_of) -> object:
        """The pass's output structure, each SparseTensor's valid rows (a copy) on the batch's own set."""
        return _mapped(out, lambda t: SparseTensor._derived(t.feats[: rows[t.coord_id]].clone(), input.cache,
                                                            set_of(t.coord_id)))


def _mapped(value: object, fn) -> object:
    """``value`` (a SparseTensor, or tuples, lists, named tuples and dicts of them) with ``fn`` applied to each
    SparseTensor; TypeError for anything else."""
    if isinstance(value, SparseTensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [_mapped(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_mapped(item, fn) for item in value]
    if isinstance(value, dict):
        return {key: _mapped(item, fn) for key, item in value.items()}
    raise TypeError(f"sparseconv.graphed: the module's output must be SparseTensors (alone or in tuples, lists or "
                    f"dicts), got a {type(value).__name__}: a dense result (a BEV map, global pooling) needs the "
                    "coordinates, which a graphed pass does not have; make it from the returned tensors")


def _check_output(out: object, cache) -> object:
    """The module's output, once every SparseTensor in it is on ``cache`` (derived from the pass's input)."""
    def check(tensor: SparseTensor) -> SparseTensor:
        if tensor.cache is not cache:
            raise TypeError("sparseconv.graphed: the module must return SparseTensors derived from its input")
        return tensor

    _mapped(out, check)
    return out
