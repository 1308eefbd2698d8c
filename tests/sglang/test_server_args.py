"""ServerArgs accepts --attention-backend diffkv, forces its settings (not chunked prefill:
SGLang's --chunked-prefill-size stands), and refuses what it does not support, with the
documented messages."""

from __future__ import annotations

import logging

import harness as H  # sglang importable on CPU, diffkv registered
import pytest
from sglang.srt.server_args import ServerArgs, prepare_server_args

from sglang_diffkv.sglang.args import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    FORCED_SETTINGS,
    DiffKVUnsupportedError,
    check_forced_settings,
)
from sglang_diffkv.sglang.pool import DiffKVPoolError


@pytest.fixture(autouse=True)
def _keep_pytest_log_capture(monkeypatch):
    # prepare_server_args calls logging.basicConfig(force=True), which would take pytest's
    # capture handler (caplog) off the root logger
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)


def _args(*extra: str) -> ServerArgs:
    return prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv", *extra])


def test_cli_accepts_diffkv_and_forces_its_settings(caplog):
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        a = _args("--page-size", "16", "--chunked-prefill-size", "4096")
    assert a.attention_backend == "diffkv"
    assert a.page_size == 1
    assert a.disable_radix_cache is False and a.radix_cache_backend == "diffkv"
    assert a.chunked_prefill_size == 4096  # chunked prefill is the user's (or SGLang's) choice
    assert a.cuda_graph_backend_decode is None  # the kernel path captures decode graphs
    assert a.cuda_graph_max_bs_decode == DEFAULT_CUDA_GRAPH_MAX_BS
    assert a.cuda_graph_backend_prefill == "disabled"
    assert a.disable_overlap_schedule is False  # the pool orders itself after the forward
    # what SGLang resolves from them (its __post_init__ stops before that for a dummy model)
    a._parse_cuda_graph_config()
    graphs = a.cuda_graph_config
    assert (graphs.decode.backend, graphs.decode.max_bs) == ("full", DEFAULT_CUDA_GRAPH_MAX_BS)
    assert graphs.prefill.backend == "disabled"
    forced = [r.getMessage() for r in caplog.records if "forcing" in r.getMessage()]
    # one line per forced setting, each with its reason; the user's values are named
    assert len(forced) == len(FORCED_SETTINGS)
    assert any("page_size=1 (was 16)" in m for m in forced)
    overridden = [r for r in caplog.records if "(was " in r.getMessage()]
    assert overridden and all(r.levelno == logging.WARNING for r in overridden)
    assert not any("chunked_prefill_size" in m for m in forced)
    assert all(": " in m and len(m.split(": ", 1)[1]) > 20 for m in forced)
    assert any("SGLANG_DIFFKV_CONFIG" in r.getMessage() for r in caplog.records)


