"""The demo command runs end to end on a small scene and prints its report."""

from __future__ import annotations

import pytest

from sparseconv.__main__ import main


def test_demo_trains_on_a_tiny_scene_and_prints_the_report(capsys, monkeypatch):
    # The tuner's timing sweeps of the demo's many small problems would dominate this test (~30 s).
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    assert main(["demo", "--scene", "room", "--scale", "0.05", "--width", "4", "--device", "cpu", "--steps", "20"]) == 0
    text = capsys.readouterr().out
    for expected in ("segmenting synthetic room scenes on cpu", "training:", "loss, mean over", "held-out mIoU",
                     "floor", "wall", "furniture", "ceiling", "algorithms the tuner chose (effort none",
                     "tuning cache:", "stem"):
        assert expected in text


def test_unknown_scene_is_rejected():
    with pytest.raises(SystemExit):
        main(["demo", "--scene", "forest"])


def test_the_covered_time_of_kernel_intervals_is_their_union():
    import random

    from sparseconv.cli.probes import covered

    rng = random.Random()
    for _ in range(50):
        intervals = [(start, start + rng.randint(0, 30)) for start in (rng.randint(0, 200) for _ in range(12))]
        cells = set()  # brute force: the unit cells some interval covers
        for start, stop in intervals:
            cells.update(range(start, stop))
        assert covered(intervals) == len(cells)


@pytest.mark.gpu
def test_the_gpu_busy_share_of_a_pass_is_measured():
    import torch

    from sparseconv.cli.probes import gpu_busy

    a = torch.randn(2048, 2048, device="cuda")
    seen = gpu_busy(lambda: [a @ a for _ in range(4)], passes=2)
    assert seen["kernels"] >= 4 and seen["launches"] >= 4
    assert 0 < seen["busy"] <= seen["span"] + 1e-3
    count, ms = max(seen["by kernel"].values(), key=lambda entry: entry[1])
    assert count >= 4 and 0 < ms <= seen["busy"] + 1e-3  # the matmul's kernel, 4 a pass
    assert sum(seen["idle"].values()) <= seen["span"] and all(gap >= 0 for gap, _, _ in seen["gaps"])
