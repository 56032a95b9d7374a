"""torch.compile support: the conv's three products as ``torch.library`` custom ops.

:func:`.conv.sparse_conv3d` routes here only while Dynamo traces
(``torch.compiler.is_compiling()``); eager calls never import this module (it loads Dynamo) and
keep the autograd.Function of :mod:`.conv`, whose host cost per call is what small layers pay.

Design. A custom op takes tensors and scalars only, but the backends want a :class:`KernelMap`:
a Python object whose derived views (pairs, transposed table, padded groups, the tuner's key)
are built once and reused by every layer and by backward. The ops take the map's ``neighbors``
table instead and find the live map that owns it (:func:`sparseconv.coords.kernel_map.owner_of`,
a registry of weak references keyed by the table's address, checked against its device, shape
and strides), so a compiled call uses the very object the eager path would, caches included.
No integer handle crosses the graph: Dynamo specialises on an int it reads from a Python
object, which would recompile the graph for every batch. A table that no live map owns (a
compiler copied the input) gets a map rebuilt from it: same results, its views built again.

Where the graph breaks. Finding a layer's map is a lookup in the batch's
:class:`CoordinateCache`, traced when the map exists; building a map (hash table, ``unique``,
sizes that depend on the data) cannot be traced and runs eagerly (``torch.compiler.disable``).
At a new batch's first missing map, :class:`_Plan` builds every map the previous batch (or
:func:`sparseconv.warmup`) built, in order, so a model breaks once per batch, at its first
conv with a kernel map (Dynamo splits each frame on that call stack, so a MinkUNet runs ~4
graphs); everything after it (every other conv, norm, activation, concatenation and the whole
backward) is traced. ``fullgraph=True`` therefore holds only when the input's maps are built
before the call. A 1x1x1 conv is a ``torch.mm`` in the graph.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from ..coords.cache import CoordinateCache
from ..coords.kernel_map import KernelMap, KernelMapKey, Triple, owner_of
from ..tensor import SparseTensor
from ..backends.problem import ConvProblem, layer_problem
from .batch import BUILDERS
from .dispatch import AlgoPins, dispatch

NAMESPACE = "sparseconv"


def lookup(neighbors: torch.Tensor, num_in: int, kernel_size: Triple) -> KernelMap:
    """The live map whose table is ``neighbors`` (N_out, K) int32, else one rebuilt from it."""
    found = owner_of(neighbors)
    if found is not None and found.num_in == num_in and found.kernel_size == kernel_size:
        return found
    # identity_offset stays unknown (None): it only lets a backend skip a gather, never changes results.
    return KernelMap(neighbors, num_in, kernel_size)


class _Plan:
    """The map keys of the last batch, in build order, to build a new batch's maps in one go.

    Each map build is a graph break, and the code after it, shared by every block of a network,
    would be traced again at every point of the network (Dynamo gives up after its recompile
    limit). Building the whole list at a new batch's first miss leaves one break per batch: a
    map key depends on the network alone (coordinate-set ids follow the build order), and a key
    this batch does not need only costs its build, as every map is correct for the set it names.
    """

    def __init__(self) -> None:
        self.keys: list[KernelMapKey] = []
        self.cache: weakref.ref[CoordinateCache] | None = None

    def learn(self, cache: CoordinateCache) -> None:
        """Take ``cache``'s built keys as the plan (:func:`sparseconv.warmup` does after its eager pass)."""
        self.keys, self.cache = cache.built_keys(), weakref.ref(cache)

    def build(self, cache: CoordinateCache, key: KernelMapKey) -> tuple[KernelMap, int]:
        if self.cache is None or self.cache() is not cache:  # a new batch
            self.cache = weakref.ref(cache)
            if self.keys and self.keys[0] == key:
                for planned in self.keys:
                    try:
                        # The table too: a transposed map makes it on first read, which inside the
                        # graph would be a break of its own.
                        cache.kernel_map(planned, BUILDERS)[0].neighbors  # noqa: B018
                    except (IndexError, ValueError):  # the plan of another network: build on demand
                        break
        hit = cache.kernel_map(key, BUILDERS)
        self.keys = cache.built_keys()
        return hit


