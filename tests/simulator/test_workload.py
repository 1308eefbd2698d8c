"""Trace schema, loaders (good files and bad rows), writer, generators, bundled traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from sglang_diffkv.serving_io.arrivals import gamma_arrivals, poisson_arrivals, resample_arrivals
from sglang_diffkv.serving_io.bundled import BUNDLED_TRACES, bundled_path, load_named_trace
from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.loaders import detect_format, load_trace
from sglang_diffkv.serving_io.trace import Trace, TraceRequest
from sglang_diffkv.serving_io.writer import write_mooncake_jsonl
from simulator.workload.generate import synthetic_trace
from simulator.workload.lengths import length_model, length_model_names


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_mooncake_loader_reads_fields_and_rebases(tmp_path):
    p = write(tmp_path, "m.jsonl",
              '{"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [1, 2]}\n'
              '\n'
              '{"timestamp": 2500, "input_length": 7, "output_length": 3, "hash_ids": [],'
              ' "max_new_tokens": 8, "session_id": "s1"}\n')
    t = load_trace(p)
    assert [r.arrival_s for r in t.requests] == [0.0, 1.5]
    assert t.requests[0].prefix_hash_ids == (1, 2)
    assert t.requests[1].max_new_tokens == 8 and t.requests[1].session_id == "s1"
    assert t.requests[1].requested_new_tokens == 8 and t.requests[0].requested_new_tokens == 5


def test_azure_loader_parses_timestamps(tmp_path):
    p = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    t = load_trace(p)
    assert detect_format(p) == "azure"
    assert t.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert (t.requests[1].input_tokens, t.requests[1].output_tokens) == (396, 109)


def test_burstgpt_loader_skips_failed_rows_and_says_so(tmp_path):
    p = write(tmp_path, "b.csv",
              "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "5,ChatGPT,100,20,120,Conversation log\n"
              "6,ChatGPT,50,0,50,Conversation log\n"
              "9.5,GPT-4,30,7,37,API log\n")
    t = load_trace(p)
    assert detect_format(p) == "burstgpt"
    assert [(r.arrival_s, r.input_tokens) for r in t.requests] == [(0.0, 100), (4.5, 30)]
    assert "1 failed rows" in t.source


def test_sglang_custom_loader_counts_and_conversations(tmp_path):
    convo = {"conversations": [{"role": "user", "content": "x" * 400},
                               {"role": "assistant", "content": "y" * 40}]}
    p = write(tmp_path, "c.jsonl", json.dumps(convo) + "\n" +
              json.dumps({"input_len": 12, "output_len": 3}) + "\n")
    t = load_trace(p, "sglang")
    assert [(r.input_tokens, r.output_tokens) for r in t.requests] == [(100, 10), (12, 3)]


BAD_ROWS = [
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                '{"timestamp": 0, "input_length": 5}\n', None, "line 2", "output_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                '{"timestamp": -4, "input_length": 5, "output_length": 2}\n', None, "line 2",
     "timestamp"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n\n{oops\n', "mooncake",
     "line 3", "invalid JSON"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 2}\n', None, "line 1",
     "input_length=0"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
              "2023-11-16 18:15:47.00,abc,44\n", None, "line 3", "ContextTokens='abc'"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,44\n", None, "line 2",
     "TIMESTAMP"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374\n", None,
     "line 2", "expected 3 columns"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "x,ChatGPT,1,1,2,API log\n", None, "line 2", "Timestamp='x'"),
    ("c.jsonl", '{"input_len": 4, "output_len": 2}\n{"prompt": "hi"}\n', "sglang", "line 2",
     "input_len"),
]


@pytest.mark.parametrize("name,text,fmt,line,what", BAD_ROWS)
def test_loaders_reject_bad_rows_with_file_and_line(tmp_path, name, text, fmt, line, what):
    p = write(tmp_path, name, text)
    with pytest.raises(InputError) as e:
        load_trace(p, fmt)
    msg = str(e.value)
    assert str(p) in msg and f"{line}:" in msg and what in msg


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    p = write(tmp_path, "x.txt", "hello\n")
    with pytest.raises(InputError, match="cannot tell the trace format"):
        load_trace(p)
    with pytest.raises(InputError, match="unknown"):
        load_trace(p, "parquet")


def test_schema_validates_values():
    with pytest.raises(InputError, match="output_tokens=0"):
        TraceRequest(0.0, 10, 0)
    with pytest.raises(InputError, match="max_new_tokens=3"):
        TraceRequest(0.0, 10, 5, max_new_tokens=3)
    with pytest.raises(InputError, match="arrival_s"):
        TraceRequest(float("nan"), 10, 5)
    with pytest.raises(InputError, match="no requests"):
        Trace(())


def test_trace_sorts_by_arrival_and_scales_time():
    t = Trace((TraceRequest(2.0, 1, 1), TraceRequest(1.0, 2, 2)))
    assert [r.input_tokens for r in t.requests] == [2, 1]
    assert t.time_scaled(0.5).requests[-1].arrival_s == pytest.approx(0.5)
    with pytest.raises(InputError, match="time scale"):
        t.time_scaled(0)


def test_mooncake_writer_round_trips(tmp_path):
    t = synthetic_trace(length_model("sharegpt"), 50, 5.0, seed=3)
    for suffix in ("x.jsonl", "x.jsonl.gz"):
        back = load_trace(write_mooncake_jsonl(t, tmp_path / suffix))
        assert [(r.input_tokens, r.output_tokens) for r in back.requests] == [
            (r.input_tokens, r.output_tokens) for r in t.requests]
        assert np.allclose([r.arrival_s for r in back.requests],
                           [r.arrival_s for r in t.requests], atol=1e-6)
    gz1 = (tmp_path / "x.jsonl.gz").read_bytes()
    write_mooncake_jsonl(t, tmp_path / "y.jsonl.gz")
    assert gz1 == (tmp_path / "y.jsonl.gz").read_bytes()  # mtime 0: reproducible


def test_generators_are_seeded_and_match_their_parameters():
    a = gamma_arrivals(10.0, 3.0, 20000, np.random.default_rng(1))
    b = gamma_arrivals(10.0, 3.0, 20000, np.random.default_rng(1))
    assert np.array_equal(a, b) and a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.1, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)
    p = np.diff(poisson_arrivals(4.0, 20000, np.random.default_rng(2)))
    assert p.mean() == pytest.approx(0.25, rel=0.03) and p.std() / p.mean() == pytest.approx(
        1.0, rel=0.05)
    assert np.all(gamma_arrivals(float("inf"), 1.0, 5, np.random.default_rng(0)) == 0)
    with pytest.raises(InputError, match="rate"):
        poisson_arrivals(0.0, 3, np.random.default_rng(0))


def test_fitted_lengths_reproduce_the_source_statistics():
    # medians from SOURCES.md: Azure conv 1020 in / 129 out, Mooncake conversation 6909 / 350
    for name, med_in, med_out in (("azure-conv", 1020, 129),
                                  ("mooncake-conversation", 6909, 350)):
        m = length_model(name)
        inp, out = m.sample(20000, np.random.default_rng(0))
        assert np.median(inp) == pytest.approx(med_in, rel=0.05)
        assert np.median(out) == pytest.approx(med_out, rel=0.05)
    sg = length_model("sharegpt")
    inp, out = sg.sample(20000, np.random.default_rng(0))
    assert np.median(inp) == pytest.approx(np.exp(4.61), rel=0.06)
    assert np.corrcoef(np.log(inp), np.log(out))[0, 1] < -0.2
    lg = length_model("long-generation")
    _, out = lg.sample(5000, np.random.default_rng(0))
    assert out.min() >= 512 and out.max() <= 7680
    assert set(length_model_names()) >= {"sharegpt", "long-generation", "azure-conv"}
    with pytest.raises(InputError, match="unknown length model"):
        length_model("nope")


def test_resampled_arrivals_keep_lengths():
    t = load_named_trace("azure-conv").head(300)
    r = resample_arrivals(t, 50.0, seed=1)
    assert [x.input_tokens for x in r.requests] == [x.input_tokens for x in t.requests]
    assert r.mean_rate == pytest.approx(50.0, rel=0.2)


def test_bundled_traces_load_and_are_small():
    total = 0
    for name in BUNDLED_TRACES:
        p = bundled_path(name)
        total += p.stat().st_size
        assert gzip.decompress(p.read_bytes())  # valid gzip
        t = load_named_trace(name)
        assert len(t) >= 500 and t.requests[0].arrival_s == 0.0
    assert total < 2 * 2**20
    folder = bundled_path("sharegpt").parent
    assert (folder / "ATTRIBUTION.md").is_file()
    assert (folder / "LICENSE-APACHE-2.0.txt").is_file()
    assert (folder / "LICENSE-CC-BY-4.0.txt").is_file()
    with pytest.raises(InputError, match="neither a bundled trace"):
        load_named_trace("no-such-trace")


def test_resized_and_scaled_traces_keep_the_lengths():
    from simulator.workload.generate import resized, scale_lengths

    base = load_named_trace("sharegpt").head(50)
    assert resized(base, 20, seed=0).requests == base.requests[:20]
    long = resized(base, 130, seed=1)
    assert len(long) == 130 and long.requests[:50] == base.requests
    lengths = {(r.input_tokens, r.output_tokens) for r in base.requests}
    assert {(r.input_tokens, r.output_tokens) for r in long.requests} <= lengths
    assert all(r.prefix_hash_ids == () for r in long.requests[50:])
    s = scale_lengths(base, 2.0, 0.5)
    assert [r.input_tokens for r in s.requests] == [2 * r.input_tokens for r in base.requests]
    assert [r.output_tokens for r in s.requests] == [
        max(1, round(r.output_tokens * 0.5)) for r in base.requests]
    with pytest.raises(InputError, match="input scale=0"):
        scale_lengths(base, 0.0)
