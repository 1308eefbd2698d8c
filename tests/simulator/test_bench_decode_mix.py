"""scripts/bench_decode_mix.py: the batches it builds (CPU parts; the timing needs a GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sim_helpers import ROOT, load_script

RUN = ROOT / "docs" / "data" / "h100-2026-11-23" / "e2e-s13-sharegpt-bf16-graphs1536"


def _script():
    return load_script("bench_decode_mix")


def test_each_layout_places_every_token_once_and_appends_decode_tokens_step_by_step():
    m = _script()
    lay = m.slot_layouts([5, 3, 7], [2, 3, 1], np.random.default_rng(0))
    for case in m.TRITON_CASES:
        ctx, slots = lay[case]
        assert sorted(slots.tolist()) == list(range(int(ctx.sum()))), case
    ctx, slots = lay["appended"]
    per_req = np.split(slots, np.cumsum(ctx)[:-1])
    # prompts first, in request order; then one slot per step to every request generating
    # at it, all ending at the last step (request 2 generated for 6 steps, request 0 for 3)
    assert per_req[0].tolist() == [0, 1, 9, 11, 13]
    assert per_req[1].tolist() == [2, 3, 4]
    assert per_req[2].tolist() == [5, 6, 7, 8, 10, 12, 14]
    uni, _ = lay["uniform"]
    assert uni.tolist() == [5, 5, 5]


def test_synthetic_batches_hit_their_targets_within_the_caps():
    m = _script()
    spec = m.synthetic_batches([512, 4096], [1000, 3000], [0.5, 1.0], max_context=8192,
                               max_tokens=4096 * 1000, prompt_share=0.25, seed=3)
    got = [(b["batch"], b["target"]["mean"], b["target"]["cv"]) for b in spec["batches"]]
    # 4096 x 3000 tokens is over the cap: left out
    assert got == [(512, 1000, 0.5), (512, 1000, 1.0), (512, 3000, 0.5), (512, 3000, 1.0),
                   (4096, 1000, 0.5), (4096, 1000, 1.0)]
    for b in spec["batches"]:
        c, p = np.array(b["contexts"]), np.array(b["prompts"])
        assert c.min() >= 1 and c.max() <= 8192 and (p <= c).all()
        if b["batch"] == 4096 and b["target"]["mean"] == 1000:
            assert abs(c.mean() / 1000 - 1) < 0.08
            assert abs(c.std() / c.mean() - b["target"]["cv"]) < 0.12


def test_contexts_are_the_simulated_running_batches_of_a_real_run(tmp_path):
    m = _script()
    spec = m.simulated_batches(str(RUN), "bf16/sharegpt", [64, 400])
    assert spec["source"]["format"] == "bf16"
    for want, b in zip([64, 400], spec["batches"], strict=True):
        c, p = np.array(b["contexts"]), np.array(b["prompts"])
        assert abs(len(c) - want) <= max(1, want // 20)
        assert len(p) == len(c) and (p <= c).all() and (c > 0).all()
        assert c.std() > 0           # a saturated ShareGPT batch mixes its contexts
    with pytest.raises(SystemExit, match="no simulated decode batch within 5% of 5000"):
        m.simulated_batches(str(RUN), "bf16/sharegpt", [5000])


def test_the_command_line_names_bad_values(tmp_path, capsys):
    m = _script()
    with pytest.raises(SystemExit):
        m.main(["synthetic", "--cvs", "0.4,x", "--out", str(tmp_path / "c.json")])
    assert "--cvs '0.4,x': expected comma-separated numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        m.main(["synthetic", "--batches", "16,0", "--out", str(tmp_path / "c.json")])
    assert "every value must be > 0" in capsys.readouterr().err
    out = tmp_path / "c.json"
    assert m.main(["synthetic", "--batches", "8", "--means", "100", "--cvs", "0.5",
                   "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["batches"]) == 1


def test_the_table_gives_each_case_against_the_first():
    m = _script()
    rows = [{"kernel": "bf16", "batch": 31, "mean_context": 2135.4, "cv": 0.36,
             "max_context": 5996, "prompt_share": 0.12,
             "time_us": {"uniform": 105.9, "mixed": 162.9}}]
    text = m.table(rows)
    assert "| bf16 | 31 | 2135 | 0.36 | 5996 | 0.12 | uniform 106, mixed 163 (1.54) |" in text
