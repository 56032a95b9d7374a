"""Candidate pools: which candidates a namespace may use for a problem, under the call's mode.

A mode comes from the call's pin (``fwd_algo=`` ...) or else the namespace's environment
variable (``SPARSECONV_FWD_ALGO_MODE`` ...) or else ``auto``. Parsing and checking a mode (names,
levels, the "did you mean" hint) lives with the backend table in
:mod:`sparseconv.backends.algos`, which the operator layer uses too; names are checked
strictly wherever they come from.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

from .. import config
from ..backends import registry
from ..backends.algos import DEFAULT_MODE, LEVELS, AlgoMode, checked_mode, parse_mode
from ..backends.problem import PIN_ARGUMENT, ConvProblem
from .configs import Candidate

logger = logging.getLogger("sparseconv.tune")

FALLBACK = "explicit_gemm"

# The mode names are re-exported: tuner.py (and tests) take them from here with the pools.
__all__ = ["DEFAULT_MODE", "FALLBACK", "LEVELS", "PIN_ARGUMENT", "AlgoMode", "bridge", "candidate_pool",
           "checked_mode", "meanwhile", "parse_mode", "resolve_mode"]


_READ: str = "<read the environment>"  # resolve_mode's default: not a valid mode, so never a caller's value


def resolve_mode(namespace: str, pin: str | Sequence[str] | None, value: str | None = _READ) -> AlgoMode:
    """The call's pin if given, else the namespace's environment variable (``value``, if the caller
    read it: :func:`sparseconv.config.product_settings`), else auto."""
    if pin is not None:
        return checked_mode(pin, namespace, PIN_ARGUMENT[namespace])
    if value is _READ:
        value = config.algo_mode(namespace)[1]
    if value is not None:
        return checked_mode(value, namespace, config.ALGO_MODE_VARIABLES[namespace])
    return DEFAULT_MODE


def candidate_pool(
    namespace: str, problem: ConvProblem, mode: AlgoMode, effort: str, deterministic: bool | None = None
) -> list[Candidate]:
    """Candidates to consider, in preference order (heuristic score, then name).

    effort ``full`` widens ``auto`` to ``all``; a named backend that cannot run the problem is
    an error when it is the only one asked for, and is skipped with a logged reason in a list.
    ``deterministic`` (default: :func:`sparseconv.config.deterministic`) keeps only parameter
    sets the backends mark deterministic; a named backend with none is an error.
    """
    if deterministic is None:
        deterministic = config.deterministic()
    if mode.level is not None:
        level = "all" if effort == "full" and mode.level == "auto" else mode.level
        backends = [registry.get(n) for n in registry.names(namespace)]
    else:
        level = "all" if effort == "full" else "trimmed"
        backends = [registry.get(n) for n in mode.names]
    pool: list[tuple[float, Candidate]] = []
    for backend in backends:
        reason = backend.supports(problem)
        if reason is not None:
            if mode.single:
                raise ValueError(f"{mode.source}: algorithm {backend.name!r} cannot run this problem: {reason}")
            if mode.level is None:
                logger.info("%s: skipping %s: %s", mode.source, backend.name, reason)
            continue
        params_list = [backend.params_space[0]] if mode.single else backend.candidates_params(problem, level)
        if mode.level is None and not params_list:
            params_list = [backend.params_space[0]]
        if deterministic:
            params_list = _deterministic_params(namespace, backend, mode, params_list)
        score = backend.heuristic(problem)
        pool.extend((score, Candidate.of(backend.name, params)) for params in params_list)
    pool.sort(key=lambda item: (-item[0], item[1].id))
    return [candidate for _, candidate in pool]


def _deterministic_params(
    namespace: str, backend: registry.Backend, mode: AlgoMode, params_list: list[Mapping]
) -> list[Mapping]:
    """The deterministic sets of ``params_list``; where it had only others, the deterministic set
    closest to each (fewest parameters changed: splitk_wgrad's pools split the pairs, and the same
    tile at split 1 is atomics-free)."""
    kept = [params for params in params_list if backend.deterministic(namespace, params)]
    if kept or not params_list:
        return kept
    space = [params for params in backend.params_space if backend.deterministic(namespace, params)]
    if space:
        closest = [min(space, key=lambda d, p=p: sum(d.get(k) != v for k, v in p.items())) for p in params_list]
        return list({Candidate.of(backend.name, p).id: p for p in closest}.values())
    if mode.level is not None:
        return []
    valid = [name for name in registry.names(namespace)
             if any(registry.get(name).deterministic(namespace, p) for p in registry.get(name).params_space)]
    message = (f"{mode.source}: algorithm {backend.name!r} is not deterministic for {namespace} (its partial "
               f"sums meet through atomic adds), and deterministic mode is on (sparseconv.set_deterministic(True), "
               f"SPARSECONV_DETERMINISTIC=1 or torch.use_deterministic_algorithms(True)); deterministic "
               f"algorithms: {valid}")
    if config.deterministic_warn_only():
        warnings.warn(message + "; running it anyway, as torch's warn_only=True asks", stacklevel=2)
        return params_list
    raise ValueError(message)


_REFERENCE = Candidate(FALLBACK)
_TABLE = Candidate("explicit_gemm_table")


def bridge(namespace: str, problem: ConvProblem) -> Candidate | None:
    """What ``namespace``'s products of ``problem`` run while their tuned kernels compile, once its own few kernels
    are compiled (queued first: :meth:`~.precompile.ChoiceCompiles.ahead`): the bridge parameter set
    (:attr:`~sparseconv.backends.registry.Backend.bridge`) of the best-scored backend that has one and can run
    ``problem``; None where none has one. A cold street MinkUNet's tuned picks are ~90 kernels, 0.3-0.6 s each in
    the workers, the last compiled ~20 s in; the passes meanwhile ran explicit_gemm_table at 3-9x a steady pass
    (H200, 2026-12-03)."""
    found = []
    for name in registry.names(namespace):
        backend = registry.get(name)
        if backend.bridge is None or backend.supports(problem) is not None:
            continue
        params = backend.bridge(problem)
        if params is not None:
            found.append((-backend.heuristic(problem), name, params))
    if not found:
        return None
    _, name, params = min(found, key=lambda item: item[:2])
    return Candidate.of(name, params)


def meanwhile(problem: ConvProblem) -> Candidate:
    """What a product runs while its choice's kernels compile in the background
    (:meth:`~.precompile.ChoiceCompiles.defer`), compiled by nothing: on a GPU, explicit_gemm_table (one gather
    through the neighbour table and one GEMM a chunk of rows: a few launches a product and no float32 scatter, where
    explicit_gemm_grouped's passes took ~4x the steady pass's time on an H200's MinkUNet, most of it in its scatter's
    atomics); else the reference."""
    return _TABLE if problem.device.type == "cuda" else _REFERENCE
