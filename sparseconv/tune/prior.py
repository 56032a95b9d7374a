"""A cost model fitted on the tuning cache: each candidate's time for a key never timed.

A cold sweep then times only what the model ranks first (``effort`` quick) and an untimed pick
(``effort`` none) is the model's first instead of the backends' static heuristic order.

Features of a key (read back from ``TuneKey.encode()``): log2 N_in, log2 N_out, log2 pairs per
offset, log2 C_in, log2 C_out, log2 K, down / up / generative flags and the dtype (one-hot).
Targets: log2 of a candidate's GPU time and, separately, of its host time a call; its predicted
cost is the larger, as the tuner's ``cost`` (a small layer's calls are host-bound, which a
single log-linear law cannot bend to). One model per (namespace, device): slopes shared by
every candidate, fitted on each candidate's deviations from its own mean, plus a per-candidate
intercept and slope corrections shrunk toward zero (ridge): a candidate timed at a few keys
borrows the common trends, one timed at many gets its own law. numpy least squares, a few
milliseconds for a cache of thousands of timings.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import re
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..backends import registry
from . import shipped
from .cache import TuneCache
from .configs import Candidate
from .key import TuneKey

logger = logging.getLogger("sparseconv.tune")

QUICK_TOP = 3
"""Candidates of the model's ranking that effort quick times (with every pool candidate it has no data on)."""
MIN_KEYS = 8
"""Keys of a namespace, device and dtype the model must have been fitted on before it prunes or picks."""
MIN_SAMPLES = 2
"""Keys a candidate must have been timed at for the model to predict it."""
RIDGE = 1.0
"""Penalty on the per-candidate slope corrections, in units of standardised features (one pseudo-key)."""
REFIT_SHARE = 0.05
"""A fitted model is refitted once the entries it was fitted on have grown by this share (at least one)."""

FEATURES = ("log2 N_in", "log2 N_out", "log2 pairs/offset", "log2 C_in", "log2 C_out", "log2 K", "down", "up",
            "generative")

# The device is one field: a deterministic or lone key's flags after it (``|det``, ``|lone``) are not part of it
# (read as its device, they left such keys in groups of their own, never predicted).
_KEY = re.compile(r"v\d+\|n(-?\d+)>(-?\d+)\|d(-?\d+)\|c(\d+)>(\d+)\|k(\d+)\|([st])([0-9x]+)(g?)\|([^|]+)\|(.+?)"
                  r"(?:\|det)?(?:\|lone)?")

Entries = Iterable[tuple[str, str, Mapping]]


@dataclass(frozen=True)
class KeyFeatures:
    """The numeric features of an encoded key (see FEATURES), its dtype and device."""

    values: tuple[float, ...]
    dtype: str
    device: str


def key_features(encoded: str) -> KeyFeatures | None:
    """Features of a tuner key (``TuneKey.encode()``); None for anything else (an @autotune key)."""
    match = _KEY.fullmatch(encoded)
    if match is None:
        return None
    n_in, n_out, density, c_in, c_out, volume = (int(g) for g in match.groups()[:6])
    kind, stride, generative, dtype, device = match.groups()[6:]
    # Buckets are round(2·log2 rows) (-1: no rows) and round(-2·log2(pairs / (rows·K))).
    log_in, log_out = max(n_in, 0) / 2, max(n_out, 0) / 2
    strided = any(int(s) > 1 for s in stride.split("x") if s)
    values = (log_in, log_out, log_out - density / 2, math.log2(max(c_in, 1)), math.log2(max(c_out, 1)),
              math.log2(max(volume, 1)), float(kind == "s" and strided), float(kind == "t"), float(generative == "g"))
    return KeyFeatures(values, dtype, device)


def _timed(record: object) -> tuple[float, float | None] | None:
    """(ms, host ms or None) of a record that passed the guard, else None."""
    if not isinstance(record, Mapping) or record.get("verdict") != "ok":
        return None
    ms, host = record.get("ms"), record.get("host_ms")
    if not isinstance(ms, (int, float)) or not ms > 0:
        return None
    return float(ms), float(host) if isinstance(host, (int, float)) and host > 0 else None


def measured_cost(record: Mapping) -> float:
    """A timed record's cost: its GPU or host time a call, whichever is longer (as evidence.cost)."""
    ms, host = _timed(record) or (math.inf, None)
    return max(ms, host or 0.0)


