"""The demo command runs end to end on a small scene and reports every stage."""

from __future__ import annotations

import pytest

from sparseconv.__main__ import main


def test_demo_prints_voxel_counts_stages_and_timings(capsys):
    assert main(["demo", "--scene", "room", "--scale", "0.05", "--width", "4", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    for expected in ("voxels per sample", "stem", "down2", "up1", "head", "kernel maps cached", "stride (4, 4, 4)"):
        assert expected in text


def test_unknown_scene_is_rejected():
    with pytest.raises(SystemExit):
        main(["demo", "--scene", "forest"])
