"""Problem -> cache key: what a tuning result depends on, bucketed so similar layers share it.

Bucketing, and why: the ranking of gather-GEMM-scatter algorithms moves smoothly with the row
counts, so N_in and N_out go into half-octave buckets (round(2·log2 N): sizes within a factor
of about 1.19 either side of a bucket centre share it, and a winner timed at one end stays
within a few percent of the best at the other). Pair density (pairs / (N_out·K): how full the
neighbour table is) decides how much a grouped or masked kernel wastes on absent neighbours; it
is bucketed the same way. Channels, kernel volume, geometry and dtype change the kernels that
run, so they are exact. The device identity keeps a cache file shared between machines honest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import platform
from dataclasses import dataclass

import torch

from ..coords.kernel_map import KernelMap
from ..backends.cuda_launch import index_of
from ..backends.problem import ConvProblem

TUNER_VERSION = 1
"""Bump when the key layout or the meaning of a stored timing changes; old entries then miss."""


def size_bucket(n: int) -> int:
    """Half-octave bucket of a row count: round(2·log2 n); -1 for 0."""
    return round(2 * math.log2(n)) if n > 0 else -1


def density_bucket(pairs: int, slots: int) -> int:
    """Half-octave bucket of how full the neighbour table is: round(-2·log2(pairs/slots)), capped at 20."""
    if pairs <= 0 or slots <= 0:
        return 20
    return min(20, round(-2 * math.log2(pairs / slots)))


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


@functools.cache
def _cuda_identity(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{props.name} sm{props.major}{props.minor} {props.multi_processor_count}SM"


def device_identity(device: torch.device) -> str:
    """GPU: name, compute capability, SM count; CPU: model and torch's thread count."""
    if device.type == "cuda":
        return _cuda_device_identity(index_of(device))
    return f"cpu {_cpu_model()} {torch.get_num_threads()}t"


@functools.cache
def _cuda_device_identity(index: int) -> str:
    return f"cuda {_cuda_identity(index)}"


@dataclass(frozen=True)
class TuneKey:
    """One entry of the cache: the product, its bucketed sizes and everything that changes kernels."""

    namespace: str
    num_in: int
    num_out: int
    density: int
    in_channels: int
    out_channels: int
    kernel_volume: int
    geometry: str
    dtype: str
    device: str
    version: int = TUNER_VERSION
    deterministic: bool = False  # deterministic mode's pool: its own timings, winner and agreement
    lone: bool = False  # a map serving one product (ConvProblem.lone): timed with the views each candidate builds

    @functools.cached_property
    def family(self) -> TuneKey:
        """This key but for its bucketed row counts and density: the one layer's keys on other batches' maps (kept
        with the key, which a map keeps: a new key's calls look its family up until it settles)."""
        return dataclasses.replace(self, num_in=0, num_out=0, density=0)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """What :attr:`family` leaves out: (num_in, num_out, density) buckets."""
        return self.num_in, self.num_out, self.density

    def encode(self) -> str:
        """Stable, human-readable string (the cache file's key)."""
        return (
            f"v{self.version}|n{self.num_in}>{self.num_out}|d{self.density}|c{self.in_channels}>{self.out_channels}"
            f"|k{self.kernel_volume}|{self.geometry}|{self.dtype}|{self.device}"
        ) + ("|det" if self.deterministic else "") + ("|lone" if self.lone else "")


def make_key(namespace: str, problem: ConvProblem, kernel_map: KernelMap, deterministic: bool = False) -> TuneKey:
    """The key of ``namespace`` for ``problem``; dgrad is keyed as the swapped problem (out -> in).
    Deterministic mode's keys are apart (its pool is smaller: a normal winner may not run there)."""
    num_in, num_out = problem.num_in, problem.num_out
    c_in, c_out = problem.in_channels, problem.out_channels
    if namespace == "ABt_gather_scatter":
        num_in, num_out, c_in, c_out = num_out, num_in, c_out, c_in
    return _key(namespace, size_bucket(num_in), size_bucket(num_out), _density(kernel_map), c_in, c_out,
                problem.kernel_volume, problem.stride, problem.transposed, problem.generative, problem.dtype,
                device_identity(problem.device), deterministic, problem.lone)


DENSITY_VIEW = ("tune_density",)
"""The map's view key of :func:`_density`."""


def _density(kernel_map: KernelMap) -> int:
    """The map's :func:`density_bucket`, kept with the map: a new batch's map makes ~8 keys (its layers'
    products), and reading its pair count and bucketing it took ~5 µs of host time each (H200 host). A map
    built when a layer asked for it takes its fill from the last batch's map under its key (:meth:`KernelMap.fill`):
    its counts are not waited for (a host sync: 30-90 µs of a lone submanifold conv's 400-800, H200)."""
    return kernel_map.derived(DENSITY_VIEW, lambda m: density_bucket(*m.fill()))


@functools.lru_cache(maxsize=4096)
def _key(namespace: str, num_in: int, num_out: int, density: int, c_in: int, c_out: int, kernel_volume: int,
         stride: tuple[int, int, int], transposed: bool, generative: bool, dtype: torch.dtype, device: str,
         deterministic: bool, lone: bool) -> TuneKey:
    """One TuneKey object per distinct key: every batch's new maps (a key each per layer and
    product) share it instead of building and hashing a new one (~14 µs a key on an H100 host)."""
    geometry = ("t" if transposed else "s") + "x".join(map(str, stride)) + ("g" if generative else "")
    return TuneKey(
        namespace=namespace,
        num_in=num_in,
        num_out=num_out,
        density=density,
        in_channels=c_in,
        out_channels=c_out,
        kernel_volume=kernel_volume,
        geometry=geometry,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        deterministic=deterministic,
        lone=lone,
    )
