"""The cost model's accuracy on held-out keys (sparseconv.tune.accuracy), on synthetic timings whose winner moves
with the shape."""

from __future__ import annotations

import pytest
from test_prior import DEVICE, FWD, synthetic

from sparseconv.tune.accuracy import holdout_accuracy
from sparseconv.tune.cache import TuneCache


def test_held_out_keys_are_ranked_well_from_a_cache_file(tmp_path):
    path = tmp_path / "gpu.msgpack"
    cache = TuneCache(path)
    for namespace, encoded, e in synthetic(200, seed=4, noise=0.03):
        cache.put(namespace, encoded, e)
    cache.flush(force=True)
    rows = holdout_accuracy(TuneCache(path).items(), folds=5)
    assert len(rows) == 1
    row = rows[0]
    assert (row.namespace, row.device, row.scored) == (FWD, DEVICE, row.keys) and row.keys >= 150
    assert row.top1 >= 0.85 and row.top3 == 1.0, row
    assert row.slowdown_top1 < 1.03 and row.slowdown_best_of_top3 == 1.0, row
    assert row.slowdown_static > row.slowdown_top1, row  # the winner moves with the shape: a fixed pick loses


def test_fewer_than_two_folds_is_an_error_naming_folds():
    with pytest.raises(ValueError, match="folds must be at least 2, got 1"):
        holdout_accuracy([], folds=1)
