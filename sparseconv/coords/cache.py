"""The coordinate cache shared by every tensor derived from one input batch.

It holds coordinate sets (each with its stride), their hash tables and the kernel maps between
them. A set is *canonical* for its stride when it is the floor-to-multiple of the input
coordinates: the set that strided convs produce and that transposed convs go back onto, so an
encoder's maps are found again by its decoder. Generated sets (``generative=True``) are kept
beside the canonical ones and never replace them.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable

import torch

from . import plan
from .batch import Batch, Builders
from .floors import FloorSets, floor_sets
from .hashing import CoordHashTable, cell_neighbors, generate_set, tiles_its_cells
from .keys import COORD_MAX, COORD_MIN, floor_masks, floors_by_mask, pack_coords, range_violation, unpack_keys
from .kernel_map import KernelMap, KernelMapKey, Triple, center_offset, offset_deltas
from .sets import CoordSet


class CoordinateCache:
    """Coordinate sets, hash tables and kernel maps of one batch on one device, and the batch's shared state
    beside them (:attr:`batch`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._sets: list[CoordSet] = []
        self._canonical: dict[Triple, int] = {}
        self._tables: dict[int, CoordHashTable] = {}
        self._keys: dict[int, torch.Tensor] = {}
        self._maps: dict[KernelMapKey, tuple[KernelMap, int]] = {}
        self.batch = Batch()
        self._dropped: set[int] = set()  # sets whose hash tables went once the plan's maps were built
        self._moved: weakref.WeakValueDictionary[str, CoordinateCache] = weakref.WeakValueDictionary()
        self._checks: Callable[[], int] | None = None
        self._origins: dict[int, tuple] = {}  # generated sets: how the input's canonical sets generate them
        self._cells: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}

    def add(self, coords: torch.Tensor, stride: Triple, canonical: bool, keys: torch.Tensor | None = None,
            table: CoordHashTable | None = None, floor_of: tuple[int, FloorSets, int] | None = None) -> int:
        """Register a coordinate set (and its packed keys and hash table, if made already) and return
        its id (canonical only if the stride has none yet). ``floor_of``: (set id, :func:`floor_sets` of its keys,
        level) where the set is that level of those floors: on a CPU a map from that set onto this one whose window
        tiles its cells reads each row's cell from them (:meth:`query`)."""
        canonical = canonical and stride not in self._canonical
        self._sets.append(CoordSet(coords, stride, canonical))
        set_id = len(self._sets) - 1
        if canonical:
            self._canonical[stride] = set_id
        if keys is not None:
            self._keys[set_id] = keys
        if table is not None:
            self._tables[set_id] = table
        if floor_of is not None and self.device.type == "cpu":  # (cell_neighbors: a CPU's query alone)
            source, floors, level = floor_of
            self._cells[(source, set_id)] = functools.partial(floors.cells, level)
        return set_id

    def defer_checks(self, checks: Callable[[], int]) -> None:
        """The input set's checks, launched and not read yet: ``checks()`` reads them, raises if they
        failed and returns the batch size (:meth:`settle` calls it)."""
        self._checks = checks

    def settle(self) -> None:
        """Read the input set's deferred checks (once they pass; bad coordinates raise on every use):
        called where the coordinates are first used, after a new map's launches, so that the host
        waits for nothing the GPU has not done already."""
        checks = self._checks
        if checks is not None:
            batch_size = checks()
            self._checks = None
            self.set_batch_size(batch_size)

    @functools.cached_property
    def batch_size(self) -> int:
        """1 + the largest batch index (0 when empty); every set of a cache has the same batches."""
        self.settle()  # the checks read it
        if "batch_size" in self.__dict__:
            return self.__dict__["batch_size"]
        # Strided, transposed and generated sets all keep their source's batch indices, so one
        # host sync per batch serves every layer (per-sample norms and pooling need it).
        coords = self._sets[0].coords if self._sets else None
        return int(coords[:, 0].max().item()) + 1 if coords is not None and coords.shape[0] else 0

    def set_batch_size(self, batch_size: int) -> None:
        """The batch size, where the input's checks read it already (their one transfer holds it)."""
        self.__dict__["batch_size"] = batch_size

    def coord_set(self, set_id: int) -> CoordSet:
        return self._sets[set_id]

    def set_count(self) -> int:
        return len(self._sets)

    def origin(self, set_id: int) -> tuple | None:
        """How a generated set comes from the batch's canonical sets: ``(stride, *steps)``, the canonical set
        at ``stride`` through generative convs of ``(kernel_size, stride, dilation)`` each; None for
        other sets (canonical ones, those of a generative transposed conv or from a set without an origin)."""
        return self._origins.get(set_id)

    def canonical(self, stride: Triple) -> int | None:
        """Id of the canonical coordinate set at ``stride``, if any tensor of the batch has one."""
        return self._canonical.get(stride)

    def keys(self, set_id: int) -> torch.Tensor:
        """(N,) int64 packed keys of a coordinate set (:func:`pack_coords`), made once."""
        keys = self._keys.get(set_id)
        if keys is None:
            keys = self._keys[set_id] = pack_coords(self._sets[set_id].coords)
        return keys

    def table(self, set_id: int) -> CoordHashTable:
        table = self._tables.get(set_id)
        if table is None:
            table = self._tables[set_id] = CoordHashTable.build(self._sets[set_id].coords, self.keys(set_id))
            if set_id in self._dropped:  # a query the plan did not make: the next batches keep this one
                self.batch.record.keep_tables.add(self._sets[set_id].stride)
        return table

    def kernel_map(self, key: KernelMapKey, builders: Builders | None = None) -> tuple[KernelMap, int]:
        """The kernel map for ``key`` and the id of its output coordinate set (built once, then reused).
        ``builders``: what the batch's maps are built with beyond coords' own kernels (taken at the batch's
        first request: :data:`sparseconv.ops.batch.BUILDERS` is the library's); none, torch's ops alone."""
        hit = self._maps.get(key)
        if hit is None:
            hit = self._maps[key] = self._first_request(key, builders)
        return hit

    def _first_request(self, key: KernelMapKey, builders: Builders | None) -> tuple[KernelMap, int]:
        batch = self.batch
        if batch.record is None:  # the batch's first map: the maps earlier batches asked for are built now
            if builders is not None:
                batch.builders = builders
            batch.record, batch.planned = plan.begin(self)
            if batch.planned:
                self._drop_tables()
        hit = batch.planned.pop(key, None)
        if hit is None:
            hit = self.build(key)
        self.settle()  # a map of bad coordinates is never returned
        batch.record.note(self, key, hit[0], batch.use(hit[0]))
        return hit

    def _drop_tables(self) -> None:
        """Drop the hash tables once the plan has queried its maps (street4's input and coarse sets:
        ~26 MiB, held through the forward pass's memory peak otherwise), but those of strides whose
        tables the last batches queried again after their plan (a map the plan does not make: a
        generative conv's, a pool's of another size); :meth:`table` builds a dropped one again."""
        keep = self.batch.record.keep_tables
        self._cells.clear()  # (the floors' cells hold their tables too; a later map looks its cells up)
        for set_id in list(self._tables):
            if self._sets[set_id].stride not in keep:
                table = self._tables.pop(set_id)
                self._dropped.add(set_id)
                keys = self._keys.get(set_id)
                if keys is not None and keys.untyped_storage().data_ptr() == table.keys.untyped_storage().data_ptr():
                    # The input's keys share one allocation with its table (the checks' kernel,
                    # CoordHashTable.build_checked): they go with it (:meth:`keys` packs them again
                    # if a map the plan did not make asks; a copy cost every batch a launch).
                    del self._keys[set_id]

    def built_map(self, key: KernelMapKey) -> tuple[KernelMap, int] | None:
        """What :meth:`kernel_map` returns for ``key`` if that map is built already, else None
        (no build: torch.compile traces this lookup, which it cannot do for a build)."""
        return self._maps.get(key)

    def built_keys(self) -> list[KernelMapKey]:
        """The keys of the maps built so far, in the order they were built."""
        return list(self._maps)

    def kernel_maps(self) -> list[KernelMap]:
        """Every kernel map built so far (a map found under two keys, e.g. a conv and a pool, once)."""
        return list({id(m): m for m, _ in self._maps.values()}.values())

    def to(self, device: torch.device) -> CoordinateCache:
        """This cache's coordinate sets on ``device`` (same ids; maps are rebuilt there on demand)."""
        device = torch.device(device)
        if device == self.device:
            return self
        self.settle()
        moved = self._moved.get(str(device))
        if moved is None:
            moved = CoordinateCache(device)
            moved._sets = [CoordSet(s.coords.to(device), s.stride, s.canonical) for s in self._sets]
            moved._canonical = dict(self._canonical)
            self._moved[str(device)] = moved
        return moved

    def __repr__(self) -> str:
        sets = ", ".join(f"{i}: stride {s.stride} N={s.coords.shape[0]}" for i, s in enumerate(self._sets))
        return f"CoordinateCache({self.device}, sets {{{sets}}}, {len(self._maps)} kernel maps)"

    def build(self, key: KernelMapKey) -> tuple[KernelMap, int]:
        """The map of ``key`` and its output set id, built now (not kept: :meth:`kernel_map` keeps what
        it returns; the map plan builds its maps on generated sets ahead with this)."""
        source = self._sets[key.source]
        out_id = self._output_set(key, source)
        if key.transposed and not key.generative and self._canonical.get(source.stride) == key.source:
            # The transposed conv back onto the coordinates a strided conv came from: the adjoint
            # of that conv's map (built now if the encoder has not built it), not a new query.
            forward_key = KernelMapKey(out_id, key.kernel_size, key.stride, key.dilation, False, False)
            strided, coarse_id = self.kernel_map(forward_key)
            if coarse_id == key.source:
                return strided.transposed(), out_id
        out = self._sets[out_id]
        # A transposed conv reads in[p - delta * dilation * s_out]: the adjoint of the regular
        # conv that maps its output coordinates onto its input coordinates.
        step = tuple(d * s for d, s in zip(key.dilation, out.stride if key.transposed else source.stride))
        offsets = _offsets(key.kernel_size, step, -1 if key.transposed else 1, self.device)
        return self.new_map(key, self.query(key, out_id, offsets), out_id), out_id

    def query(self, key: KernelMapKey, out_id: int, offsets: torch.Tensor) -> torch.Tensor:
        """The (N_out, K) int32 neighbour table of a regular or transposed ``key`` onto the set ``out_id`` by a query
        of its own, ``offsets`` (K, 3) int32 its kernel's in voxels: a submanifold map's by half its lookups, on a
        CPU a map whose window tiles its cells by one lookup a source row (a GPU's: one query launch, fewer host
        ops), else one lookup a (row, offset)."""
        out = self._sets[out_id]
        if out_id == key.source and center_offset(key.kernel_size) is not None:  # offsets symmetric about 0
            return self.table(key.source).self_neighbors(out.coords, offsets)
        if self.device.type == "cpu" and self._tiles(key):
            source = self._sets[key.source]
            cells = self._cells.get((key.source, out_id))
            return cell_neighbors(self.table(out_id), out.coords.shape[0], source.coords, source.stride,
                                  key.kernel_size, None if cells is None else cells())
        return self.table(key.source).neighbors(out.coords, offsets)

    @staticmethod
    def _tiles(key: KernelMapKey) -> bool:
        """Whether ``key``'s map puts each input row in exactly one pair (:func:`tiles_its_cells`)."""
        return not key.transposed and not key.generative and tiles_its_cells(key.kernel_size, key.stride, key.dilation)

    def new_map(self, key: KernelMapKey, neighbors: torch.Tensor, out_id: int) -> KernelMap:
        """The map of a regular or transposed ``key`` whose neighbour table was queried (``neighbors``:
        (N_out, K) int32) onto the set ``out_id``, with what its geometry tells about it."""
        identity = center_offset(key.kernel_size) if out_id == key.source else None
        kernel_map = KernelMap(neighbors, self._sets[key.source].coords.shape[0], key.kernel_size, identity)
        kernel_map.kernels = self.batch.builders.kernels
        # A window that tiles the grid puts each input in the window of its own floored cell, which the output
        # set holds. Knowing it lets backends store instead of accumulating, and the tuner count pairs, with no
        # scan of the map.
        kernel_map.each_input_once = self._tiles(key)
        return kernel_map

    def _output_set(self, key: KernelMapKey, source: CoordSet) -> int:
        if key.transposed:
            if any(s % k for s, k in zip(source.stride, key.stride)):
                raise ValueError(
                    f"stride: a transposed conv with stride {key.stride} cannot go below stride 1 "
                    f"from an input at stride {source.stride}"
                )
            out_stride = tuple(s // k for s, k in zip(source.stride, key.stride))
        else:
            out_stride = tuple(s * k for s, k in zip(source.stride, key.stride))

        if key.generative:
            return self._generate(key, source, out_stride)
        if key.transposed:
            out_id = self.canonical(out_stride)
            if out_id is None:
                raise ValueError(
                    f"transposed conv from stride {source.stride} to {out_stride}: no tensor of this "
                    f"batch has coordinates at stride {out_stride} (known strides: "
                    f"{sorted(self._canonical)}). A transposed conv goes back onto the coordinates of an "
                    "earlier strided conv; use generative=True to create new coordinates instead."
                )
            return out_id
        if key.stride == (1, 1, 1):
            return key.source
        if source.canonical and out_stride in self._canonical:
            return self._canonical[out_stride]
        if floors_by_mask(out_stride):
            # Floor-to-multiple of a power of two that divides the key's coordinate bias clears the
            # low bits of each packed field: one AND, and the result stays in range (the set and its
            # table as the map plan makes them, :func:`floor_sets`).
            coarse = floor_sets(self.keys(key.source), floor_masks((out_stride,), self.device))
            return self.add(coarse.coords, out_stride, canonical=source.canonical, keys=coarse.keys, table=coarse.table,
                            floor_of=(key.source, coarse, 0))
        self.settle()  # the host reads the coordinates here: the input's own checks first
        step = on_device((1, *out_stride), self.device)
        coarse = torch.div(source.coords, step, rounding_mode="floor") * step
        problem = range_violation(coarse)
        if problem is not None:
            raise ValueError(f"stride: the downsampled coordinates leave the supported range: {problem}")
        return self.add(_unique_rows(coarse), out_stride, canonical=source.canonical)

    def _generate(self, key: KernelMapKey, source: CoordSet, out_stride: Triple) -> int:
        """Every output-grid position with at least one input in its receptive field."""
        self.settle()  # the host reads the coordinates here: the input's own checks first
        unit = out_stride if key.transposed else source.stride
        step = tuple(d * u for d, u in zip(key.dilation, unit))
        shift = _offsets(key.kernel_size, step, 1 if key.transposed else -1, self.device)
        # Hash inserts of the candidates on the grid (one host read), where torch's candidates, filter, range
        # check and unique took 3-4 host syncs a conv. Not its table: sized for every candidate (8 a row for
        # k3 s2), it would hold ~8x the memory of the one a map on the set builds.
        on_grid = math.prod((k - 1) * s // o + 1 for k, s, o in zip(key.kernel_size, step, out_stride))
        made = generate_set(self.keys(key.source), shift, out_stride, min(on_grid, shift.shape[0]))
        if made.out_of_range:
            raise ValueError("generative conv: the generated output coordinates leave the supported range: "
                             f"x, y, z in [{COORD_MIN}, {COORD_MAX}] (in voxel units of stride 1)")
        out_id = self.add(made.coords, out_stride, canonical=False, keys=made.keys)
        origin = (source.stride,) if source.canonical else self._origins.get(key.source)
        if origin is not None and not key.transposed:
            self._origins[out_id] = (*origin, (key.kernel_size, key.stride, key.dilation))
        return out_id


def _unique_rows(coords: torch.Tensor) -> torch.Tensor:
    """coords: (N, 4) int32 -> unique rows sorted by (batch, x, y, z), via packed int64 keys."""
    return unpack_keys(torch.unique(pack_coords(coords)))


@functools.lru_cache(maxsize=512)
def on_device(values: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A small integer constant on ``device``, made once: each host-to-device copy of a fresh tensor
    waits for the stream, which on a busy GPU stalls the host for the work queued before it."""
    return torch.tensor(values, dtype=dtype).to(device)


@functools.lru_cache(maxsize=512)
def _offsets(kernel_size: Triple, step: Triple, sign: int, device: torch.device) -> torch.Tensor:
    """(K, 3) int32 ``sign * delta * step`` on ``device`` (made once, see :func:`on_device`)."""
    return (offset_deltas(kernel_size) * torch.tensor(step, dtype=torch.int32) * sign).to(device)


