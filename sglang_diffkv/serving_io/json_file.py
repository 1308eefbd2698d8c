"""Read one JSON file (a spec, a calibration, a run record) with every failure as one line.

The simulator's specs and the bench's and validation's run records are all JSON files a user
names on a command line, so a missing file or a typo in one must come back as one readable
line naming the file (and the line, for bad JSON), never a traceback. Each caller passes the
exception class it raises: ``InputError`` here, ``SimulatorInputError`` in the simulator,
``ConfigError`` for DiffKV config files and inline JSON.

Messages:
  cannot read <what> '<path>': <strerror>          the file cannot be opened or read
  <path>: line N: not UTF-8 text (byte 0x.. ...)   JSON files are UTF-8 (RFC 8259)
  <path>: line N: invalid JSON (<msg> at column C) a syntax error
  <path>: JSON nested too deeply                   past the interpreter's recursion limit
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.errors import InputError
from sglang_diffkv.value_text import short_repr


def parse_json(text: str, where: str, error: type[ValueError] = InputError) -> Any:
    """``json.loads(text)``; a failure raises ``error`` naming ``where`` (a path, or a
    bundled resource's name)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: line {e.lineno}: invalid JSON ({e.msg} at column "
                    f"{e.colno})") from e
    except RecursionError:
        # from None: the chained RecursionError traceback is thousands of frames deep
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # an integer longer than sys.get_int_max_str_digits()
        raise error(f"{where}: invalid JSON ({e})") from e


def read_json(path: str | Path, what: str, error: type[ValueError] = InputError) -> Any:
    """The parsed content of the JSON file ``path``; ``what`` names the file's role in the
    "cannot read" message (e.g. "model config"). Any failure raises ``error``."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        # strerror is None for an OSError raised without an errno
        raise error(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from e
    except ValueError as e:  # e.g. a NUL character in the path
        raise error(f"cannot read {what} {short_repr(str(p))}: {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise error(f"{p}: line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                    f"{e.start})") from e
    return parse_json(text, str(p), error)
