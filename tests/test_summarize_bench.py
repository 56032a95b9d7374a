"""scripts/summarize_bench.py: the newest row per cell wins, and the summary counts what it should."""

from __future__ import annotations

from conftest import load_script


def _row(scene, dtype, c, layer, ours, spconv, sp_triton, ours_bwd, spconv_bwd, sp_triton_bwd, peak, triton="-",
         cutlass="-"):
    return " | ".join([scene, dtype, str(c), layer, "10->10", ours, spconv, sp_triton, "9.0", ours_bwd, spconv_bwd,
                       sp_triton_bwd, "9.0", peak, "1%", "mask/mask/splitk", triton, cutlass, triton, cutlass])


def test_later_logs_replace_rows_and_the_summary_counts_losers(tmp_path):
    script = load_script("summarize_bench")
    old = tmp_path / "old.log"
    new = tmp_path / "new.log"
    old.write_text("device: x\n" + _row("street1", "float16", 32, "subm3", "9.0", "1.0", "1.0", "9.0", "1.0", "1.0", "1%")
                   + "\n" + _row("room2", "bfloat16", 64, "up2", "1.0", "n/a (KeyError)", "2.0", "1.0", "n/a (KeyError)",
                                 "0.5", "7%", "1.0", "2.0") + "\n")
    new.write_text("# street1 float16 32 subm3 ours: detail\n"
                   + _row("street1", "float16", 32, "subm3", "0.5", "1.0", "2.0", "1.0", "2.0", "4.0", "3%") + "\n")
    grid = script.read_rows([str(old), str(new)])
    assert len(grid) == 2 and grid[("street1", "float16", 32, "subm3")]["ours"] == "0.5"
    lines = script.summarize(grid)
    assert lines[0] == "2 cells"
    assert lines[1].startswith("forward: 2.00x over spconv (1 cells), 2.00x over the faster peer, worst 2.00x; 0 losing")
    forward_bwd = next(line for line in lines if line.startswith("forward+backward:"))
    assert "1 losing: room2 bfloat16 64 up2 0.50x" in forward_bwd
    assert "forward family best: Triton 1, CUTLASS 0 cells" in lines
    assert lines[-1] == "best fraction of bf16 peak: 7% (room2 bfloat16 64 up2)"
    assert len(script.markdown(grid)) == 4
