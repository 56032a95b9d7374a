"""python -m sparseconv cache show / clear / export / merge / populate."""

from __future__ import annotations

import msgpack

import sparseconv.tune
from sparseconv.__main__ import main


def test_populate_show_export_merge_clear(tmp_path, capsys):
    assert main(["cache", "populate", "--rows", "512", "--channels", "4", "--kernels", "3", "2s2"]) == 0
    text = capsys.readouterr().out
    assert "entries in" in text
    assert main(["cache", "show", "--namespace", "AB_gather_scatter"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("AB_gather_scatter  v1|") == 2 and "explicit_gemm " in shown and " ok" in shown
    assert main(["cache", "show", "--best-only"]) == 0
    best = capsys.readouterr().out
    assert best.count("winner") == 6 and " ok" not in best

    exported = tmp_path / "shared.msgpack"
    assert main(["cache", "export", str(exported)]) == 0
    data = msgpack.unpackb(exported.read_bytes(), strict_map_key=False)
    assert sum(len(v) for v in data["entries"].values()) == 6

    assert main(["cache", "clear"]) == 0
    capsys.readouterr()
    sparseconv.tune.reset()
    assert sparseconv.tune.get_tuner().cache.items() == []
    assert main(["cache", "merge", str(exported)]) == 0
    assert "took 6 entries" in capsys.readouterr().out
    sparseconv.tune.reset()
    assert len(sparseconv.tune.get_tuner().cache.items()) == 6
