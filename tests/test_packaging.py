"""The wheel carries what the package needs at run time: every subpackage, the CUDA C++ of csrc/
and the shipped tuning files of sparseconv/tune/data/.

csrc/ lives at the repository's top level and is mapped into the wheel as sparseconv/_csrc/;
these tests check the mapping from a real (non-editable) install, run from outside the
repository, so a source found only in the checkout cannot pass for one found in the package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import msgpack
from conftest import ROOT

# What the install needs from the checkout: tests, scripts and docs are not part of the wheel.
SOURCES = ("pyproject.toml", "README.md", "sparseconv", "csrc")

CHECK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import sparseconv
    from sparseconv.backends import cuda_jit
    from sparseconv.tune import shipped

    folder = cuda_jit.csrc_dir()
    print(json.dumps({
        "package": str(Path(sparseconv.__file__).resolve().parent),
        "csrc": str(folder),
        "files": sorted(p.name for p in folder.iterdir()),
        "shipped": str(shipped.data_dir()),
        "shipped_files": sorted(p.name for p in shipped.data_dir().iterdir()),
        "shipped_entry": shipped.lookup("AB_gather_scatter", "v1|planted|cpu Planted CPU 1t"),
    }))
    """
)


def _subpackages() -> set[str]:
    return {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "sparseconv").rglob("__init__.py")
        if "__pycache__" not in path.parts
    }


def test_pyproject_lists_every_subpackage():
    # The package list is explicit (a find directive cannot map csrc/ in), so a new subpackage
    # must be added by hand; forgetting it would ship a wheel that fails on import.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _subpackages() <= listed, f"add to [tool.setuptools] packages: {sorted(_subpackages() - listed)}"
    assert listed - _subpackages() == {"sparseconv._csrc"}


def test_installed_wheel_finds_csrc_and_the_shipped_tunings_inside_the_package(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:  # a copy, so the build's build/ and *.egg-info stay out of the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    # A tuning file of a made-up device, planted in the copy: the wheel must carry *.msgpack.
    entry = {"winner": "explicit_gemm", "timings": {}, "evidence": 1, "updated": 1.0}
    planted = {"schema": 1, "entries": {"AB_gather_scatter": {"v1|planted|cpu Planted CPU 1t": entry}}}
    (source / "sparseconv" / "tune" / "data" / "cpu_Planted_CPU_1t.msgpack").write_bytes(msgpack.packb(planted))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # pip and setuptools of this interpreter build and install (--target: nothing of this
    # environment is looked at or uninstalled; no network, no isolated build environment).
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(source)], check=True, cwd=tmp_path)
    shutil.rmtree(source)  # whatever the installed package finds, it cannot be the copy it was built from
    # torch, warp & co. come from this interpreter's environment, after the fresh venv's own
    # site-packages (a path line in a .pth is appended, its own .pth files are not run).
    own = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "test_parent_environment.pth").write_text("".join(f"{p}\n" for p in own))

    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    environment["SPARSECONV_SHIPPED_TUNINGS"] = "1"  # the test fixture turns them off
    result = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, cwd=tmp_path,
                            env=environment, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    package, csrc = Path(found["package"]), Path(found["csrc"])
    assert package == (site / "sparseconv").resolve()
    assert csrc == package / "_csrc"
    assert {"rows_sm90.cu", "sparse_gemm.cu", "README.md"} <= set(found["files"])
    assert ROOT not in csrc.parents
    assert Path(found["shipped"]) == package / "tune" / "data"
    in_checkout = {p.name for p in (ROOT / "sparseconv" / "tune" / "data").iterdir()}
    assert in_checkout | {"cpu_Planted_CPU_1t.msgpack"} <= set(found["shipped_files"])
    assert found["shipped_entry"] == entry


def test_checkout_finds_top_level_csrc():
    from sparseconv.backends import cuda_jit

    assert cuda_jit.csrc_dir() == ROOT / "csrc"
