"""Server configurations -> command lines, and the server process (setsid, ready, stop)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from sglang_diffkv.bench.errors import BenchInputError
from sglang_diffkv.bench.server import (
    DEFAULT_DIFFKV_CONFIG,
    LaunchOptions,
    ServerProcess,
    ServerStartError,
    launch_command,
    launch_env,
    make_config,
    parse_config_list,
    shell_line,
)

OPTS = LaunchOptions(model="/tmp/m", port=30001, python="python3")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_common_arguments_for_every_configuration() -> None:
    for name in ("bf16", "fp8", "diffkv-mix"):
        argv = launch_command(make_config(name), OPTS)
        assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
        assert _flag(argv, "--model-path") == "/tmp/m"
        assert _flag(argv, "--load-format") == "dummy"
        assert _flag(argv, "--sampling-backend") == "pytorch"
        assert _flag(argv, "--grammar-backend") == "none"
        assert _flag(argv, "--mem-fraction-static") == "0.85"
        assert _flag(argv, "--port") == "30001"
        assert _flag(argv, "--decode-log-interval") == "10"
        for f in ("--skip-tokenizer-init", "--disable-piecewise-cuda-graph",
                  "--incremental-streaming-output"):
            assert f in argv
        # decode CUDA graphs stay at SGLang's default (diffkv forces them off itself)
        assert "--disable-cuda-graph" not in argv


def test_backend_and_kv_dtype_per_configuration() -> None:
    bf16 = launch_command(make_config("bf16"), OPTS)
    fp8 = launch_command(make_config("fp8"), OPTS)
    dkv = make_config("diffkv-mix")
    assert _flag(bf16, "--attention-backend") == "triton" and "--kv-cache-dtype" not in bf16
    assert _flag(fp8, "--attention-backend") == "triton"
    assert _flag(fp8, "--kv-cache-dtype") == "fp8_e4m3"
    argv = launch_command(dkv, OPTS)
    assert _flag(argv, "--attention-backend") == "diffkv" and "--kv-cache-dtype" not in argv
    assert dkv.env_dict == {"SGLANG_DIFFKV_CONFIG": DEFAULT_DIFFKV_CONFIG}
    assert json.loads(DEFAULT_DIFFKV_CONFIG) == {"preset": "llama-3-8b",
                                                 "bench_mix": [0.3, 0.5, 0.2]}
    env = launch_env(dkv, {"PATH": "/bin"})
    assert env["SGLANG_DIFFKV_CONFIG"] == DEFAULT_DIFFKV_CONFIG and env["PATH"] == "/bin"
    assert "SGLANG_DIFFKV_CONFIG" not in launch_env(make_config("bf16"), {})


def test_diffkv_variants_take_their_own_config_and_env() -> None:
    cfgs = parse_config_list("bf16,diffkv-mix,diffkv-hi",
                             {"diffkv-hi": '{"preset": "llama-3-8b", "bench_mix": [1, 0, 0]}'},
                             {"SGLANG_DIFFKV_PROFILE": "1"})
    assert [c.name for c in cfgs] == ["bf16", "diffkv-mix", "diffkv-hi"]
    assert cfgs[0].env == ()
    assert cfgs[1].env_dict["SGLANG_DIFFKV_CONFIG"] == DEFAULT_DIFFKV_CONFIG
    assert json.loads(cfgs[2].env_dict["SGLANG_DIFFKV_CONFIG"])["bench_mix"] == [1, 0, 0]
    assert cfgs[2].env_dict["SGLANG_DIFFKV_PROFILE"] == "1"
    line = shell_line(launch_command(cfgs[1], OPTS), cfgs[1].env_dict)
    assert line.startswith("SGLANG_DIFFKV_CONFIG='{\"preset\"")
    # a preset name is passed through for the server to check
    assert make_config("diffkv", {"diffkv": "llama-3-8b"}).env_dict[
        "SGLANG_DIFFKV_CONFIG"] == "llama-3-8b"


@pytest.mark.parametrize(("text", "configs", "match"), [
    ("bf17", None, "unknown configuration 'bf17'; allowed: bf16, fp8, diffkv"),
    ("diffkv-", None, "unknown configuration"),
    ("bf16,bf16", None, "twice"),
    (" , ", None, "names no configuration"),
    ("diffkv-a", {"diffkv-a": "{not json"}, "not valid JSON"),
    ("diffkv-a", {"diffkv-a": "[1, 2]"}, "not valid JSON|JSON object"),
    ("diffkv-a", {"diffkv-a": "  "}, "empty"),
    ("bf16", {"bf16": "{}"}, "only configurations named 'diffkv'"),
    ("diffkv-a", {"diffkv-b": "{}"}, "'diffkv-b', which is not in --configs"),
])
def test_bad_configurations(text, configs, match) -> None:
    with pytest.raises(BenchInputError, match=match):
        parse_config_list(text, configs)


def test_bad_launch_options() -> None:
    with pytest.raises(BenchInputError, match="port 0"):
        LaunchOptions(model="m", port=0)
    with pytest.raises(BenchInputError, match="mem_fraction_static 1.5"):
        LaunchOptions(model="m", mem_fraction_static=1.5)
    with pytest.raises(BenchInputError, match="stream_interval=0"):
        LaunchOptions(model="m", stream_interval=0)


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_early_exit_is_reported_with_the_log_tail(tmp_path) -> None:
    code = "print('loading...'); print('ValueError: bad model', flush=True); raise SystemExit(3)"
    srv = ServerProcess([sys.executable, "-c", code], dict(os.environ), tmp_path / "s.log")
    srv.start(port=1)
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 3.*bad model"):
        srv.wait_ready(30, poll_s=0.05)


def test_timeout_stops_the_whole_process_group(tmp_path) -> None:
    # the launcher starts a child (like SGLang's scheduler); both must be gone afterwards
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")
    srv = ServerProcess([sys.executable, "-c", code], dict(os.environ), tmp_path / "s.log")
    srv.start(port=1)
    pid = srv.proc.pid
    time.sleep(0.3)
    with pytest.raises(ServerStartError, match="not ready after"):
        srv.wait_ready(0.5, poll_s=0.05)
    assert _gone(pid) and srv.proc is None


def test_ready_marker_and_graceful_stop(tmp_path) -> None:
    code = ("import time, signal, sys; print('a' * 5000); "
            "print('The server is fired up and ready to roll!', flush=True); "
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)")
    srv = ServerProcess([sys.executable, "-c", code], dict(os.environ), tmp_path / "s.log")
    srv.start(port=1)
    ready = srv.wait_ready(30, poll_s=0.05)
    assert 0 < ready < 30 and srv.alive() and srv.log_size() > 5000
    pid = srv.proc.pid
    assert srv.stop(grace_s=10) < 10
    assert _gone(pid) and not srv.alive()