class _Law:
    """Per-candidate log-linear laws of one target, fitted as the module docstring says."""

    def __init__(self, z: np.ndarray, y: np.ndarray, who: np.ndarray, count: int, ridge: float) -> None:
        p = z.shape[1]
        sums = np.bincount(who, minlength=count).astype(float)
        n = np.maximum(sums, 1.0)[:, None]
        z_mean = np.stack([np.bincount(who, weights=z[:, j], minlength=count) for j in range(p)], axis=1)
        y_mean = np.bincount(who, weights=y, minlength=count)
        zc, yc = z - (z_mean / n)[who], y - (y_mean / n[:, 0])[who]
        shared = np.linalg.solve(zc.T @ zc + ridge * np.eye(p), zc.T @ yc)
        self.intercept = np.full(count, np.nan)
        self.slopes = np.tile(shared, (count, 1))
        fitted = np.flatnonzero(sums >= MIN_SAMPLES)
        if not fitted.size:
            return
        # Each fitted candidate's normal equations from its own rows (a slice once sorted by candidate), solved
        # together: positive definite (n >= 2 rows for the intercept, the ridge for the slopes).
        order = np.argsort(who, kind="stable")
        design = np.hstack([np.ones((len(y), 1)), z])[order]
        residual = (y - z @ shared)[order]
        bounds = np.searchsorted(who[order], np.arange(count + 1))
        penalty = np.diag([0.0] + [ridge] * p)
        grams = np.stack([design[bounds[c]:bounds[c + 1]].T @ design[bounds[c]:bounds[c + 1]] for c in fitted])
        rhs = np.stack([design[bounds[c]:bounds[c + 1]].T @ residual[bounds[c]:bounds[c + 1]] for c in fitted])
        theta = np.linalg.solve(grams + penalty, rhs[..., None])[..., 0]
        self.intercept[fitted] = theta[:, 0]
        self.slopes[fitted] += theta[:, 1:]

    def __call__(self, c: int, z: np.ndarray) -> float | None:
        value = self.intercept[c] + float(self.slopes[c] @ z)
        return None if math.isnan(value) else value


class _Group:
    """The laws of one (namespace, device)."""

    def __init__(self, samples: list[tuple[str, str, KeyFeatures, float, float | None]], ridge: float) -> None:
        """``samples``: (candidate id, encoded key, its features, ms, host ms or None)."""
        self.candidates = sorted({s[0] for s in samples})
        index = {c: i for i, c in enumerate(self.candidates)}
        self.dtypes = sorted({s[2].dtype for s in samples})
        self.keys_by_dtype: dict[str, int] = defaultdict(int)
        for features in {s[1]: s[2] for s in samples}.values():
            self.keys_by_dtype[features.dtype] += 1
        # One row per key, its samples (~80 candidates a key) pointing at it: a row a sample was a third of a fit
        rows, at = [], {}
        for s in samples:
            if s[1] not in at:
                at[s[1]] = len(rows)
                rows.append(self._row(s[2]))
        x = np.array(rows)[[at[s[1]] for s in samples]]
        samples = [s[:1] + s[2:] for s in samples]
        self.mean, self.scale = x.mean(0), x.std(0)
        self.scale[self.scale == 0] = 1.0
        z = (x - self.mean) / self.scale
        who = np.array([index[s[0]] for s in samples])
        self.gpu = _Law(z, np.log2([s[2] for s in samples]), who, len(self.candidates), ridge)
        hosted = np.array([s[3] is not None for s in samples])
        self.host = _Law(z[hosted], np.log2([s[3] for s in samples if s[3] is not None]), who[hosted],
                         len(self.candidates), ridge) if hosted.any() else None
        self.index = index

    def _row(self, features: KeyFeatures) -> list[float]:
        return [*features.values, *(float(features.dtype == d) for d in self.dtypes[1:])]

    def predict(self, features: KeyFeatures, candidate_ids: Sequence[str]) -> dict[str, float]:
        """Predicted cost (ms) of each candidate the group can predict (a dtype it has seen)."""
        if features.dtype not in self.keys_by_dtype:
            return {}
        z = (np.array(self._row(features)) - self.mean) / self.scale
        out = {}
        for cid in candidate_ids:
            c = self.index.get(cid)
            gpu = None if c is None else self.gpu(c, z)
            if gpu is None:
                continue
            host = self.host(c, z) if self.host is not None else None
            out[cid] = 2.0 ** max(gpu, host if host is not None else -math.inf)
        return out