_plan = _Plan()


def learn_maps(cache: CoordinateCache) -> None:
    """Build the next batch's maps as ``cache``'s were built (the keys, in order; see :class:`_Plan`)."""
    _plan.learn(cache)


@torch.compiler.disable
def _build_map(input: SparseTensor, key: KernelMapKey) -> tuple[torch.Tensor, int]:
    kernel_map, out_id = _plan.build(input.cache, key)
    return kernel_map.neighbors, out_id


@torch.compiler.disable
def pool_map(input: SparseTensor, key: KernelMapKey) -> tuple[KernelMap, int]:
    """For pooling, which reads the map's pairs inside the graph: the map (its pairs made here,
    as they need a host sync) and its output coordinates' id; eager, so a graph break per pool."""
    kernel_map, out_id = _plan.build(input.cache, key)
    kernel_map.pairs  # noqa: B018 - the cached view, made outside the graph
    return kernel_map, out_id


def find_map(input: SparseTensor, key: KernelMapKey) -> tuple[torch.Tensor, int]:
    """The neighbour table (N_out, K) int32 of ``key``'s map in ``input``'s cache and the id of its
    output coordinates. A map built already is looked up inside the graph; building one runs
    eagerly (a graph break, see the module docstring)."""
    built = input.cache.built_map(key)
    if built is None:
        return _build_map(input, key)
    return built[0].neighbors, built[1]


def _pin_text(pin: str | tuple[str, ...] | None) -> str | None:
    # A list of one name tunes that backend's parameters while the bare name runs it as is, so
    # a list keeps its brackets through the op's string argument ("[a,b]"; names never hold them).
    return pin if pin is None or isinstance(pin, str) else "[" + ",".join(pin) + "]"


def _pin(text: str | None) -> str | tuple[str, ...] | None:
    return tuple(text[1:-1].split(",")) if text is not None and text.startswith("[") else text


def _problem(
    kernel_map: KernelMap, in_channels: int, out_channels: int, kernel_size: Sequence[int], stride: Sequence[int],
    dilation: Sequence[int], transposed: bool, generative: bool, dtype: torch.dtype, device: torch.device,
) -> ConvProblem:
    """The layer's problem, kept with the map under the key :func:`.conv.sparse_conv3d` uses, so
    eager and compiled calls of one layer share it (and the tuner's memo keyed on it)."""
    layer = (in_channels, out_channels, tuple(kernel_size), tuple(stride), tuple(dilation), transposed, generative,
             dtype, device)
    return layer_problem(kernel_map, layer)


@torch.library.custom_op(f"{NAMESPACE}::conv_forward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def conv_forward(
    feats: torch.Tensor, weight: torch.Tensor, neighbors: torch.Tensor, kernel_size: Sequence[int],
    stride: Sequence[int], dilation: Sequence[int], transposed: bool, generative: bool, fwd_algo: str | None,
    dgrad_algo: str | None, wgrad_algo: str | None,
) -> torch.Tensor:
    """feats (N_in, C_in), weight (K, C_in, C_out), neighbors (N_out, K) int32 -> (N_out, C_out).

    Pins as :func:`_pin_text` writes them; backward's two are carried for :func:`_backward`.
    """
    kernel_map = lookup(neighbors, feats.shape[0], tuple(kernel_size))
    problem = _problem(kernel_map, weight.shape[1], weight.shape[2], kernel_size, stride, dilation, transposed,
                       generative, feats.dtype, feats.device)
    return dispatch("AB_gather_scatter", problem, _pin(fwd_algo), feats, weight, kernel_map)


@conv_forward.register_fake
def _(feats, weight, neighbors, kernel_size, stride, dilation, transposed, generative, *pins):
    return feats.new_empty((neighbors.shape[0], weight.shape[2]))


