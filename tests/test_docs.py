"""The documentation stays true: the API reference is current, the examples run, the names the
migration guide and concepts page use exist, the install lines and the test command CI runs agree."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
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


CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INSTALL_PAGES = ["README.md", "docs/quickstart.md"]


def _bash_lines(page: str) -> list[str]:
    """The commands of a page's bash blocks (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.DOTALL)
    lines = (line.split(" #", 1)[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _pip_installs(command: str) -> list[list[str]]:
    """The arguments of each ``pip install`` in a shell line (``python -m pip`` too), one list per install."""
    installs = []
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["python", "-m"]:
            words = words[2:]
        if words[:2] == ["pip", "install"]:
            installs.append(words[2:])
    return installs


def _ci_test_command() -> str:
    """The README's test command as .ci/run extracts it (its own awk program, run on README.md)."""
    program = re.search(r"cmd=\$\(awk '(.*?)' README\.md\)", (ROOT / ".ci" / "run").read_text()).group(1)
    found = subprocess.run(["awk", program, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return found.stdout.strip()


@pytest.mark.parametrize("page", INSTALL_PAGES)
def test_the_cpu_install_line_takes_torch_from_the_cpu_index_then_installs_the_package(page):
    [line] = [line for line in _bash_lines(page) if CPU_INDEX in line]
    torch_install, package_install = _pip_installs(line)
    # --index-url, not --extra-index-url: with PyPI still in view its CUDA build of a newer torch would win.
    assert torch_install == ["torch", "--index-url", CPU_INDEX], line
    assert package_install[0] == "-e" and package_install[1].startswith(".[") and "torch" not in package_install


def test_readme_and_quickstart_give_the_same_install_lines():
    installs = {page: [line for line in _bash_lines(page) if line.startswith("pip install")] for page in INSTALL_PAGES}
    assert installs["README.md"] == installs["docs/quickstart.md"] and len(installs["README.md"]) == 2
    gpu = installs["README.md"][1]
    assert CPU_INDEX not in gpu and {"cuda13", "cutlass", "plot"} <= set(re.search(r"\.\[(.*?)\]", gpu)[1].split(","))


@pytest.mark.parametrize("page", [*INSTALL_PAGES, "csrc/README.md"])
def test_the_extras_the_docs_name_are_the_packages(page):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {name for group in re.findall(r"\.\[([\w,-]+)\]", (ROOT / page).read_text()) for name in group.split(",")}
    named |= set(re.findall(r"sparseconv\[([\w-]+)\]", (ROOT / page).read_text()))
    assert named and named <= extras, f"{page} names extras pyproject.toml lacks: {sorted(named - extras)}"


def test_the_test_command_ci_runs_keeps_the_torch_an_install_line_put():
    command = _ci_test_command()
    assert command.endswith("python -m pytest -q"), command
    for arguments in _pip_installs(command):
        # A torch requirement here would replace the CPU or CUDA build just installed (a pin: a silent downgrade).
        assert not [a for a in arguments if re.match(r"torch\b", a)], command
        assert not {"-U", "--upgrade", "--force-reinstall", "-i", "--index-url"} & set(arguments), command
    assert command in (ROOT / "docs" / "quickstart.md").read_text()


def test_readme_and_quickstart_give_the_same_times_for_the_demo_and_the_tests():
    # The figures a user checks: the demo prints its own wall time last; CI's log has the tests'.
    said = {}
    for page in INSTALL_PAGES:
        text = " ".join((ROOT / page).read_text().split())
        said[page] = {
            "demo": re.findall(r"its own wall time: about ([\d.-]+ (?:minutes?|seconds) on a 2-core CPU)", text),
            "tests": re.findall(r"about ([\d.-]+ minutes on a 2-core CPU)[^.]*?(?:with this install|torch installed)", text),
        }
    assert said["README.md"] == said["docs/quickstart.md"], said
    assert all(len(times) == 1 for times in said["README.md"].values()), said
