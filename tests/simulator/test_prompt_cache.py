"""The radix cache a harness run started with: the client's prompts as prefix ids, what the
earlier runs on the server left cached, the scheduler's warm start, and the reconstruction
checked against a real server's log."""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import H100_DATA, req, token_scheduler

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from sglang_diffkv.serving_io.writer import mooncake_lines
from simulator.serving.prefix_cache import PrefixCache
from simulator.validation.harness import load_harness, windowed_summary
from simulator.validation.prompt_cache import (
    prompt_block_ids,
    read_records,
    served_blocks,
    with_prompt_ids,
)

SINK: list = []


def test_the_clients_prompts_are_prefix_stable_per_seed_and_index():
    """The assumption the prefix ids rest on, checked on the client's own prompt_ids."""
    from sglang_diffkv.bench.client import prompt_ids

    rng = np.random.default_rng(7)
    for _ in range(20):
        seed, index = int(rng.integers(0, 5)), int(rng.integers(0, 3000))
        a, b = (int(x) for x in rng.integers(1, 700, size=2))
        pa, pb = prompt_ids(seed, index, a), prompt_ids(seed, index, b)
        k = min(a, b)
        assert pa[:k] == pb[:k]
        other = prompt_ids(seed, index + 1, k)
        assert other[:4] != pa[:4]                          # another index shares nothing
        ia, ib = prompt_block_ids(seed, index, a), prompt_block_ids(seed, index, b)
        assert len(ia) == a // 16 and ia[: k // 16] == ib[: k // 16]
        assert not set(prompt_block_ids(seed, index + 1, k)) & set(ia)
        assert not set(prompt_block_ids(seed + 1, index, k)) & set(ia)


def test_trace_gets_ids_by_position_and_keeps_its_block_size():
    t = Trace((TraceRequest(0.0, 40, 3), TraceRequest(1.0, 15, 2)), name="t")
    w = with_prompt_ids(t, 3, block=8)
    assert w.prefix_block_tokens == 8
    assert w.requests[0].prefix_hash_ids == prompt_block_ids(3, 0, 40, 8)
    assert len(w.requests[1].prefix_hash_ids) == 1
    assert w.head(1).prefix_block_tokens == 8 and w.rebased().prefix_block_tokens == 8
    with pytest.raises(InputError, match="512-token blocks"):
        mooncake_lines(w)                      # Mooncake hash ids name 512-token blocks
    with pytest.raises(InputError, match="prefix_block_tokens"):
        Trace(t.requests, prefix_block_tokens=0)


def test_served_blocks_follow_stream_ends_and_skip_unstarted_requests():
    recs = [{"index": 0, "input_len": 40, "tokens": 20, "first": 0.1, "end": 2.0},
            {"index": 1, "input_len": 33, "tokens": 1, "first": 0.2, "end": 0.5},
            {"index": 2, "input_len": 50, "tokens": 0, "first": None, "end": None}]
    entries = served_blocks([recs], seed=0, block=16)
    assert len(entries) == 2                              # index 2 never got a first token
    assert entries[0] == prompt_block_ids(0, 1, 33)       # ended first
    first_prompt = prompt_block_ids(0, 0, 40)
    assert entries[1][:2] == first_prompt
    # 40 % 16 = 8 prompt tokens in a partial block + 19 cached outputs: one more block
    assert len(entries[1]) == 3 and entries[1][2] not in first_prompt


def test_warm_cache_keeps_the_newest_that_fit_and_serves_them():
    s = token_scheduler(100)
    s.cache = PrefixCache(16)
    old, mid, new = (tuple(range(k, k + 3)) for k in (0, 10, 20))
    assert s.warm_cache([old, mid, new]) == 96            # 3 x 48 units > 100: oldest out
    assert s.used == 96 == s.cache.units and s.cache.evictable_units == 96
    assert s.cache.match(old, 1000) == [] and s.cache.match(new, 1000) == list(new)
    r = req(0, 50, 2)
    r.hash_ids = new
    s.submit(r)
    b = s.next_batch()
    assert b.chunks == [(r, 2)] and r.cached == 48        # 48 cached, 2 to compute
    with pytest.raises(RuntimeError, match="fresh scheduler"):
        s.warm_cache([old])
    plain = token_scheduler(100)                          # no radix cache: nothing to warm
    assert plain.warm_cache([old]) == 0 and plain.used == 0


