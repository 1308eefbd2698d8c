"""A validation recipe: the result folders, fitting runs and options of one validation report,
in a JSON file, in place of a command line thousands of characters long.

Every key is the name of an option of ``diffkv-sim validate-runs`` with ``_`` for ``-`` (one
name per knob: ``fit_run`` is ``--fit-run``; a measured calibration input's key is also its
calibration field, in the field's unit), so the option parser stays the one place that checks
the values, and a recipe and a command line can never mean different things:

    "results": ["docs/data/.../e2e-s19-bf16-cold#c", ...]    the positional RESULTS_DIRs
    "gpu": "h200"                                             --gpu h200
    "fit_run": ["bf16/sharegpt#t", ...]                       --fit-run, repeated
    "eager_prefill_launch_s": {"triton": 0.0186}              --eager-prefill-launch-s K=V
    "refine_hold": ["diffkv:seq_overhead_s"]                  --refine-hold diffkv:seq_overhead_s
    "shipped": true                                           --shipped
    "_about": "..."                                           a key starting with _: a note

Relative paths are the repository's (the result folders live in its docs/data/, not in the
package): run from the repository root. The recipes of the shipped calibrations ship in
``simulator/validation/recipes/`` (``shipped_recipe``).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from simulator.errors import SimulatorInputError

RESULTS_KEY = "results"  # the positional result folders


def shipped_recipes() -> list[str]:
    """The names of the recipes shipped in the package (``h200``: h200.json)."""
    folder = resources.files("simulator.validation") / "recipes"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir()
                  if p.name.endswith(".json"))


def recipe_path(name_or_path: str) -> Path:
    """A recipe file: a path, or the name of a shipped recipe (``h200``)."""
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        if not p.is_file():
            raise SimulatorInputError(f"--recipe {name_or_path}: no such file")
        return p
    names = shipped_recipes()
    if name_or_path not in names:
        raise SimulatorInputError(f"--recipe {name_or_path!r}: not a file and not a shipped "
                                  f"recipe; shipped: {', '.join(names)}")
    return Path(str(resources.files("simulator.validation") / "recipes"
                    / f"{name_or_path}.json"))


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """The recipe's keys and values, read from its JSON file, notes (``_`` keys) left out."""
    p = recipe_path(name_or_path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SimulatorInputError(f"recipe {p}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SimulatorInputError(f"recipe {p}: want a JSON object of option: value")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    if not isinstance(data.get(RESULTS_KEY), list) or not data[RESULTS_KEY]:
        raise SimulatorInputError(f"recipe {p}: needs {RESULTS_KEY} = [\"DIR[#TAG]\", ...], "
                                  "the result folders to validate on")
    return data


def _value(key: str, v: Any, where: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise SimulatorInputError(f"{where}: {key} = {v!r}: want a string or a number here")
    return str(v)


def recipe_argv(data: dict[str, Any], where: str = "recipe") -> list[str]:
    """The command line a recipe stands for: the result folders, then one option per key
    (a list repeats the option, an object gives KEY=VALUE items, a list inside it
    KEY=V,V,...; ``true`` is a bare flag, ``false`` leaves it out)."""
    argv = [_value(RESULTS_KEY, d, where) for d in data[RESULTS_KEY]]
    for key, v in data.items():
        if key == RESULTS_KEY:
            continue
        option = "--" + key.replace("_", "-")
        if isinstance(v, bool):
            argv += [option] if v else []
        elif isinstance(v, list):
            for item in v:
                argv += [option, _value(key, item, where)]
        elif isinstance(v, dict):
            for k, item in v.items():
                text = (",".join(_value(key, x, where) for x in item)
                        if isinstance(item, list) else _value(key, item, where))
                argv += [option, f"{k}={text}"]
        else:
            argv += [option, _value(key, v, where)]
    return argv


RECIPE_OPTION = "--recipe"


def expand_recipe(argv: list[str], prog: str = "diffkv-sim validate-runs") -> list[str]:
    """``argv`` with ``--recipe R`` (or ``--recipe=R``) replaced by the command line the recipe
    stands for, put first: options after it then add to its lists and replace its single
    values, as a later option does. At most one recipe."""
    out: list[str] = []
    recipe: list[str] | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        name: str | None = None
        if arg == RECIPE_OPTION:
            if i + 1 >= len(argv):
                raise SimulatorInputError(f"{RECIPE_OPTION} needs a recipe: a JSON file or "
                                          f"one of {', '.join(shipped_recipes())}")
            name, i = argv[i + 1], i + 2
        elif arg.startswith(RECIPE_OPTION + "="):
            name, i = arg.partition("=")[2], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        if recipe is not None:
            raise SimulatorInputError(f"{prog}: give one {RECIPE_OPTION}, not several")
        recipe = recipe_argv(load_recipe(name), f"recipe {name}")
    if recipe is None:
        return out
    # the recipe's result folders stay positional ahead of its options; the caller's own
    # positional folders (if any) join them
    return recipe + out
