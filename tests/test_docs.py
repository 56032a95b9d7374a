"""The documentation stays true: the API reference is current, the examples run, the names the
migration guide and concepts page use exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, load_script

import sparseconv
import sparseconv.models
import sparseconv.nn


def test_api_reference_is_current():
    expected = load_script("api_reference").render()
    assert (ROOT / "docs" / "api.md").read_text() == expected, (
        "docs/api.md is stale: run python scripts/api_reference.py"
    )


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_python_examples_run(page, monkeypatch):
    # Timing sweeps of the tuner are not what these examples show; its heuristic pick runs them.
    monkeypatch.setenv("SPARSECONV_AUTOTUNE_EFFORT", "none")
    blocks = _python_blocks(ROOT / page)
    assert blocks, f"{page} has no python example"
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page} example {i + 1}", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("page", ["docs/migration.md", "docs/concepts.md", "docs/quickstart.md"])
def test_names_the_docs_use_exist(page):
    text = (ROOT / page).read_text()
    names = {
        (sparseconv.nn, name) for name in re.findall(r"\bsnn\.(\w+)", text)
    } | {
        (sparseconv.models, name) for name in re.findall(r"sparseconv\.models\.(\w+)", text)
    } | {
        (sparseconv.nn.functional, name) for name in re.findall(r"\bF\.(\w+)\(", text)
    }
    missing = sorted(f"{module.__name__}.{name}" for module, name in names if not hasattr(module, name))
    assert not missing, f"{page} names what does not exist: {missing}"
