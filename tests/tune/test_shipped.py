"""The shipped tuning database beneath the user's cache, and ``python -m sparseconv tune populate|export``.

A "shipped" file is planted in a temporary folder standing in for sparseconv/tune/data/; the fake
backends count their calls, so a choice served without timing shows as one call (the run itself).
"""

from __future__ import annotations

import copy
import logging

import msgpack
import pytest
import torch
from conv_cases import MODES, make_input
from fakes import Calls, fast, registered, slow

import sparseconv.tune
from sparseconv.models import MinkUNet
from sparseconv.__main__ import main
from sparseconv.ops import sparse_conv3d
from sparseconv.cli import populate
from sparseconv.tune import shipped, timing
from sparseconv.tune.cachefile import SCHEMA_VERSION, read_entries
from sparseconv.tune.key import device_identity

FWD = "AB_gather_scatter"
CPU = device_identity(torch.device("cpu"))


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """The shipped tunings' folder, empty, in place of the package's; the layer switched on."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(shipped, "data_dir", lambda: folder)
    monkeypatch.setenv("SPARSECONV_SHIPPED_TUNINGS", "1")
    shipped.forget()
    yield folder
    shipped.forget()


def plant(folder, entries: dict[tuple[str, str], dict], identity: str = CPU) -> None:
    shipped.write(folder / shipped.device_file_name(identity), entries)


def conv(x, calls_record=None):
    """Forward and backward of one submanifold conv; forward chooses between the two fakes."""
    weight = torch.randn(27, 4, 5, requires_grad=True)
    out = sparse_conv3d(x.replace(x.feats.clone().requires_grad_()), weight, record=calls_record,
                        fwd_algo="[fake_slow, fake_fast]", dgrad_algo="explicit_gemm", wgrad_algo="explicit_gemm")
    out.feats.backward(torch.randn_like(out.feats))


def user_entries():
    return sparseconv.tune.get_tuner().cache.items(FWD)


def tuned_here(monkeypatch, x) -> tuple[str, dict]:
    """(key, entry) of the forward as this machine tunes it (fake_fast wins), tuned into a cache of
    its own so that the test's user cache starts empty."""
    with monkeypatch.context() as scoped:
        scoped.setenv("SPARSECONV_SHIPPED_TUNINGS", "0")
        scoped.setenv("SPARSECONV_CACHE_DIR", str(sparseconv.tune.get_tuner().cache.path.parent / "elsewhere"))
        sparseconv.tune.reset()
        with registered(slow(Calls()), fast(Calls())):
            conv(x)
        ((_, key, entry),) = user_entries()
        sparseconv.tune.reset()
    assert entry["winner"] == "fake_fast" and user_entries() == []
    return key, entry


def slow_wins(entry: dict) -> dict:
    """``entry`` as if fake_slow had been timed the faster: a choice no sweep here would make."""
    shipped_entry = copy.deepcopy(entry)
    shipped_entry["timings"]["fake_slow"].update(ms=1e-4, host_ms=1e-4)
    shipped_entry["winner"] = "fake_slow"
    return shipped_entry


@pytest.fixture
def x():
    return make_input(MODES[1], 4, "cpu", dtype=torch.float32, n=300)


def test_a_shipped_entry_serves_the_choice_with_no_timing_and_stays_out_of_the_users_file(data_dir, monkeypatch, x):
    key, entry = tuned_here(monkeypatch, x)
    plant(data_dir, {(FWD, key): slow_wins(entry)})
    calls = Calls()
    record = {}
    with registered(slow(calls), fast(calls)):
        conv(x, record)
    assert record[FWD] == "fake_slow"
    assert calls.of("fake_slow", FWD) == 1 and calls.of("fake_fast", FWD) == 0  # the run itself, no sweep
    sparseconv.tune.get_tuner().cache.flush(force=True)
    assert user_entries() == []
    path = sparseconv.tune.get_tuner().cache.path
    assert not path.exists() or FWD not in msgpack.unpackb(path.read_bytes())["entries"]


def test_the_users_cache_wins_over_the_shipped_entry(data_dir, monkeypatch, x):
    key, entry = tuned_here(monkeypatch, x)
    plant(data_dir, {(FWD, key): slow_wins(entry)})
    sparseconv.tune.get_tuner().cache.put(FWD, key, entry)
    calls = Calls()
    record = {}
    with registered(slow(calls), fast(calls)):
        conv(x, record)
    assert record[FWD] == "fake_fast" and calls.of("fake_slow", FWD) == 0 and calls.of("fake_fast", FWD) == 1


def test_a_shipped_timing_of_another_backend_version_is_timed_again(data_dir, monkeypatch, x):
    key, entry = tuned_here(monkeypatch, x)
    plant(data_dir, {(FWD, key): slow_wins(entry)})
    calls = Calls()
    record = {}
    with registered(slow(calls, version=2), fast(calls)):  # fake_slow changed since the file was made
        conv(x, record)
    assert calls.of("fake_slow", FWD) > 2 and calls.of("fake_fast", FWD) == 1  # only the stale one is swept
    assert record[FWD] == "fake_fast"
    ((_, stored_key, stored),) = user_entries()  # what was re-timed reaches the user's cache
    assert stored_key == key and stored["timings"]["fake_slow"]["version"] == 2


