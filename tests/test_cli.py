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
