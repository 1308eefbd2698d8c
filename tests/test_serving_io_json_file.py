"""sglang_diffkv.serving_io.json_file: every way a JSON file can fail to load is one line of
the caller's error class, naming the file (and the line, for bad JSON)."""

from __future__ import annotations

import pytest

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.serving_io.json_file import parse_json, read_json
from simulator.errors import SimulatorInputError


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_good_file(tmp_path):
    p = tmp_path / "spec.json"
    p.write_text('{"a": [1, 2.5, "caf\u00e9"], "b": null}', encoding="utf-8")
    assert read_json(p, "spec") == {"a": [1, 2.5, "caf\u00e9"], "b": None}
    assert read_json(str(p), "spec") == {"a": [1, 2.5, "caf\u00e9"], "b": None}
    top = tmp_path / "list.json"
    top.write_text("[]")
    assert read_json(top, "spec") == []  # the top-level type is the caller's to check


def test_missing_file_names_what_and_path(tmp_path):
    p = tmp_path / "nope.json"
    with pytest.raises(InputError) as e:
        read_json(p, "model config")
    assert one_line(e) == f"cannot read model config {str(p)!r}: No such file or directory"
    assert isinstance(e.value.__cause__, FileNotFoundError)
    with pytest.raises(InputError, match="cannot read model config"):
        read_json(tmp_path, "model config")  # a directory
    with pytest.raises(InputError, match="cannot read model config") as e:
        read_json(str(tmp_path / "a\0.json"), "model config")  # NUL: ValueError, not OSError
    one_line(e)


def test_invalid_json_gives_line_number(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{\n  "a": 1,\n  "b": oops\n}\n')
    with pytest.raises(InputError) as e:
        read_json(p, "spec")
    assert one_line(e) == f"{p}: line 3: invalid JSON (Expecting value at column 8)"
    p.write_text("")
    with pytest.raises(InputError, match=r"line 1: invalid JSON \(Expecting value at column 1\)"):
        read_json(p, "spec")


def test_not_utf8_deep_and_huge_numbers(tmp_path):
    p = tmp_path / "latin1.json"
    p.write_bytes(b'{\n"name": "caf\xe9"}')
    with pytest.raises(InputError) as e:
        read_json(p, "spec")
    assert f"{p}: line 2: not UTF-8 text (byte 0xe9" in one_line(e)
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError) as e:
        read_json(p, "spec")
    assert one_line(e) == f"{p}: JSON nested too deeply"
    p.write_text('{"n": ' + "9" * 5000 + "}")
    with pytest.raises(InputError) as e:
        read_json(p, "spec")
    assert one_line(e).startswith(f"{p}: invalid JSON (")


def test_error_class_is_passed_through(tmp_path):
    with pytest.raises(SimulatorInputError, match="cannot read mix file"):
        read_json(tmp_path / "nope.json", "mix file", SimulatorInputError)
    p = tmp_path / "bad.json"
    p.write_text("{")
    with pytest.raises(SimulatorInputError, match="line 1: invalid JSON"):
        read_json(p, "mix file", SimulatorInputError)
    with pytest.raises(SimulatorInputError, match=r"^bundled\.json: line 1: invalid JSON"):
        parse_json("[1,", "bundled.json", SimulatorInputError)
    assert parse_json('{"x": 1}', "bundled.json", SimulatorInputError) == {"x": 1}
