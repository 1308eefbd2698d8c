"""The layers' import rules (sglang_diffkv/__init__.py): only sglang_diffkv/sglang/ imports
sglang; the simulator and the bench harness never import each other, either way (what both
read, the trace schema and loaders, the SGLang log parser and the probe records, lives in
sglang_diffkv/serving_io/, which imports neither); the bench never imports the SGLang layer
(which imports the bench's trace and profile formats); and no layer imports one above it."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sglang_diffkv"

# what each layer must not import (module prefixes, matched on whole dotted names)
FORBIDDEN = {
    "core": ("sglang_diffkv.bench", "sglang_diffkv.eval", "sglang_diffkv.sglang", "simulator"),
    "memory": ("sglang_diffkv.kernels", "sglang_diffkv.bench", "sglang_diffkv.eval",
               "sglang_diffkv.sglang", "simulator"),
    "kernels": ("sglang_diffkv.bench", "sglang_diffkv.eval", "sglang_diffkv.sglang",
                "simulator"),
    "eval": ("sglang_diffkv.bench", "sglang_diffkv.sglang", "simulator"),
    # shared by the bench and the simulator: imports the core root only
    "serving_io": ("sglang_diffkv.memory", "sglang_diffkv.kernels", "sglang_diffkv.bench",
                   "sglang_diffkv.eval", "sglang_diffkv.sglang", "simulator"),
    "bench": ("sglang_diffkv.eval", "sglang_diffkv.sglang", "simulator"),
    "simulator": ("sglang_diffkv.bench", "sglang_diffkv.eval", "sglang_diffkv.sglang"),
}


def imports(source: str) -> set[str]:
    """Every module ``source`` imports: import statements at any depth and
    ``importlib.import_module`` / ``__import__`` of a constant name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            found.add(node.args[0].value)
    return found


def matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(path: Path) -> str | None:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "simulator":
        return "simulator"
    if len(rel) == 2:
        return "core"
    return rel[1] if rel[1] in FORBIDDEN else None


def sources() -> list[Path]:
    return sorted(p for top in (PKG, ROOT / "simulator") for p in top.rglob("*.py"))


def test_the_scanner_sees_every_way_of_importing():
    src = ("import sglang.srt.server_args\n"
           "def f():\n    from sglang import launch_server\n"
           "    importlib.import_module('sglang.srt.utils')\n"
           "from sglang_diffkv import bench\n")
    found = imports(src)
    assert {"sglang.srt.server_args", "sglang", "sglang.srt.utils",
            "sglang_diffkv.bench"} <= found
    assert any(matches(m, "sglang_diffkv.bench") for m in found)
    assert not matches("sglang_diffkv", "sglang")


def test_only_the_sglang_layer_imports_sglang():
    layer = PKG / "sglang"
    offenders = []
    for p in sources():
        if p.is_relative_to(layer):
            continue
        rel = p.relative_to(ROOT).as_posix()
        bad = sorted(m for m in imports(p.read_text()) if matches(m, "sglang"))
        if bad:
            offenders.append(f"{rel}: {', '.join(bad)}")
    assert not offenders, "sglang imported outside sglang_diffkv/sglang/:\n" + "\n".join(offenders)


def test_no_layer_imports_one_it_must_not():
    offenders = []
    for p in sources():
        layer = layer_of(p)
        if layer is None:
            continue
        for m in sorted(imports(p.read_text())):
            bad = [f for f in FORBIDDEN[layer] if matches(m, f)]
            if bad:
                offenders.append(f"{p.relative_to(ROOT)} ({layer}): {m}")
    assert not offenders, "layer rule broken:\n" + "\n".join(offenders)


def test_the_bench_never_imports_the_sglang_layer():
    """The tracing's formats live below the SGLang layer (one source of truth: the loop trace
    in the bench, the step profile's log lines in serving_io, which the simulator reads too),
    and their writers in the SGLang layer import them from there: never the other way round."""
    assert "sglang_diffkv.sglang" in FORBIDDEN["bench"]
    writers = {"loop_trace": "sglang_diffkv.bench.loop_records",
               "step_profile": "sglang_diffkv.serving_io.profile_lines"}
    for name, fmt in writers.items():
        found = imports((PKG / "sglang" / f"{name}.py").read_text())
        assert any(matches(m, fmt) for m in found), f"sglang/{name}.py should import {fmt}"
        assert not (PKG / f"{name}.py").exists(), f"{name}.py is back at the package root"
    offenders = sorted(
        f"{p.relative_to(ROOT)}: {m}" for p in sources() if layer_of(p) == "bench"
        for m in imports(p.read_text()) if matches(m, "sglang_diffkv.sglang"))
    assert not offenders, "the bench imports the SGLang layer:\n" + "\n".join(offenders)


def _offenders(layer: str, prefix: str) -> list[str]:
    return sorted(f"{p.relative_to(ROOT)}: {m}" for p in sources() if layer_of(p) == layer
                  for m in imports(p.read_text()) if matches(m, prefix))


def test_the_simulator_and_the_bench_never_import_each_other():
    """Neither way, at any depth (a function's own import counts): what both need is in
    sglang_diffkv/serving_io/, and the bench asks the simulator for predictions only through
    ``diffkv-sim`` (e.g. ``diffkv-sim prefill-probes``), never by importing it."""
    assert "simulator" in FORBIDDEN["bench"]
    assert "sglang_diffkv.bench" in FORBIDDEN["simulator"]
    bad = _offenders("bench", "simulator") + _offenders("simulator", "sglang_diffkv.bench")
    assert not bad, "the simulator and the bench import each other:\n" + "\n".join(bad)
    # the shared package is what both read: each really imports it
    for layer in ("bench", "simulator"):
        assert _offenders(layer, "sglang_diffkv.serving_io"), layer
    shared = sorted(p.relative_to(ROOT).as_posix() for p in sources()
                    if layer_of(p) == "serving_io")
    assert "sglang_diffkv/serving_io/trace.py" in shared
    assert "sglang_diffkv/serving_io/sglang_log.py" in shared


def test_the_scanner_sees_the_bench_reaching_into_the_simulator():
    src = ("def predict():\n    from simulator.studies.scenario import Scenario\n"
           "    importlib.import_module('simulator.validation.harness')\n")
    found = imports(src)
    assert {"simulator.studies.scenario", "simulator.validation.harness"} <= found
    assert all(any(matches(m, f) for f in FORBIDDEN["bench"]) for m in found)


def test_every_package_ships():
    """Every folder with an __init__.py under the packaged trees (serving_io among them) is
    matched by pyproject's package patterns, so an install carries what both sides import."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(".".join(p.parent.relative_to(ROOT).parts)
                      for top in ("sglang_diffkv", "simulator", "traces")
                      for p in (ROOT / top).rglob("__init__.py"))
    assert "sglang_diffkv.serving_io" in packages
    unshipped = [p for p in packages if not any(fnmatch.fnmatch(p, pat) for pat in include)]
    assert not unshipped, f"not matched by {include}: {unshipped}"
