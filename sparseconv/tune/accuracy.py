"""How well the cost model (:mod:`.prior`) ranks keys it was not fitted on: cross-validated over a tuning cache's
keys, against the static pick (the candidate fastest on average). ``scripts/bench_tuner.py --prior`` prints it; the
tuner itself never calls this.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .prior import MIN_SAMPLES, QUICK_TOP, RIDGE, CostModel, Entries, key_features, measured_cost


@dataclass(frozen=True)
class Accuracy:
    """How the model ranks held-out keys of one namespace and device (slowdowns are means of
    cost(pick) / cost(measured winner); the static pick is the candidate fastest on average over
    the training keys, the baseline a model must beat)."""

    namespace: str
    device: str
    keys: int
    scored: int
    top1: float
    top3: float
    slowdown_top1: float
    slowdown_best_of_top3: float
    worst_best_of_top3: float
    slowdown_static: float


def holdout_accuracy(entries: Entries, folds: int = 5, seed: int = 0, top: int = QUICK_TOP,
                     ridge: float = RIDGE) -> list[Accuracy]:
    """Cross-validated accuracy: keys are dealt into ``folds`` folds, each fold is predicted by a
    model fitted on the others; one row per (namespace, device) with keys of two or more timed
    candidates. A key is scored when the model predicts two or more of its timed candidates."""
    if folds < 2:
        raise ValueError(f"folds must be at least 2, got {folds}")
    usable = []
    for namespace, encoded, entry in entries:
        features = key_features(encoded)
        timings = entry.get("timings") if isinstance(entry, Mapping) else None
        if features is None or not isinstance(timings, Mapping):
            continue
        costs = {cid: cost for cid, r in timings.items() if (cost := measured_cost(r)) < math.inf}
        if len(costs) >= 2:
            usable.append((namespace, encoded, entry, features.device, costs))
    random.Random(seed).shuffle(usable)
    scores: dict[tuple[str, str], list[tuple]] = defaultdict(list)
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for fold in range(folds):
        held = usable[fold::folds]
        train = [u for i, u in enumerate(usable) if i % folds != fold]
        model = CostModel.fit(((ns, k, e) for ns, k, e, _, _ in train), ridge=ridge)
        static = _static_order(train)
        for namespace, encoded, _, device, costs in held:
            totals[(namespace, device)] += 1
            guess = model.predict(namespace, encoded, list(costs))
            if len(guess) < 2:
                continue
            best = min(costs.values())
            order = sorted(guess, key=guess.get)
            winner = min(costs, key=costs.get)
            fallback = static.get((namespace, device), {})
            baseline = min(costs, key=lambda c: fallback.get(c, math.inf))
            scores[(namespace, device)].append((
                order[0] == winner, winner in order[:top], costs[order[0]] / best,
                min(costs[c] for c in order[:top]) / best, costs[baseline] / best))
    rows = []
    for (namespace, device), total in sorted(totals.items()):
        got = scores.get((namespace, device), [])
        mean = (lambda i: sum(s[i] for s in got) / len(got)) if got else (lambda i: math.nan)
        rows.append(Accuracy(namespace, device, total, len(got), mean(0), mean(1), mean(2), mean(3),
                             max((s[3] for s in got), default=math.nan), mean(4)))
    return rows


def _static_order(train: list[tuple]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (namespace, device): each candidate's mean log2(cost / best cost) over the training
    keys it was timed at (two at least)."""
    ratios: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for namespace, _, _, device, costs in train:
        best = min(costs.values())
        for cid, value in costs.items():
            ratios[(namespace, device)][cid].append(math.log2(value / best))
    return {group: {cid: sum(v) / len(v) for cid, v in by.items() if len(v) >= MIN_SAMPLES}
            for group, by in ratios.items()}
