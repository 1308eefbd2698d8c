"""Fuzzed trace rows in every format: a row is either refused with one InputError
line naming the file, the line and the field, or loaded and replayed by the simulator.
Example counts come from the hypothesis profile (tests/conftest.py)."""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sim_helpers import scenario

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.loaders import MAX_TIME_S, load_trace
from simulator.studies.scenario import Scenario

JUNK = st.one_of(
    st.none(), st.booleans(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
)
TOKENS = st.one_of(st.integers(1, 3000), st.integers(-2, 10**12), st.floats(-1, 5000), JUNK)
MS = st.one_of(st.floats(0, 1e7), st.sampled_from([MAX_TIME_S * 1000.0, 1e300, -1.0]), JUNK)
FIELDS = {
    "mooncake": {"timestamp": MS, "input_length": TOKENS, "output_length": TOKENS,
                 "hash_ids": st.one_of(st.lists(st.integers(0, 2**70), max_size=4), JUNK),
                 "max_new_tokens": TOKENS, "session_id": st.one_of(st.text(max_size=4), JUNK)},
    "sglang": {"timestamp": MS, "input_len": TOKENS, "output_len": TOKENS,
               "conversations": st.one_of(
                   st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                   "content": st.one_of(st.text(), JUNK)}),
                            max_size=3), JUNK)},
}
# rows that should load: every required field valid, the optional ones fuzzed
GOOD_TOKENS = st.integers(1, 3000)
GOOD_MS = st.one_of(st.floats(0, 1e7), st.just(MAX_TIME_S * 1000.0))
REQUIRED = {
    "mooncake": {"timestamp": GOOD_MS, "input_length": GOOD_TOKENS, "output_length": GOOD_TOKENS},
    "sglang": {"timestamp": GOOD_MS, "input_len": GOOD_TOKENS, "output_len": GOOD_TOKENS},
}
# CSV cells as text: numbers, their edge cases and junk
CELL_NUMBER = st.one_of(st.integers(0, 5000).map(str), st.sampled_from(
    ["", "-1", "1e3", "nan", "inf", "0x10", " 12 ", "9" * 5000]), st.text(max_size=5))
CLOCK = st.one_of(
    st.tuples(st.integers(0, 30), st.integers(0, 70), st.floats(0, 70))
    .map(lambda t: f"{t[0]:02d}:{t[1]:02d}:{t[2]:010.7f}"),
    st.sampled_from(["18:17:nan", "99:99:99", "18:17", "18:17:inf", "-1:00:00"]),
    st.text(max_size=8))
AZURE_TIME = st.builds(lambda day, clock: f"{day} {clock}",
                       st.sampled_from(["2023-11-16", "2023-11-17", "9999-12-31", "2023-02-30",
                                        "x"]), CLOCK)
GOOD_AZURE_TIME = st.builds(
    lambda day, h, m, sec: f"2023-11-{day} {h:02d}:{m:02d}:{sec:010.7f}",
    st.sampled_from(["15", "16", "17"]), st.integers(0, 23), st.integers(0, 59),
    st.floats(0, 59.9999999))
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
AZURE_FIRST = "2023-11-16 18:15:46.6805900,374,44"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"
BURST_FIRST = "5,ChatGPT,100,20,120,Conversation log"
NAMES = {"azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
         "burstgpt": ("Timestamp", "Request tokens", "Response tokens")}


def csv_cell(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


@st.composite
def rows(draw) -> tuple[str, str, str]:
    """(format, file name, text): a good first row and a fuzzed second one."""
    fmt = draw(st.sampled_from(["mooncake", "sglang", "azure", "burstgpt"]))
    good = draw(st.booleans())
    if fmt in FIELDS:
        optional = {k: v for k, v in FIELDS[fmt].items() if not good or k not in REQUIRED[fmt]}
        row = draw(st.fixed_dictionaries(REQUIRED[fmt] if good else {}, optional=optional))
        first = {"timestamp": 0, "input_length": 10, "output_length": 5} if fmt == "mooncake" \
            else {"timestamp": 0, "input_len": 10, "output_len": 5}
        text = json.dumps(first) + "\n" + json.dumps(row) + "\n"
        return fmt, f"{fmt}.jsonl", text
    number = GOOD_TOKENS.map(str) if good else CELL_NUMBER
    if fmt == "azure":
        cells = [draw(GOOD_AZURE_TIME if good else AZURE_TIME), draw(number), draw(number)]
        return fmt, "a.csv", "\n".join([AZURE_HEADER, AZURE_FIRST,
                                        ",".join(map(csv_cell, cells))]) + "\n"
    cells = [draw(st.floats(0, 1e6).map(repr) if good else CELL_NUMBER), "GPT-4", draw(number),
             draw(number), "1", "API log"]
    return fmt, "b.csv", "\n".join([BURST_HEADER, BURST_FIRST,
                                    ",".join(map(csv_cell, cells))]) + "\n"


@cache
def replay_scenario() -> Scenario:
    return scenario()


def field_names(fmt: str, text: str) -> list[str]:
    if fmt in NAMES:
        return list(NAMES[fmt])
    row = json.loads(text.splitlines()[1])
    return [*row, *FIELDS[fmt], "input_length", "output_length", "output_tokens"]


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(case=rows(), gz=st.booleans())
def test_fuzzed_trace_rows_are_refused_by_line_or_replay(case, gz):
    import gzip

    fmt, name, text = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / (name + (".gz" if gz else ""))
        data = text.encode()
        path.write_bytes(gzip.compress(data) if gz else data)
        try:
            trace = load_trace(path, fmt)
        except InputError as e:
            msg = str(e)
            assert "\n" not in msg, msg
            row_line = 3 if fmt in NAMES else 2  # the fuzzed row (CSV: after the header)
            assert msg.startswith(f"{path}: line {row_line}: "), msg
            assert any(n in msg for n in field_names(fmt, text)), msg
            event(f"{fmt}: refused")
            return
    assert len(trace) in (1, 2)  # (burstgpt skips a row with 0 tokens)
    res, summary = replay_scenario().run_summary(trace, "diffkv")
    assert summary["completed"] + summary["rejected"] == len(trace)
    event(f"{fmt}: replayed")
