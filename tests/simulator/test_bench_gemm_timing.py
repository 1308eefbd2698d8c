"""scripts/bench_gemm_timing.py without a GPU: arguments, shapes and the table."""

from __future__ import annotations

import argparse

import pytest
import torch
from sim_helpers import load_script

gt = load_script("bench_gemm_timing")


def test_shapes_are_the_cost_models_gemms():
    shapes = gt.gemm_shapes("llama-3-8b", "h100")
    assert shapes["gate_up"][:2] == (28672, 4096) and shapes["down"][:2] == (4096, 14336)
    assert shapes["lm_head"][:2] == (128256, 4096)
    # enough copies that the 50 MB L2 cannot serve one call from the previous one
    assert all(c >= 1 for _, _, c in shapes.values()) and shapes["o"][2] > shapes["lm_head"][2]


def test_bad_arguments_are_named():
    assert gt.positive_ints("8,496") == [8, 496]
    for bad in ("8,x", "0", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated"):
            gt.positive_ints(bad)
    assert gt.data_kinds("randn,dummy") == ["randn", "dummy"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"\['ones'\]; allowed: randn"):
        gt.data_kinds("randn,ones")


def test_table_reports_replay_over_kernel():
    rows = [{"m": 496, "op": "gate_up", "data": "randn", "replay_us": 171.7,
             "kernel_us": 155.6, "kernel": "nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN"}]
    text = gt.table(rows)
    assert "| 496 | gate_up | randn | 171.7 | 155.6 | 1.10 | `nvjet_sm90" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_it_exits_2(capsys, tmp_path):
    assert gt.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
