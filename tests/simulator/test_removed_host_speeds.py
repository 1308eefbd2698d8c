"""The probe hosts' speed spread (``host_speed_factors``, ``--host-launches-ms``) was removed:
held out, the mean over hosts scored no better than one host at the pooled times
(docs/simulator.md, "Host-side terms, measured"). A file or command that still gives it is
told so in one line, not silently run without it."""

from __future__ import annotations

import importlib

import pytest
from sim_helpers import h100_calibration_with

from simulator.errors import SimulatorInputError


def test_a_calibration_with_host_speeds_is_told_they_were_removed(tmp_path):
    with pytest.raises(SimulatorInputError, match="host_speed_factors: the mean over probe "
                                                  "hosts was removed.*delete the key"):
        h100_calibration_with(tmp_path, {"host_speed_factors": [0.9, 1.2]})


def test_validate_runs_no_longer_takes_host_launches(capsys):
    runs = importlib.import_module("simulator.validation.runs")
    with pytest.raises(SystemExit):
        runs.build_parser().parse_args(["d", "--host-launches-ms", "bf16=18.5"])
    assert "unrecognized arguments: --host-launches-ms" in capsys.readouterr().err
