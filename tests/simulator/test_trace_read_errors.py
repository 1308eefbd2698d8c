"""Trace files that cannot be read to the end, or hold times no clock has, give one
InputError line with the file and the line; the CLI prints it without a traceback."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.loaders import MAX_TIME_S, load_trace
from simulator.cli import main

ROW = '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"


def write_bytes(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def cases(tmp_path: Path) -> list[tuple[Path, str | None, str, str]]:
    """(file, format, 'line N', what the message says)."""
    many = (ROW * 5000).encode()
    return [
        (write_bytes(tmp_path, "cut.jsonl.gz", gzip.compress(many)[:400]), "mooncake",
         "line ", "truncated .gz"),
        (write_bytes(tmp_path, "plain.jsonl.gz", ROW.encode()), "mooncake", "line 1",
         "not a gzip file"),
        (write_bytes(tmp_path, "bad.jsonl.gz", gzip.compress(many)[:30] + b"\0" * 400),
         "mooncake", "line ", "corrupt"),
        (write_bytes(tmp_path, "latin1.jsonl", (ROW + '{"session_id": "caf\xe9"}\n').encode(
            "latin-1")), "mooncake", "line 2", "not UTF-8 text (byte 0xe9"),
        (write_bytes(tmp_path, "latin1.csv", (AZURE + "2023-11-16 18:15:47,3\xe9,4\n").encode(
            "latin-1")), "azure", "line 3", "not UTF-8"),
        (write_bytes(tmp_path, "wide.csv", (AZURE + '"' + "x" * 140_000 + '",1,1\n').encode()),
         "azure", "line 3", "field larger than field limit"),
        (write_bytes(tmp_path, "deep.jsonl", (ROW + '{"hash_ids": ' + "[" * 100_000
                                               + "]" * 100_000 + "}\n").encode()),
         "mooncake", "line 2", "nested too deeply"),
        (write_bytes(tmp_path, "digits.jsonl", (ROW + '{"input_length": ' + "9" * 5000
                                                 + "}\n").encode()),
         "mooncake", "line 2", "invalid JSON"),
        (write_bytes(tmp_path, "split.csv", (AZURE + '"2023-11-16\n18:17:00",3,4\n').encode()),
         "azure", "line 3", "TIMESTAMP='2023-11-16\\n18:17:00' is not"),
        (write_bytes(tmp_path, "nan.csv", (AZURE + "2023-11-16 18:17:nan,3,4\n").encode()),
         "azure", "line 3", "TIMESTAMP='2023-11-16 18:17:nan' has no such time of day"),
        (write_bytes(tmp_path, "late.csv", (AZURE + "2023-11-16 99:99:99,3,4\n").encode()),
         "azure", "line 3", "HH 00-23, MM 00-59"),
        (write_bytes(tmp_path, "far.csv", (AZURE + "9999-11-16 18:15:46,3,4\n").encode()),
         "azure", "line 3", "from the first row's day"),
        (write_bytes(tmp_path, "t.jsonl", (ROW + '{"timestamp": 1e300, "input_length": 5, '
                                           '"output_length": 2}\n').encode()),
         "mooncake", "line 2", "timestamp=1e+300 must be a number of milliseconds in [0, "),
        (write_bytes(tmp_path, "nan.jsonl", b'{"timestamp": NaN, "input_len": 5, '
                                            b'"output_len": 2}\n'),
         "sglang", "line 1", "timestamp=nan"),
        (write_bytes(tmp_path, "b.csv", b"Timestamp,Model,Request tokens,Response tokens,"
                                        b"Total tokens,Log Type\n1e300,x,1,1,2,API log\n"),
         "burstgpt", "line 2", "Timestamp=1e+300 must be seconds in [0, "),
        (write_bytes(tmp_path, "s.jsonl", (ROW[:-2] + ', "session_id": [1]}\n').encode()),
         "mooncake", "line 1", "session_id=[1] must be a string or an integer"),
    ]


def test_unreadable_files_and_impossible_times_name_file_and_line(tmp_path):
    for path, fmt, line, what in cases(tmp_path):
        for f in (fmt, None):  # given, and guessed from the first line
            try:
                load_trace(path, f)
            except InputError as e:
                msg = str(e)
            else:
                raise AssertionError(f"{path.name} was accepted")
            assert msg.startswith(f"{path}: {line}") and what in msg, msg
            assert "\n" not in msg


def test_the_cli_prints_one_line(tmp_path, capsys):
    path = write_bytes(tmp_path, "cut.jsonl.gz", gzip.compress((ROW * 5000).encode())[:400])
    assert main(["replay", "--trace", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"diffkv-sim: error: {path}: line ") and "\n" not in err
    assert main(["replay", "-n", "5", "--format", "diffkv", "--diffkv-config",
                 '{"window": 100000000000000000000}']) == 2
    err = capsys.readouterr().err.strip()
    assert "window=100000000000000000000 is out of range" in err and "\n" not in err


def test_times_at_the_bound_load(tmp_path):
    ms = MAX_TIME_S * 1000.0
    p = write_bytes(tmp_path, "edge.jsonl", (ROW + f'{{"timestamp": {ms!r}, "input_length": '
                                                   f'5, "output_length": 2}}\n').encode())
    assert load_trace(p).requests[-1].arrival_s == pytest.approx(MAX_TIME_S)
    p = write_bytes(tmp_path, "leap.csv", (AZURE + "2023-11-16 23:59:60.5,3,4\n").encode())
    assert load_trace(p).requests[-1].arrival_s == pytest.approx(86400.5 - 65746.68059)
    bom = write_bytes(tmp_path, "bom.csv", b"\xef\xbb\xbf" + AZURE.encode())
    assert len(load_trace(bom)) == 1
