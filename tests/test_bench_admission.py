"""The admission rule SGLang applied to a bench run, and the mixed-rule warning (no GPU)."""

from __future__ import annotations

import pytest

from sglang_diffkv.bench import admission as adm
from sglang_diffkv.bench.e2e import format_table
from sglang_diffkv.bench.logstats import startup_info
from sglang_diffkv.serving_io.sglang_log import parse_server_log

LOG_OFF = ("[2026-11-25 02:27:34] server_args=ServerArgs(model_path='/tmp/m', "
           "attention_backend='diffkv', tp_size=1, disable_radix_cache=True, "
           "cuda_graph_config={'decode': {'max_bs': 256}}, chunked_prefill_size=-1)")
LOG_ON = LOG_OFF.replace("disable_radix_cache=True", "disable_radix_cache=False")
# the start-up line a ready server has logged (parse_server_log requires it)
POOL = "[2026-11-25 02:27:50 TP0] max_total_num_tokens=1000, max_running_requests=64\n"


@pytest.mark.parametrize("ignore_eos,off,rule", [
    (True, True, adm.STRICT), (True, False, adm.RATIO),
    (False, True, adm.RATIO), (False, False, adm.RATIO)])
def test_rule_is_strict_only_with_ignore_eos_and_the_radix_cache_off(ignore_eos, off,
                                                                      rule) -> None:
    assert adm.admission_rule(ignore_eos, off) == rule


def test_the_logged_resolved_value(tmp_path) -> None:
    def logged(text: str) -> bool | None:
        (log := tmp_path / "server.log").write_text(text + "\n" + POOL)
        return adm.logged_disable_radix(parse_server_log(log).server_args)

    assert logged("noise\n" + LOG_OFF + "\n") is True
    assert logged(LOG_ON) is False
    assert logged("server_args: --port 1") is None


@pytest.mark.parametrize("argv,backend,off", [
    (["--attention-backend", "triton"], "triton", False),
    (["--disable-radix-cache"], "triton", True),
    (["--disable-radix-cache"], "diffkv", True),
    (["--tp-size", "2"], "diffkv", True),       # apply_radix_setting forces it off
    (["--tensor-parallel-size=4"], "diffkv", True),
    (["--tp-size", "2"], "triton", False),
    (["--tp-size", "1"], "diffkv", False),
])
def test_the_launch_command_implies_the_radix_setting(argv, backend, off) -> None:
    assert adm.argv_disable_radix(argv, backend) is off


def test_the_server_log_outranks_the_launch_command(tmp_path) -> None:
    log = tmp_path / "server.log"
    log.write_text("[t] starting\n" + LOG_OFF + "\n" + POOL)
    # e.g. SGLang forced the radix cache off for this model: the log is what ran
    logged = startup_info(log)["disable_radix_cache"]
    assert adm.radix_disabled([], "triton", logged) == (True, "server log")
    log.write_text("[t] server_args: --port 1\n" + POOL)
    logged = startup_info(log)["disable_radix_cache"]
    assert adm.radix_disabled(["--disable-radix-cache"], "triton", logged) == (
        True, "launch command")
    assert adm.radix_disabled([], "triton", None) == (False, "launch command")


def _run(config: str, workload: str, rule: str | None, label: str | None = None) -> dict:
    client = {k: 1.0 for k in ("window_s", "output_throughput", "steady_output_throughput",
                               "request_throughput", "mean_tpot_all_ms",
                               "median_tpot_all_ms", "mean_ttft_all_ms")}
    client["completed"] = 1
    return {"config": config, "workload": workload, "label": label or workload,
            "client": client, "server_log": {}, "pool_tokens": 1000, "admission_rule": rule}


def test_mixed_rules_in_one_workload_warn_once_naming_configs_and_rules() -> None:
    runs = [_run("bf16", "longgen", adm.RATIO), _run("fp8", "longgen", adm.RATIO),
            _run("diffkv-mix", "longgen", adm.STRICT),
            _run("bf16", "ladder", adm.RATIO, "ladder@0.5x"),
            _run("bf16", "ladder", adm.RATIO, "ladder@1x"),
            _run("diffkv-mix", "ladder", adm.RATIO, "ladder@0.5x")]
    (w,) = adm.mixed_rule_warnings(runs)
    assert w.startswith("WARNING longgen:")
    assert ("bf16 new_token_ratio, fp8 new_token_ratio, diffkv-mix ignore_eos_strict"
            in w)
    assert "mixes two admission rules" in w and "--disable-radix-cache" in w
    table = format_table(runs)
    assert table.splitlines()[-1] == w
    head = table.splitlines()[0].split()
    assert head[-1] == "admit"
    rows = table.splitlines()[2:8]
    assert [r.split()[-1] for r in rows] == ["ratio", "ratio", "strict", "ratio", "ratio",
                                             "ratio"]


def test_one_rule_per_workload_or_unknown_rules_do_not_warn() -> None:
    same = [_run("bf16", "longgen", adm.STRICT), _run("diffkv-mix", "longgen", adm.STRICT),
            _run("bf16", "sharegpt", adm.RATIO), _run("diffkv-mix", "sharegpt", None)]
    assert adm.mixed_rule_warnings(same) == []
    table = format_table(same)
    assert "WARNING" not in table and table.splitlines()[5].split()[-1] == "-"