def _records(path: Path, rows: list[dict]) -> None:
    path.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))


def test_replay_inputs_check_the_records_against_the_trace(tmp_path):
    root = tmp_path / "h"
    (root / "logs" / "traces").mkdir(parents=True)
    for name in ("a", "b"):
        (root / "logs" / "traces" / f"{name}.jsonl").write_text(
            '{"timestamp": 0, "input_length": 40, "output_length": 3}\n'
            '{"timestamp": 5, "input_length": 20, "output_length": 3}\n')
    (root / "logs" / "server__bf16.log").write_text("x\n")
    run = {"config": "bf16", "workload": "ladder", "client": {},
           "server_log": {"log_bytes": [0, 2]}}
    data = {"configs": {"bf16": {}}, "options": {"seed": 5},
            "runs": [{**run, "label": "ladder@1rps", "trace_file": "logs/traces/a.jsonl"},
                     {**run, "label": "ladder@2rps", "trace_file": "logs/traces/b.jsonl"}]}
    (root / "results.json").write_text(json.dumps(data))
    h = load_harness(root)
    first, second = h.runs
    assert second.seed == 5 and second.earlier == (first,)
    with pytest.raises(InputError, match="no request records"):
        second.replay_inputs()
    trace, warm = second.replay_inputs(radix_cache=False)     # no radix cache: not needed
    assert warm == [] and trace.requests[0].prefix_hash_ids == prompt_block_ids(5, 0, 40)
    _records(root / "logs" / "requests__bf16__ladder@1rps.jsonl.gz",
             [{"index": 0, "input_len": 40, "tokens": 3, "first_token_s": 0.1, "end_s": 0.3}])
    h = load_harness(root)
    _, warm = h.runs[1].replay_inputs()
    assert warm == [prompt_block_ids(5, 0, 40)]
    _records(root / "logs" / "requests__bf16__ladder@2rps.jsonl.gz",
             [{"index": 1, "input_len": 21, "tokens": 3, "first_token_s": 5.1, "end_s": 5.3}])
    with pytest.raises(InputError, match="request 1 .21 prompt tokens. is not"):
        load_harness(root).runs[1].replay_inputs()
    bad = root / "logs" / "requests__bf16__ladder@1rps.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"index": 0}\n'))
    with pytest.raises(InputError, match="line 1: not a request record"):
        read_records(bad)


@pytest.mark.slow
def test_the_rebuilt_cache_matches_a_real_servers_hits(tmp_path):
    """2026-11-22's bf16 server ran longgen, ShareGPT, then ladders of the ShareGPT trace's
    lengths: its log's #cached-token says 12% / 53% / 67% of the ladders' prompt tokens came
    from the radix cache. The replay's rebuilt cache gives the same within 2 points."""
    vs = importlib.import_module("simulator.validation.runs")
    h = load_harness(H100_DATA / "e2e-bf16", tmp_path / "x")
    for run in h.runs:
        if run.workload != "ladder":
            continue
        log = vs.slice_log(run, run.server_log)
        settings, fmt = vs.server_settings(h.configs[run.config], log)
        sc = vs.scenario("llama-3-8b", "h100", vs.load_calibration("h100"), settings, h,
                         run.config)
        trace, warm = run.replay_inputs()
        res = sc.run(trace, fmt, warm_cache=warm)
        got = windowed_summary(res, run.window_s)["prefix_hit_rate"]
        assert got == pytest.approx(log.prefix_hit_rate, abs=0.02), run.key
        assert log.prefix_hit_rate > 0.1