def test_the_switch_turns_the_shipped_tunings_off(data_dir, monkeypatch, x):
    key, entry = tuned_here(monkeypatch, x)
    plant(data_dir, {(FWD, key): slow_wins(entry)})
    monkeypatch.setenv("SPARSECONV_SHIPPED_TUNINGS", "0")
    calls = Calls()
    record = {}
    with registered(slow(calls), fast(calls)):
        conv(x, record)
    assert record[FWD] == "fake_fast" and calls.of("fake_slow", FWD) > 1
    monkeypatch.setenv("SPARSECONV_SHIPPED_TUNINGS", "maybe")
    with pytest.raises(ValueError, match="SPARSECONV_SHIPPED_TUNINGS must be 1 or 0.*'maybe'"):
        shipped.lookup(FWD, key)


@pytest.mark.parametrize("content", [b"\xc1 not msgpack", msgpack.packb({"schema": SCHEMA_VERSION + 1, "entries": {}}),
                                     msgpack.packb([1, 2])], ids=["corrupt", "newer-schema", "not-a-document"])
def test_an_unusable_shipped_file_is_a_warning_and_ignored(data_dir, x, caplog, content):
    planted = data_dir / shipped.device_file_name(CPU)
    planted.write_bytes(content)
    calls = Calls()
    record = {}
    with registered(slow(calls), fast(calls)), caplog.at_level(logging.WARNING, logger="sparseconv"):
        conv(x, record)
        conv(x, record)
    assert record[FWD] == "fake_fast" and calls.of("fake_slow", FWD) > 1
    assert caplog.text.count("shipped tunings") == 1 and "unusable" in caplog.text
    assert planted.read_bytes() == content  # package data: never moved aside or rewritten


def test_only_the_file_of_the_keys_device_is_read(data_dir, monkeypatch):
    (data_dir / shipped.device_file_name("cuda Other GPU sm90 1SM")).write_bytes(b"\xc1 never read")
    read = []
    monkeypatch.setattr(shipped, "read_entries", lambda path: read.append(path.name) or {})
    assert shipped.lookup(FWD, f"v1|n1>1|{CPU}") is None and read == []
    plant(data_dir, {})
    shipped.forget()  # the folder is listed once
    assert shipped.lookup("autotune:m.f", f"{CPU}|M=1") is None and read == [shipped.device_file_name(CPU)]


def test_populate_tunes_a_model_and_exports_a_file_that_then_serves_every_key(tmp_path, data_dir, monkeypatch, capsys):
    # One timed sample a candidate: the test checks what populate covers, not the timings.
    monkeypatch.setattr(timing, "plan_for", lambda device: timing.TimingPlan(0, 1, False, min_repeats=1))
    # The MinkUNet with one residual block of 8 channels at each end: its keys of every kind
    # (submanifold, strided, transposed) in fewer than the full model's ~70.
    small = MinkUNet(4, 20, blocks=(1, 0, 0, 0, 0, 0, 0, 1), planes=(8,) * 8, stem_channels=8, stem_kernel_size=3)
    monkeypatch.setattr(populate, "_model", lambda name, width: small)
    argv = ["tune", "populate", "--scale", "0.002", "--device", "cpu"]
    assert main([*argv, "--export", str(data_dir)]) == 0
    out = capsys.readouterr()
    tuned = int(out.out.split("tuned ", 1)[1].split(" keys")[0])
    assert tuned > 5 and "sparseconv tune populate" in out.err  # the progress bar
    exported = data_dir / shipped.device_file_name(CPU)
    entries = read_entries(exported)
    assert len(entries) == tuned and f"exported {tuned} entries" in out.out
    assert all(CPU in key.split("|") for _, key in entries)
    assert {ns for ns, _ in entries} == {"AB_gather_scatter", "ABt_gather_scatter", "AtB_gather_gather"}

    # A fresh user cache over the exported file: the same run now times nothing.
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(tmp_path / "another-user"))
    sparseconv.tune.reset()
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("tuned 0 keys")
    assert sparseconv.tune.get_tuner().cache.items() == []


def test_export_without_tunings_says_so(tmp_path, capsys):
    assert main(["tune", "export", str(tmp_path), "--device", "cpu"]) == 1
    assert "no tunings of cpu" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_populate_rejects_bad_arguments():
    from sparseconv.cli.populate import populate

    with pytest.raises(ValueError, match="scenes must be a non-empty list"):
        populate(scenes="street1")
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        populate(steps=0)
    with pytest.raises(ValueError, match="device must be a torch device"):
        populate(device="gpu-please")


def test_populate_passes_again_until_no_product_waits_for_a_background_compile(monkeypatch):
    """On a GPU a product whose kernels compile in the background runs the reference and is timed
    at a later call: populate waits for the compiles and passes again, until none waits (bounded)."""
    import sparseconv.tune
    from sparseconv.cli import populate as populate_module

    waiting = [3, 1, 0]
    events = []
    monkeypatch.setattr(sparseconv.tune.get_tuner(), "compiling", lambda: waiting.pop(0))
    monkeypatch.setattr(sparseconv.tune, "wait_for_compiles", lambda: events.append("wait"))
    monkeypatch.setattr(populate_module, "_pass", lambda net, coords, dtype: events.append("pass"))
    populate_module._settle(None, None, torch.float16, torch.device("cpu"))
    assert events == ["wait", "pass", "wait", "pass"] and not waiting
    waiting[:] = [5] * 10
    events.clear()
    populate_module._settle(None, None, torch.float16, torch.device("cpu"))
    assert events.count("pass") == populate_module.SETTLE_PASSES
