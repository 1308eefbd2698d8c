"""Two host-side terms were removed: the probe hosts' speed spread (``host_speed_factors``,
``--host-launches-ms``) and the front-end GC pauses (``frontend_gc_*``, ``--frontend-gc``):
held out, they scored no better than the model without them (docs/simulator.md, "Host-side
terms, measured"). A file or command that still gives one is told so in one line, not
silently run without it."""

from __future__ import annotations

import importlib

import pytest
from sim_helpers import h100_calibration_with

from simulator.errors import SimulatorInputError


def test_a_calibration_with_host_speeds_is_told_they_were_removed(tmp_path):
    with pytest.raises(SimulatorInputError, match="host_speed_factors: the mean over probe "
                                                  "hosts was removed.*delete the key"):
        h100_calibration_with(tmp_path, {"host_speed_factors": [0.9, 1.2]})


@pytest.mark.parametrize("field", ["frontend_gc_pause_s", "frontend_gc_first_reqs"])
def test_a_calibration_with_gc_pauses_is_told_they_were_removed(tmp_path, field):
    with pytest.raises(SimulatorInputError, match=f"{field}: the front-end GC pauses were "
                                                  "removed"):
        h100_calibration_with(tmp_path, {field: 1})


@pytest.mark.parametrize("option", [["--host-launches-ms", "bf16=18.5"],
                                    ["--frontend-gc", "910,1590,450"]])
def test_validate_runs_no_longer_takes_the_removed_options(capsys, option):
    runs = importlib.import_module("simulator.validation.runs")
    with pytest.raises(SystemExit):
        runs.build_parser().parse_args(["d", *option])
    assert f"unrecognized arguments: {option[0]}" in capsys.readouterr().err