@torch.library.custom_op(f"{NAMESPACE}::conv_dgrad", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def conv_dgrad(
    grad_out: torch.Tensor, weight: torch.Tensor, neighbors: torch.Tensor, num_in: int, kernel_size: Sequence[int],
    stride: Sequence[int], dilation: Sequence[int], transposed: bool, generative: bool, dgrad_algo: str | None,
) -> torch.Tensor:
    """grad_out (N_out, C_out), weight (K, C_in, C_out), neighbors (N_out, K) int32 -> (num_in, C_in)."""
    kernel_map = lookup(neighbors, num_in, tuple(kernel_size))
    problem = _problem(kernel_map, weight.shape[1], weight.shape[2], kernel_size, stride, dilation, transposed,
                       generative, grad_out.dtype, grad_out.device)
    return dispatch("ABt_gather_scatter", problem, _pin(dgrad_algo), grad_out.contiguous(), weight, kernel_map)


@conv_dgrad.register_fake
def _(grad_out, weight, neighbors, num_in, kernel_size, stride, dilation, transposed, generative, dgrad_algo):
    return grad_out.new_empty((num_in, weight.shape[1]))


@torch.library.custom_op(f"{NAMESPACE}::conv_wgrad", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def conv_wgrad(
    feats: torch.Tensor, grad_out: torch.Tensor, neighbors: torch.Tensor, kernel_size: Sequence[int],
    stride: Sequence[int], dilation: Sequence[int], transposed: bool, generative: bool, wgrad_algo: str | None,
) -> torch.Tensor:
    """feats (N_in, C_in), grad_out (N_out, C_out), neighbors (N_out, K) int32 -> (K, C_in, C_out)."""
    kernel_map = lookup(neighbors, feats.shape[0], tuple(kernel_size))
    problem = _problem(kernel_map, feats.shape[1], grad_out.shape[1], kernel_size, stride, dilation, transposed,
                       generative, feats.dtype, feats.device)
    return dispatch("AtB_gather_gather", problem, _pin(wgrad_algo), feats, grad_out.contiguous(), kernel_map)


@conv_wgrad.register_fake
def _(feats, grad_out, neighbors, kernel_size, stride, dilation, transposed, generative, wgrad_algo):
    return feats.new_empty((neighbors.shape[1], feats.shape[1], grad_out.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    feats, weight, neighbors, *layer = inputs
    ctx.save_for_backward(feats, weight, neighbors)
    ctx.layer, ctx.pins = layer[:5], layer[6:]


def _backward(ctx, grad_out):
    feats, weight, neighbors = ctx.saved_tensors
    pins = ctx.pins
    grad_feats = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_feats = conv_dgrad(grad_out, weight, neighbors, feats.shape[0], *ctx.layer, pins[0])
    if ctx.needs_input_grad[1]:
        grad_weight = conv_wgrad(feats, grad_out, neighbors, *ctx.layer, pins[1])
    return grad_feats, grad_weight, *(None,) * 9


conv_forward.register_autograd(_backward, setup_context=_setup_context)


def sparse_conv3d(
    input: SparseTensor,
    feats: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel_size: Triple,
    stride: Triple,
    dilation: Triple,
    transposed: bool,
    generative: bool,
    pins: AlgoPins,
) -> SparseTensor:
    """The traced form of :func:`.conv.sparse_conv3d` after its checks: feats (N_in, C_in), weight
    (K, C_in, C_out) -> SparseTensor (N_out, C_out); the map found as :func:`find_map` says, the
    products as the custom ops.

    ``record`` is not filled: the products run inside a compiled graph, and a dict the trace
    writes to would be guarded on (a recompile whenever its contents change).
    """
    if math.prod(kernel_size) == 1 and stride == (1, 1, 1) and not generative:
        matrix = weight.squeeze(0)  # as conv.checked_conv3d: a view's backward, not select's zero fill
        out = torch.mm(feats, matrix) if bias is None else torch.addmm(bias, feats, matrix)
        return SparseTensor._derived(out, input.cache, input.coord_id)
    key = KernelMapKey(input.coord_id, kernel_size, stride, dilation, bool(transposed), bool(generative))
    neighbors, out_id = find_map(input, key)
    out = conv_forward(feats, weight, neighbors, kernel_size, stride, dilation, key.transposed, key.generative,
                       _pin_text(pins.fwd), _pin_text(pins.dgrad), _pin_text(pins.wgrad))
    if bias is not None:
        out = out + bias
    return SparseTensor._derived(out, input.cache, out_id)
