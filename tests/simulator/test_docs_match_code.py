"""docs/simulator.md matches the code: every `diffkv-sim ...` command it quotes names a
subcommand that exists and only options that subcommand takes; every subcommand and every
shipped calibration file is documented, and every calibration file or script it names
exists (a removed script is named with the commit to get it back from)."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from simulator import cli

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "simulator.md").read_text()


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def parsers() -> dict[str, set[str]]:
    """Each subcommand's options (TOOLS: their modules' own parsers)."""
    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: _options(p) for name, p in sub.choices.items() if name not in cli.TOOLS}
    for name, (module, _) in cli.TOOLS.items():
        out[name] = _options(importlib.import_module(module).build_parser())
    out[""] = _options(top) | out["compare"]     # no subcommand: compare
    return out


def quoted_commands() -> list[str]:
    return [" ".join(m.split()) for m in re.findall(r"`(diffkv-sim [^`]+)`", DOC)]


def test_every_quoted_command_exists_with_the_options_it_takes():
    known = parsers()
    bad = []
    for cmd in quoted_commands():
        words = cmd.split()[1:]
        name = "" if not words or words[0].startswith("-") else words[0]
        if name in ("COMMAND", "NAME"):
            continue
        if name not in known:
            bad.append(f"{cmd}: no subcommand {name!r}")
            continue
        for w in words:
            opt = w.split("=", 1)[0].rstrip(",.;:)")
            if opt.startswith("--") and opt not in known[name] | {"--help"}:
                bad.append(f"{cmd}: {name or 'compare'} has no {opt}")
    assert not bad, "\n".join(bad)


def test_every_subcommand_is_documented():
    missing = [n for n in parsers() if n and f"diffkv-sim {n}" not in DOC]
    assert not missing, missing


def test_every_shipped_calibration_file_is_named_and_every_named_one_exists():
    shipped = sorted(p.name for p in (ROOT / "simulator" / "calibration").glob("*.json"))
    named = set(re.findall(r"simulator/calibration/([\w.-]+\.json)", DOC))
    assert not named - set(shipped), named - set(shipped)
    # the measured sets by their pattern (GPU-{triton,diffkv}.json) or by name
    for name in shipped:
        gpu = name.rsplit("-", 1)[0]
        assert name in named or f"{gpu}-{{triton,diffkv}}.json" in DOC \
            or "<gpu>-triton.json" in DOC, name


def test_every_script_named_exists_or_names_its_commit():
    missing = []
    for m in re.finditer(r"scripts/(\w+)\.py", DOC):
        if (ROOT / "scripts" / f"{m.group(1)}.py").exists():
            continue
        around = DOC[max(0, m.start() - 300): m.end() + 300]
        if "8dc2c27" not in around:
            missing.append(m.group(0))
    assert not missing, sorted(set(missing))


@pytest.mark.parametrize("old", ["--eager-prefill-launch-ms", "--first-token-latency-ms",
                                 "--launch-holds-loop", "--diffkv-prefill-step-ms"])
def test_renamed_options_appear_only_where_the_doc_says_they_were_renamed(old):
    vs = importlib.import_module("simulator.validation.runs")
    assert old in vs.RENAMED_OPTIONS
    for m in re.finditer(re.escape(old) + r"\b", DOC):
        line = DOC[DOC.rfind("\n", 0, m.start()) + 1: DOC.find("\n", m.end())]
        assert "renamed" in line or "was" in line or "|" in line, line
