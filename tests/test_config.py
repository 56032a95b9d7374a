"""config.product_settings: the tuner's per-call settings, parsed once per distinct environment but
never stale (a variable set between two calls takes effect at the second)."""

import os

import pytest
import torch

import sparseconv
from sparseconv import config


def test_a_variable_set_between_calls_takes_effect_at_the_next(monkeypatch):
    assert config.product_settings("AB_gather_scatter") == (None, False, "quick")
    monkeypatch.setenv("SPARSECONV_FWD_ALGO_MODE", " explicit_gemm ")
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "Full")
    assert config.product_settings("AB_gather_scatter") == ("explicit_gemm", False, "full")
    assert config.product_settings("AtB_gather_gather") == (None, False, "full")  # another namespace's variable
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "1")
    assert config.product_settings("AB_gather_scatter")[1] is True
    monkeypatch.setenv("SPARSECONV_DETERMINISTIC", "0")
    previous = sparseconv.set_deterministic(True)  # the switch beats the variable
    try:
        assert config.product_settings("AB_gather_scatter")[1] is True
    finally:
        sparseconv.set_deterministic(previous)
    assert config.product_settings("AB_gather_scatter")[1] is False


def test_torch_deterministic_switch_is_followed_when_nothing_else_says(monkeypatch):
    monkeypatch.delenv("SPARSECONV_DETERMINISTIC", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert config.product_settings("ABt_gather_scatter")[1] is True
    finally:
        torch.use_deterministic_algorithms(before)
    assert config.product_settings("ABt_gather_scatter")[1] is before


@pytest.mark.parametrize(("variable", "value"), [("SPARSECONV_AUTOTUNE_EFFORT", "fast"),
                                                 ("SPARSECONV_DETERMINISTIC", "maybe")])
def test_a_bad_value_is_an_error_naming_the_variable_every_time(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    for _ in range(2):  # not remembered as a good value after the first error
        with pytest.raises(ValueError, match=variable):
            config.product_settings("AB_gather_scatter")


def test_product_settings_read_variables_set_changed_and_unset_after_import(monkeypatch):
    # The tuner's per-call read tells an unset variable from the environment's own mapping: set,
    # changed, emptied and removed again at run time, each is read as os.environ has it.
    name = "SPARSECONV_WGRAD_ALGO_MODE"
    monkeypatch.delenv(name, raising=False)
    assert config._getenv(name) == "" and config.product_settings("AtB_gather_gather")[0] is None
    monkeypatch.setenv(name, "explicit_gemm")
    assert config._getenv(name) == "explicit_gemm"
    assert config.product_settings("AtB_gather_gather")[0] == "explicit_gemm"
    monkeypatch.setenv(name, "[explicit_gemm,splitk_wgrad]")
    assert config.product_settings("AtB_gather_gather")[0] == os.environ[name] == config._getenv(name)
    monkeypatch.setenv(name, "")
    assert config._getenv(name) == "" and config.product_settings("AtB_gather_gather")[0] is None
    monkeypatch.delenv(name)
    assert config._getenv(name) == "" and config.product_settings("AtB_gather_gather")[0] is None
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "full")
    assert config.product_settings("AtB_gather_gather")[2] == "full"


def test_a_misspelt_variable_is_warned_about_once_with_the_closest_name(monkeypatch):
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFROT", "full")
    monkeypatch.setattr(config, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"SPARSECONV_AUTOTUNE_EFFROT is not a sparseconv setting and is ignored; "
                                         r"did you mean SPARSECONV_AUTOTUNE_EFFORT\?"):
        config.check_environment()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.check_environment()  # once a process


@pytest.mark.parametrize(("variable", "value"), [("SPARSECONV_PLAN_MAPS", "maybe"), ("SPARSECONV_AUTOTUNE_LOG", "2")])
def test_check_environment_raises_for_any_bad_switch(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        config.check_environment()
    monkeypatch.setenv(variable, "off")
    config.check_environment()


@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5"])
def test_a_bad_compile_worker_count_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SPARSECONV_COMPILE_WORKERS", value)
    with pytest.raises(ValueError, match="SPARSECONV_COMPILE_WORKERS must be a positive integer"):
        config.check_environment()


def test_the_compile_worker_count_is_the_variables_else_bounded_by_the_cores(monkeypatch):
    from sparseconv.backends import compiling

    monkeypatch.setenv("SPARSECONV_COMPILE_WORKERS", "7")
    assert compiling.Background()._workers == 7
    monkeypatch.delenv("SPARSECONV_COMPILE_WORKERS")
    monkeypatch.setattr(compiling.os, "cpu_count", lambda: 2)
    assert compiling.Background()._workers == 1
    monkeypatch.setattr(compiling.os, "cpu_count", lambda: 64)
    assert compiling.Background()._workers == compiling.MAX_WORKERS
