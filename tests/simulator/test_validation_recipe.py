"""Validation recipes (simulator/validation/recipe.py): a JSON file stands for the long
`diffkv-sim validate-runs` command line, key = option, and the shipped ones name folders that
exist; the CLI hands validate-runs and ablate-host-terms their arguments."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from simulator.cli import main as cli_main
from simulator.errors import SimulatorInputError
from simulator.validation.recipe import (
    expand_recipe,
    load_recipe,
    recipe_argv,
    shipped_recipes,
)
from simulator.validation.runs import results_arg

ROOT = Path(__file__).resolve().parents[2]


def test_keys_become_options_lists_repeat_objects_give_key_value_items():
    argv = recipe_argv({
        "results": ["a#x", "b"], "gpu": "h200", "fit_run": ["bf16/sharegpt#x", "fp8/longgen"],
        "eager_prefill_launch_s": {"triton": 0.0186, "fp8": 0.0211}, "a_list": {"k": [1.5, 2]},
        "shipped": True, "jobs": 2,
        "isolated_prefill_scale": 0.92, "eager_launch_holds_loop": [], "plots": False})
    assert argv == ["a#x", "b", "--gpu", "h200", "--fit-run", "bf16/sharegpt#x",
                    "--fit-run", "fp8/longgen", "--eager-prefill-launch-s", "triton=0.0186",
                    "--eager-prefill-launch-s", "fp8=0.0211", "--a-list", "k=1.5,2",
                    "--shipped", "--jobs", "2", "--isolated-prefill-scale", "0.92"]


def test_options_after_the_recipe_add_to_it_and_bad_recipes_are_named(tmp_path):
    f = tmp_path / "r.json"
    f.write_text('{"_about": "a note", "results": ["d1"], "gpu": "h200", "fit_run": ["bf16/a"]}')
    argv = expand_recipe(["--jobs", "2", "--recipe", str(f), "--fit-run", "bf16/b", "d2"])
    # the recipe first: a later scalar replaces it, a later list item joins it
    assert argv == ["d1", "--gpu", "h200", "--fit-run", "bf16/a", "--jobs", "2",
                    "--fit-run", "bf16/b", "d2"]
    with pytest.raises(SimulatorInputError, match="one --recipe"):
        expand_recipe(["--recipe", str(f), f"--recipe={f}"])
    with pytest.raises(SimulatorInputError, match="shipped: h100, h200"):
        expand_recipe(["--recipe", "h300"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"results": ["d"], "gpu": {"a": {"b": 1}}}')
    with pytest.raises(SimulatorInputError, match="gpu"):
        recipe_argv(load_recipe(str(bad)))
    bad.write_text('{"gpu": "h200"}')
    with pytest.raises(SimulatorInputError, match="needs results"):
        load_recipe(str(bad))
    bad.write_text('{"results": [')
    with pytest.raises(SimulatorInputError, match="not valid JSON"):
        load_recipe(str(bad))


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_shipped_recipes_name_folders_in_the_repository_and_parse(name):
    from simulator.validation.runs import build_parser

    assert name in shipped_recipes()
    argv = expand_recipe(["--recipe", name])
    a = build_parser().parse_intermixed_args(argv)
    assert a.gpu == name and a.fit_run and a.doc.startswith("docs/simulator-validation")
    for arg in a.results:
        folder = ROOT / results_arg(arg)[0]
        assert (folder / "results.json").exists(), folder


def test_without_a_recipe_the_report_goes_to_results_not_over_a_shipped_one():
    from simulator.validation.runs import build_parser, plot_dir_of

    a = build_parser().parse_intermixed_args(["some/run/folder"])
    doc = Path(a.doc)
    assert doc.parent == ROOT / "results" and doc.name == "simulator-validation.md"
    assert plot_dir_of(a) == ROOT / "results" / "simulator-validation"


def test_the_h200_recipe_is_the_reports_old_command():
    # the 4,979-character command the H200 report printed before the recipe (kept in the
    # test, not the docs): the recipe must mean the same options, order aside, less the
    # probe hosts' launches (--host-launches-ms) and the front-end GC pauses (--frontend-gc),
    # both removed (docs/simulator.md, "Host-side terms, measured")
    old = shlex.split((Path(__file__).parent / "h200_validation_command.txt").read_text())
    at = [i for i, x in enumerate(old) if x in ("--host-launches-ms", "--frontend-gc")]
    assert len(at) == 4
    old = [x for i, x in enumerate(old) if not any(i in (j, j + 1) for j in at)]
    # and with the options since named by their calibration field, in its unit (seconds)
    renamed = {"--eager-prefill-launch-ms": ("--eager-prefill-launch-s", 1e-3),
               "--eager-prefill-turnaround-ms": ("--eager-prefill-turnaround-s", 1e-3),
               "--first-token-latency-ms": ("--first-token-latency-s", 1e-3),
               "--eager-decode-host-ms": ("--eager-decode-host-s", 1e-3),
               "--eager-decode-host-per-req-us": ("--eager-decode-host-per-req-s", 1e-6),
               "--launch-holds-loop": ("--eager-launch-holds-loop", None)}
    for i, x in enumerate(old[:-1]):
        if x in renamed:
            new, scale = renamed[x]
            key, _, v = old[i + 1].partition("=")
            old[i:i + 2] = [new, old[i + 1] if scale is None else f"{key}={float(v) * scale:.10g}"]
    from simulator.validation.runs import build_parser

    p = build_parser()
    a, b = (vars(p.parse_intermixed_args(x)) for x in (old, expand_recipe(["--recipe", "h200"])))
    a.pop("scratch"), b.pop("scratch")
    # the held-out runs came after that command: they fit and predict nothing, they only
    # refuse a fitting run that is held out and report the held-out rows apart
    assert a.pop("held_out") == [] and b.pop("held_out")
    assert a == b
    assert not any(x in renamed for x in expand_recipe(["--recipe", "h200"]))


def test_the_cli_hands_the_tools_their_arguments(capsys):
    assert cli_main(["validate-runs", "--recipe", "nope.json"]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err
    assert cli_main(["ablate-host-terms", "--recipe", "h300"]) == 2
    assert "shipped: h100, h200" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_the_shipped_calibration_is_the_reports_fit(name):
    """What `diffkv-sim --gpu GPU` loads is what the GPU's report validated: where the
    report's fitted files are committed beside it, the shipped files hold the same fit."""
    import json

    doc = ROOT / load_recipe(name)["doc"]
    for backend in ("triton", "diffkv"):
        fitted = doc.with_suffix("") / f"calibration-fitted-{backend}.json"
        if not fitted.exists():
            continue
        shipped = json.loads((ROOT / "simulator" / "calibration" /
                              f"{name}-{backend}.json").read_text())
        assert shipped["gpus"] == json.loads(fitted.read_text())["gpus"], (name, backend)
        assert doc.name in shipped["validated_by"]
