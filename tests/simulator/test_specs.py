"""Model, GPU and calibration specs: parsing, derived sizes, validation messages."""

from __future__ import annotations

import json

import pytest

from simulator.errors import SimulatorInputError
from simulator.specs.calibration import load_calibration
from simulator.specs.gpu import gpu_names, load_gpu
from simulator.specs.model import BUNDLED, ModelSpec, load_model


def test_bundled_models_have_their_published_sizes():
    # parameter counts of the released checkpoints (billions)
    expected = {"llama-3-8b": 8.03, "llama-3-70b": 70.55, "qwen2.5-7b": 7.62,
                "qwen2.5-32b": 32.76, "qwq-32b": 32.76, "smollm2-135m": 0.1345}
    for name in BUNDLED:
        m = load_model(name)
        assert m.total_params / 1e9 == pytest.approx(expected[name], rel=0.002), name
    llama = load_model("llama-3-8b")
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (32, 8, 128)
    assert load_model("smollm2-135m").head_dim == 64
    assert load_model("qwq-32b").context_len == 40960


def test_model_from_hf_config_file(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
           "max_position_embeddings": 2048, "num_attention_heads": 4, "num_hidden_layers": 2,
           "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(d / "config.json"))
    assert m.name == "tiny" and m.head_dim == 64 and m.tie_embeddings
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SimulatorInputError, match="num_hidden_layers"):
        load_model(str(d / "config.json"))
    with pytest.raises(SimulatorInputError, match="unknown model 'gpt-9'"):
        load_model("gpt-9")


def test_model_validation_and_tp():
    with pytest.raises(SimulatorInputError, match="num_heads=6 is not a multiple"):
        ModelSpec("x", 2, 64, 6, 4, 16, 128, 100, 512)
    m = load_model("llama-3-8b")
    with pytest.raises(SimulatorInputError, match="tp=3"):
        m.check_tp(3)
    assert m.kv_heads_per_rank(16) == 1
    assert m.weight_bytes(2) == pytest.approx(m.weight_bytes(1) / 2)


def test_gpus_carry_provenance_and_validate(tmp_path):
    assert set(gpu_names()) == {"h100", "h200", "a100", "l40"}
    for g in gpu_names():
        spec = load_gpu(g)
        assert spec.provenance and spec.hbm_bandwidth > 0
    assert load_gpu("h200").memory_mib > load_gpu("h100").memory_mib
    bad = tmp_path / "g.json"
    bad.write_text(json.dumps({"name": "x", "memory_mib": 1000, "hbm_bandwidth": -1,
                               "bf16_flops": 1, "fp8_flops": 1, "interconnect_bandwidth": 1,
                               "provenance": "test"}))
    with pytest.raises(SimulatorInputError, match="hbm_bandwidth=-1"):
        load_gpu(str(bad))
    with pytest.raises(SimulatorInputError, match="unknown GPU"):
        load_gpu("tpu")


def test_calibration_defaults_and_validation(tmp_path):
    for g in gpu_names():
        c = load_calibration(g)
        assert c.provenance["source"]
        assert set(c.eta_mem_decode_attention) >= {"bf16", "fp8", "K8V4", "K4V2", "diffkv"}
    c = load_calibration("h100")
    assert c.attention_eta("bf16") > c.attention_eta("fp8")
    with pytest.raises(SimulatorInputError, match="no decode-attention eta"):
        c.attention_eta("fp4")
    data = json.loads(json.dumps({"gpus": {"h100": {}}}))
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(data))
    with pytest.raises(SimulatorInputError, match="lacks field"):
        load_calibration("h100", p)
    good = json.loads((tmp_path / "cal.json").read_text())
    from importlib import resources

    good = json.loads(resources.files("simulator.calibration").joinpath("default.json")
                      .read_text())
    good["gpus"]["h100"]["eta_mem_gemm"] = 1.5
    p.write_text(json.dumps(good))
    with pytest.raises(SimulatorInputError, match=r"eta_mem_gemm=1.5 must be in \(0, 1\]"):
        load_calibration("h100", p)
    with pytest.raises(SimulatorInputError, match="no calibration for GPU"):
        load_calibration("b200")
