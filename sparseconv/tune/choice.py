"""What a tuner's choice is once made, and how it runs: a provisional pick (run for now, not remembered), the
progress a process reports, another rank's choice adopted, and a choice run with the reference as its fallback."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..backends import registry
from ..backends.problem import ConvProblem
from ..coords.kernel_map import KernelMap
from . import faults
from .configs import Candidate
from .pools import FALLBACK

logger = logging.getLogger("sparseconv.tune")


class Progress(NamedTuple):
    """Where a process's tuning stands (:meth:`.tuner.Tuner.progress`)."""

    settled: int
    """Tuned products (key, mode, effort) whose choice is made for the process."""
    untimed: int
    """Products running a pick untimed (the best their records passed, or the cost model's), to be timed by a
    later call: keys whose records lack candidates, or met while the timing budget was spent."""
    compiling: int
    """Products running what needs no compile (:func:`.pools.meanwhile`; a map view torch's ops) while their kernels
    compile in the background: compiles not finished yet (one whose compile ended runs its choice at its next call;
    :meth:`.tuner.Tuner.compiling` counts those too)."""
    timed_s: float
    """Seconds the process has spent timing candidates inside its calls."""
    adopted: int = 0
    """Of :attr:`settled`, the products whose key adopted, untimed, the choice of a key one bucket away that was timed
    (:meth:`.tuner.Tuner._adopted`)."""


class Provisional(NamedTuple):
    """A candidate to run for now (another rank times the key, its sweep compiles, or the timing budget is spent):
    not remembered, so a later call looks again."""

    candidate: Candidate


def adopt(candidate_id: str, pool: list[Candidate], ours: Candidate) -> Candidate:
    """The candidate of the job-wide ``candidate_id``, or ``ours`` if this process lacks it."""
    if candidate_id == ours.id:
        return ours
    return next((c for c in pool if c.id == candidate_id), None) or known(candidate_id) or ours


def known(candidate_id: str) -> Candidate | None:
    """A candidate another rank chose, if this process has that backend too."""
    name = candidate_id.split("[", 1)[0]
    if name not in registry.names():
        logger.warning("sparseconv: another rank chose %s, which this process lacks", candidate_id)
        return None
    if "[" not in candidate_id:
        return Candidate(name)
    for params in registry.get(name).params_space:
        candidate = Candidate.of(name, params)
        if candidate.id == candidate_id:
            return candidate
    return None


def current(choice: tuple[Candidate, registry.Backend]) -> bool:
    """Whether a remembered choice's backend is still the registered one (tests swap fakes in and out)."""
    candidate, backend = choice
    try:
        return registry.get(candidate.backend) is backend
    except KeyError:
        return False


def execute(
    namespace: str, problem: ConvProblem, candidate: Candidate, backend: registry.Backend, a, b, kernel_map: KernelMap
) -> torch.Tensor:
    try:
        return backend.run(namespace, problem, candidate.params_dict, a, b, kernel_map)
    except Exception as error:  # noqa: BLE001 - a tuned choice that fails later (e.g. OOM) falls back
        if candidate.backend == FALLBACK:
            raise
        broken = faults.probe(a.device)
        if broken is not None:  # the fallback would fail too, with a message that says nothing
            raise faults.poisoned(namespace, candidate.id, error, broken, recorded=False) from error
        logger.warning("sparseconv: %s failed for %s (%s); running %s", candidate.id, namespace, error, FALLBACK)
        return registry.get(FALLBACK).run(namespace, problem, {}, a, b, kernel_map)