def _entry_samples(namespace: str, encoded: str, entry: Mapping, versions: Mapping[str, int] | None
                   ) -> tuple[tuple[str, str] | None, list[tuple]]:
    """(its group: (namespace, device), its samples: (candidate id, encoded key, features, ms, host ms or None)) of
    one cache entry's timings that passed, those of a listed backend at another version left out."""
    features = key_features(encoded)
    timings = entry.get("timings") if isinstance(entry, Mapping) else None
    if features is None or not isinstance(timings, Mapping):
        return None, []
    rows = []
    for cid, record in timings.items():
        timed = _timed(record)
        backend = record.get("backend", str(cid).split("[", 1)[0]) if timed else None
        if timed is None or (versions and backend in versions and record.get("version") != versions[backend]):
            continue
        rows.append((cid, encoded, features, *timed))
    return (namespace, features.device), rows


class CostModel:
    """Predicted cost of each candidate for keys of the namespaces and devices it was fitted on."""

    def __init__(self, groups: Mapping[tuple[str, str], _Group]) -> None:
        self._groups = dict(groups)

    @classmethod
    def fit(cls, entries: Entries, versions: Mapping[str, int] | None = None, ridge: float = RIDGE,
            parsed: dict | None = None) -> CostModel:
        """Fit on cache entries (namespace, encoded key, entry); with ``versions`` ({backend: version}),
        a listed backend's timings of another version are left out (they timed other code). ``parsed``: a memo
        of each entry's samples (by namespace and key, kept while the entry is the same object and the versions
        the same), which :func:`model_of` keeps per cache: a refit then reads only the entries that changed
        (reading ~16k shipped H200 timings was ~60% of a fit's 90-140 ms)."""
        samples: dict[tuple[str, str], list] = defaultdict(list)
        versions_key = tuple(sorted(versions.items())) if versions else ()
        for namespace, encoded, entry in entries:
            held = parsed.get((namespace, encoded)) if parsed is not None else None
            if held is not None and held[0] is entry and held[1] == versions_key:
                group, rows = held[2:]
            else:
                group, rows = _entry_samples(namespace, encoded, entry, versions)
                if parsed is not None:
                    parsed[(namespace, encoded)] = (entry, versions_key, group, rows)
            if rows:
                samples[group].extend(rows)
        return cls({group: _Group(rows, ridge) for group, rows in samples.items()})

    def keys(self, namespace: str, device: str, dtype: str) -> int:
        """How many distinct keys of this namespace, device and dtype the model was fitted on."""
        group = self._groups.get((namespace, device))
        return group.keys_by_dtype.get(dtype, 0) if group else 0

    def predict(self, namespace: str, encoded: str, candidate_ids: Sequence[str]) -> dict[str, float]:
        """{candidate id: predicted ms} for those of ``candidate_ids`` the model knows at this key."""
        features = key_features(encoded)
        group = self._groups.get((namespace, features.device)) if features else None
        return group.predict(features, candidate_ids) if group else {}


# ---------------------------------------------------------------- the tuner's use -------------

_MODELS: weakref.WeakKeyDictionary[TuneCache, dict[tuple[str, str | None], tuple[tuple, CostModel]]] = (
    weakref.WeakKeyDictionary())
_PARSED: weakref.WeakKeyDictionary[TuneCache, dict] = weakref.WeakKeyDictionary()  # CostModel.fit's memo, per cache


def model_of(cache: TuneCache, namespace: str, device: str | None = None) -> CostModel:
    """The model of ``namespace`` fitted on ``cache`` (and, with ``device``, the shipped tunings of
    that device beneath it) with the registered backends' versions; refitted when the versions
    change, when entries were dropped, or when the entries grew by :data:`REFIT_SHARE` since the
    last fit.

    Refitting at every new entry made every new key pay a fit: on unseen point clouds, where
    each cloud brings a few new keys, fits over the ~20k shipped H200 timings took 340 ms of a
    training step's 500 (street1, H200, 2026-11-28). A model fitted on 20 times more keys than
    it is missing ranks a new key as well as a refitted one would.
    """
    entries = cache.items(namespace)
    if device is not None:
        own = {key for _, key, _ in entries}
        entries += [(ns, key, entry) for (ns, key), entry in shipped.entries_for(device).items()
                    if ns == namespace and key not in own]
    versions = tuple(sorted((name, registry.get(name).version) for name in registry.names()))
    fitted = _MODELS.setdefault(cache, {})
    # Per device too: each device's fit holds its own shipped entries.
    held = fitted.get((namespace, device))
    if held is None or _refit(held[0], len(entries), versions):
        with _no_collections():
            model = CostModel.fit(entries, dict(versions), parsed=_PARSED.setdefault(cache, {}))
        held = fitted[(namespace, device)] = ((len(entries), versions), model)
    return held[1]