def test_cuda_graphs_follow_the_compute_path(monkeypatch, caplog):
    a = _args("--cuda-graph-max-bs-decode", "64")
    assert a.cuda_graph_backend_decode is None and a.cuda_graph_max_bs_decode == 64  # the user's
    monkeypatch.setenv("SGLANG_DIFFKV_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="sglang_diffkv"):
        a = _args()
    assert a.cuda_graph_backend_decode == "disabled"  # the torch reference cannot be captured
    assert a.disable_overlap_schedule is True
    for name, value in (("cuda_graph_backend_decode", "disabled"),
                        ("disable_overlap_schedule", True)):
        assert any(f"forcing {name}={value}" in r.getMessage()
                   and "SGLANG_DIFFKV_KERNELS=0" in r.getMessage() for r in caplog.records)
    a._parse_cuda_graph_config()
    assert a.cuda_graph_config.decode.backend == a.cuda_graph_config.prefill.backend == "disabled"


def test_an_explicit_cuda_graph_config_must_keep_the_forced_phases():
    """--cuda-graph-config JSON outranks the per-phase flags in SGLang's resolution; after
    SGLang's __post_init__ the resolved config is checked (check_forced_settings)."""
    a = _args("--cuda-graph-config",
              '{"prefill": {"backend": "disabled"}, "decode": {"max_bs": 32}}')
    assert a.cuda_graph_max_bs_decode is None  # the user sized the decode graphs in the JSON
    a._parse_cuda_graph_config()  # (what SGLang's __post_init__ does for a real model)
    check_forced_settings(a)
    assert (a.cuda_graph_config.decode.backend, a.cuda_graph_config.decode.max_bs) == ("full", 32)
    a = _args("--cuda-graph-config", '{"prefill": {"backend": "breakable"}}')
    a._parse_cuda_graph_config()
    with pytest.raises(DiffKVUnsupportedError,
                       match="cuda_graph_config prefill backend resolved to 'breakable'"):
        check_forced_settings(a)
    a = _args("--cuda-graph-config", '{"decode": {"backend": "breakable"}}')
    a._parse_cuda_graph_config()
    with pytest.raises(DiffKVUnsupportedError, match="the DiffKV decode supports full or disabled"):
        check_forced_settings(a)


def test_other_backends_are_untouched():
    a = prepare_server_args(["--model-path", "dummy", "--attention-backend", "triton",
                             "--page-size", "16"])
    assert a.page_size == 16 and not a.disable_radix_cache
    assert a.cuda_graph_backend_prefill is None and a.cuda_graph_max_bs_decode is None


def test_tensor_parallelism_is_accepted():
    """Each TP rank holds its KV heads' pages; the ranks' schedulers agree on one free-page
    count (tp_agreement, test_tp_agreement.py)."""
    a = _args("--tp-size", "2")
    assert a.tp_size == 2 and a.page_size == 1
    assert a.disable_radix_cache and a.radix_cache_backend is None  # (test_radix_cache.py)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-algorithm", "EAGLE"], "speculative decoding"),
        (["--enable-dp-attention"], "DP attention"),
        (["--enable-hierarchical-cache"], "hierarchical cache"),
        (["--disaggregation-mode", "prefill"], "P/D disaggregation"),
        (["--enable-mixed-chunk"], "--enable-mixed-chunk is not supported"),
        (["--pp-size", "2"], "pipeline parallelism"),
        (["--kv-cache-dtype", "fp8_e4m3"], "leave --kv-cache-dtype at auto"),
        (["--decode-attention-backend", "triton"], "diffkv must run both prefill and decode"),
        (["--cuda-graph-backend-decode", "breakable"], "the DiffKV decode supports full or"),
    ],
)
def test_unsupported_options_are_refused(flags, message):
    with pytest.raises(DiffKVUnsupportedError, match=message):
        _args(*flags)


def test_bad_config_env_fails_at_startup(monkeypatch):
    monkeypatch.setenv("SGLANG_DIFFKV_CONFIG", "no-such-preset")
    with pytest.raises(DiffKVUnsupportedError, match="unknown preset 'no-such-preset'"):
        _args()


@pytest.mark.parametrize(
    ("tweak", "message"),
    [
        ({"head_dim": 96}, r"head_dim=96 is not supported; supported: \(64, 128, 256\)"),
        ({"use_mla_backend": True}, "MLA models are not supported"),
        ({"is_hybrid_swa": True}, "hybrid sliding-window / linear-attention models"),
    ],
)
def test_model_level_refusals_when_the_pool_is_built(monkeypatch, tweak, message):
    H.cpu_sglang_helpers(monkeypatch)
    shape = H.ModelShape(head_dim=tweak.get("head_dim", 64))
    args = ServerArgs(model_path="dummy", attention_backend="diffkv")
    with pytest.raises(DiffKVPoolError, match=message):
        H.FakeRunner(args, shape, 10**7, 8, use_mla_backend=tweak.get("use_mla_backend", False),
                     hybrid_swa=tweak.get("is_hybrid_swa", False))
