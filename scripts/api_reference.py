"""Write docs/api.md from the docstrings and signatures of the public API.

Run ``python scripts/api_reference.py`` after changing a public signature or docstring;
``tests/test_docs.py`` fails while docs/api.md is stale. ``--check`` exits 1 instead of writing.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

import torch

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"

# (module, names, one line on what it is); the order is the reading order of the page.
SECTIONS = [
    ("sparseconv", ["SparseTensor", "sparse_conv3d", "graphed", "set_deterministic", "is_deterministic"],
     "The tensor, the convolution operator, graph mode and deterministic mode."),
    (
        "sparseconv.nn",
        [
            "SparseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d", "SparseAvgPool3d", "GlobalAvgPool",
            "GlobalMaxPool", "BatchNorm", "SyncBatchNorm", "GroupNorm", "InstanceNorm", "LayerNorm", "Features",
            "Linear", "Dropout", "ReLU", "LeakyReLU", "ELU", "GELU", "SiLU", "Sigmoid", "Tanh", "Sequential",
            "ToDense", "cat",
        ],
        "Layers: every module takes and returns a SparseTensor unless it says otherwise.",
    ),
    ("sparseconv.nn.functional", None, "Functional forms of pooling, normalisation and concatenation."),
    ("sparseconv.models", None, "Networks built from the layers."),
    ("sparseconv.data", None, "Synthetic labelled scenes and voxelisation."),
    ("sparseconv.metrics", ["confusion_matrix", "iou_per_class"], "Segmentation metrics."),
    ("sparseconv.viz", ["save_bev_comparison"], "Pictures (needs matplotlib)."),
    ("sparseconv.cli.demo", ["run_demo", "format_report"], "The demo behind `python -m sparseconv demo`."),
]


def render() -> str:
    """The whole page as markdown."""
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python scripts/api_reference.py`; concepts and conventions",
        "are in `concepts.md`. Modules subclassing a torch module take that module's arguments.",
        "",
    ]
    for module_name, names, summary in SECTIONS:
        module = importlib.import_module(module_name)
        names = names if names is not None else [n for n in module.__all__ if n != "functional"]
        lines += [f"## `{module_name}`", "", summary, ""]
        for name in names:
            lines += _entry(module_name, name, getattr(module, name))
    return "\n".join(lines).rstrip() + "\n"


def _entry(module_name: str, name: str, obj: object) -> list[str]:
    if isinstance(obj, tuple | dict):
        return [f"### `{module_name}.{name}`", "", f"`{obj!r}`", ""]
    if inspect.isclass(obj):
        return _class_entry(module_name, name, obj)
    return [f"### `{module_name}.{name}`", "", "```python", f"{name}{_signature(obj)}", "```", "", _doc(obj), ""]


def _class_entry(module_name: str, name: str, cls: type) -> list[str]:
    torch_base = next((b for b in cls.__mro__[1:] if b.__module__.startswith("torch.")), None)
    if cls.__init__ is torch.nn.Module.__init__:
        header = f"class {name}()"
    elif torch_base is not None and cls.__init__ is torch_base.__init__:
        header = f"class {name}  # arguments of {_torch_name(torch_base)}"
    else:
        header = f"class {name}{_signature(cls)}"
    lines = [f"### `{module_name}.{name}`", "", "```python", header, "```", "", _doc(cls), ""]
    for member_name, member in sorted(vars(cls).items()):
        if member_name.startswith("_") or member_name == "forward":
            continue
        if isinstance(member, property | classmethod | staticmethod) or inspect.isfunction(member):
            function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if function is None or not (function.__doc__ or "").strip():
                continue
            kind = "property" if isinstance(member, property) else "method"
            signature = "" if kind == "property" else _signature(function)
            lines += [f"- `{member_name}{signature}` ({kind}): {_doc(function, first_paragraph=True)}"]
    if lines[-1] != "":
        lines.append("")
    return lines


def _signature(obj: object) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    if inspect.isclass(obj):
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    text = str(signature)
    # Annotations are strings (postponed evaluation) and print quoted; defaults that are
    # objects print with their address, which changes every run.
    text = re.sub(r"(: |-> )'([^']*)'", r"\1\2", text)
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    text = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", text)
    return re.sub(r"^\((self|cls)(, |\))", lambda m: "(" if m.group(2) == ", " else "()", text)


def _doc(obj: object, first_paragraph: bool = False) -> str:
    doc = inspect.getdoc(obj) or "(no docstring)"
    if first_paragraph:
        doc = " ".join(doc.split("\n\n")[0].split())
    return doc


def _torch_name(cls: type) -> str:
    return f"torch.nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else f"{cls.__module__}.{cls.__name__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUTPUT.exists() or OUTPUT.read_text() != text
        if stale:
            print(f"{OUTPUT} is stale: run python scripts/api_reference.py", file=sys.stderr)
        return int(stale)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