@contextlib.contextmanager
def _no_collections() -> Iterator[None]:
    """Python's cyclic collector off inside the block (as it was after it). A fit's rows (a tuple per timing,
    ~20k shipped H200 timings) outlive the young generations while it runs and set off a full collection of the
    process's heap: a refit inside a street1 inference on an unseen cloud took 359 ms, 271 of them in that
    collection (H200, 2026-12-01). They are freed by reference counting once the fit returns."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _refit(fitted_on: tuple[int, tuple], entries: int, versions: tuple) -> bool:
    """Whether a model fitted on ``fitted_on`` ((entry count, backend versions)) is refitted now."""
    count, fitted_versions = fitted_on
    return fitted_versions != versions or entries < count or entries - count >= max(1, REFIT_SHARE * count)


def predicted(cache: TuneCache, namespace: str, key: TuneKey, pool: Sequence[Candidate]) -> dict[str, float] | None:
    """Predicted ms of the pool's candidates the model knows, or None while it has fewer than
    MIN_KEYS keys of this namespace, device and dtype."""
    model = model_of(cache, namespace, key.device)
    if model.keys(namespace, key.device, key.dtype) < MIN_KEYS:
        return None
    return model.predict(namespace, key.encode(), [c.id for c in pool])


def unknown(cache: TuneCache, namespace: str, key: TuneKey, candidates: Sequence[Candidate]) -> list[Candidate]:
    """Those of ``candidates`` the model cannot predict at ``key`` (too few timings of theirs);
    all of them while the model has too little data to predict at all."""
    costs = predicted(cache, namespace, key, candidates)
    return [c for c in candidates if c.id not in costs] if costs is not None else list(candidates)


def ranked(cache: TuneCache, namespace: str, key: TuneKey, pool: Sequence[Candidate]) -> list[Candidate]:
    """The pool by predicted cost, candidates the model does not know after them in pool
    (heuristic) order; the pool as it is without enough data."""
    costs = predicted(cache, namespace, key, pool) or {}
    return sorted(pool, key=lambda c: (c.id not in costs, costs.get(c.id, 0.0)))


def timing_rounds(
    cache: TuneCache,
    namespace: str,
    key: TuneKey,
    pool: Sequence[Candidate],
    missing: Sequence[Candidate],
    effort: str,
    passed: Callable[[], bool],
) -> Iterator[list[Candidate]]:
    """The untimed candidates (``missing``) to time, in rounds.

    Effort quick with a fitted model: first the model's QUICK_TOP picks and every candidate it has
    no data on, then, only if ``passed()`` says nothing in the pool passed the guard after them,
    the rest. Otherwise (effort full, or too little data): ``missing`` in one round.
    """
    costs = predicted(cache, namespace, key, pool) if effort == "quick" and len(missing) > 1 else None
    if not costs:
        if missing:
            yield list(missing)
        return
    order = sorted(pool, key=lambda c: (c.id not in costs, costs.get(c.id, 0.0)))
    picks = {c.id for c in order[:QUICK_TOP]} | {c.id for c in pool if c.id not in costs}
    todo = {c.id for c in missing}
    first = [c for c in order if c.id in todo and c.id in picks]
    rest = [c for c in order if c.id in todo and c.id not in picks]
    if rest:
        logger.info("sparseconv: cost model: timing %d of %d candidates for %s %s (%s)", len(first), len(pool),
                    namespace, key.encode(), ", ".join(c.id for c in first) or "all picks cached")
    if first:
        yield first
    if rest and not passed():
        logger.info("sparseconv: cost model: no pick passed for %s %s; timing the other %d", namespace,
                    key.encode(), len(rest))
        yield rest
