"""The demo's training run, report, bird's-eye picture, and the segmentation metrics it uses."""

from __future__ import annotations

import importlib.util
import math
import sys
import time

import pytest
import torch

import sparseconv.tune
from sparseconv.cli.demo import format_report, run_demo
from sparseconv.metrics import confusion_matrix, iou_per_class
from sparseconv.viz import save_bev_comparison

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
def no_tuning_sweeps(monkeypatch):
    """The tuner's timing sweeps of the demo's many small distinct problems take ~30 s on a 2-core
    CPU; what these tests check is the demo, so they run on the tuner's heuristic choice."""
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")


def test_tiny_demo_trains_scores_plots_and_leaves_the_callers_rng_alone(tmp_path, no_tuning_sweeps):
    rng = torch.get_rng_state()
    plot = tmp_path / "bev.png" if HAS_MATPLOTLIB else None
    report = run_demo("room", 1, 0.1, "cpu", 4, 4, seed=3, plot=plot, progress=False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(report["losses"]) == len(report["step_seconds"]) == 4
    assert all(math.isfinite(v) for v in report["losses"])
    assert report["classes"] == ["floor", "wall", "furniture", "ceiling"]
    assert 0.0 <= report["miou"] <= 1.0 and sum(report["class_voxels"]) == report["held_out_voxels"]
    present = [v for v in report["iou"] if not math.isnan(v)]
    assert math.isclose(report["miou"], sum(present) / len(present))
    text = format_report(report)
    for expected in ("MinkUNet14 (width 4", "training: 4 steps", "loss, mean over", "held-out mIoU", "furniture"):
        assert expected in text
    done = report["tuner"]["progress"]
    assert f"tuner at the end: {done['settled']} products tuned, {done['untimed']} running a pick untimed" in text
    if HAS_MATPLOTLIB:
        assert report["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "bird's-eye picture" in text
    # The closing line is the run's wall time (what the docs' "about N minutes" is checked against).
    assert report["wall_seconds"] >= report["data_seconds"] + sum(report["step_seconds"])
    threads = torch.get_num_threads()
    for seconds, shown in ((report["wall_seconds"], f"{report['wall_seconds']:.1f} s"), (42.34, "42.3 s"),
                           (59.97, "1 min 0 s"), (155.2, "2 min 35 s")):
        last = format_report({**report, "wall_seconds": seconds}).splitlines()[-1]
        assert last == f"demo wall time: {shown} from generating the data to this report, on cpu ({threads} torch threads)"


def test_bev_plot_without_matplotlib_says_how_to_install_it_before_training(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ImportError, match=r"pip install 'sparseconv\[plot\]'"):
        save_bev_comparison(tmp_path / "x.png", torch.zeros(3, 4, dtype=torch.int32), ids, ids, ["a"])
    monkeypatch.setattr("sparseconv.cli.demo.make_scene", None)  # any training would fail on this instead
    with pytest.raises(ImportError, match="needs matplotlib"):
        run_demo(plot=tmp_path / "x.png")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"scene": "forest"}, "scene must be one of"), ({"steps": 0}, "steps must be a positive int"),
     ({"width": 2.5}, "width must be a positive int"), ({"scale": -1.0}, "scale must be a finite number"),
     ({"plot": "/no/such/folder/bev.png"}, "plot: the folder of")],
)
def test_demo_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_demo(**kwargs)


def test_confusion_matrix_and_iou_against_counting():
    num_classes = 5
    target = torch.randint(0, 4, (500,))  # class 4 never occurs
    prediction = torch.where(torch.rand(500) < 0.7, target, torch.randint(0, 4, (500,)))
    confusion = confusion_matrix(prediction, target, num_classes)
    for t in range(num_classes):
        for p in range(num_classes):
            assert confusion[t, p] == int(((target == t) & (prediction == p)).sum())
    iou = iou_per_class(confusion)
    for c in range(4):
        hit, union = ((target == c) & (prediction == c)).sum(), ((target == c) | (prediction == c)).sum()
        assert math.isclose(float(iou[c]), int(hit) / int(union))
    assert math.isnan(float(iou[4]))


def test_confusion_matrix_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"target must hold integer class ids in \[0, 3\)"):
        confusion_matrix(torch.tensor([0, 1]), torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="one shape"):
        confusion_matrix(torch.tensor([0, 1]), torch.tensor([0]), 3)


def test_the_tuning_phase_is_shown_with_its_time_and_the_problems_it_timed(monkeypatch, capsys):
    from sparseconv.tune import timing

    # One timed sample a candidate: what is checked is the phase's report, not the timings.
    monkeypatch.setattr(timing, "plan_for", lambda device: timing.TimingPlan(0, 1, False, min_repeats=1))
    report = run_demo("room", 1, 0.02, "cpu", 2, 2, progress=True)
    err = capsys.readouterr().err
    assert ("choosing kernels for this CPU as it trains (timing problems no tuning cache holds; after the first steps, "
            "in at most a tenth of the time)") in err
    assert report["tuning_steps"] == 2 and report["tuned_problems"] > 0 and report["tunings_saved"] == "saved"
    untimed = report["untimed_problems"]
    line = (f"tuning: the first 2 steps took {sum(report['step_seconds']):.1f} s; {report['tuned_problems']} problems "
            f"timed so far, cached in {sparseconv.tune.get_tuner().cache.path}"
            + (f"; {untimed} more run a pick untimed until later steps time them" if untimed else ""))
    assert line in err and line in format_report(report)
    assert len(sparseconv.tune.get_tuner().cache.path.read_bytes()) > 0  # (it says so because the file has them)


def test_a_tuning_cache_that_cannot_be_written_is_said_so_where_the_tuning_is_reported(monkeypatch, capsys,
                                                                                        tmp_path):
    from sparseconv.tune import timing

    monkeypatch.setattr(timing, "plan_for", lambda device: timing.TimingPlan(0, 1, False, min_repeats=1))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(blocker / "cache"))  # a directory under a file: never made
    sparseconv.tune.reset()
    report = run_demo("room", 1, 0.02, "cpu", 2, 2, progress=True)
    err = capsys.readouterr().err
    assert report["tuned_problems"] > 0 and report["tunings_saved"] == "unwritable"
    line = (f"{report['tuned_problems']} problems timed, NOT cached: {blocker / 'cache' / 'autotune.msgpack'} cannot "
            "be written, so a new process times them again")
    assert line in err and line in format_report(report) and "cached in" not in err


def test_tunings_the_cache_writer_thread_already_wrote_are_reported_saved():
    from sparseconv.cli.demo import _save_tunings

    cache = sparseconv.tune.get_tuner().cache
    cache.put("ns", "key", {"evidence": 1, "updated": time.time()})  # the first put hands its write to the thread
    assert cache.wait_for_writes(30) and cache.unflushed == 0  # so the demo's forced flush finds nothing left
    assert _save_tunings() == "saved"


def test_a_run_with_nothing_to_tune_says_so_and_ten_steps_train(no_tuning_sweeps, capsys):
    report = run_demo("room", 1, 0.01, "cpu", 2, 10, progress=True)  # 10 steps: OneCycleLR's zero division
    assert report["tuning_steps"] == 8 and report["tuned_problems"] == 0 and len(report["losses"]) == 10
    assert "tuning: the first 8 steps took" in capsys.readouterr().err
    assert "nothing timed (SPARSECONV_AUTOTUNE_EFFORT=none" in format_report(report)
