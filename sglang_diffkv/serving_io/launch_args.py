"""The options of an SGLang ``launch_server`` command as a run records it (the bench's
results.json ``command``, a P/D file's server ``command``, or the argv the bench launched):
``--flag value``, ``--flag=value`` and bare ``--flag`` (``"True"``), keyed by their
ServerArgs names (``--tp-size`` -> ``tp_size``). A flag given twice keeps its last value,
as SGLang's argparse does."""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def launch_args(command: str | Sequence[str]) -> dict[str, str]:
    """``--flag`` options of ``command`` (a shell line or an argv list) by ServerArgs name."""
    if isinstance(command, str):
        try:
            toks = shlex.split(command)
        except ValueError:  # an unbalanced quote (a hand-edited record): plain words
            toks = command.split()
    else:
        toks = list(command)
    out: dict[str, str] = {}
    for i, t in enumerate(toks):
        if not t.startswith("--"):
            continue
        flag, eq, value = t[2:].partition("=")
        name = flag.replace("-", "_")
        if eq:
            out[name] = value
            continue
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        out[name] = nxt if nxt is not None and not nxt.startswith("--") else "True"
    return out
