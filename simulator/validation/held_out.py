"""Data kept out of the fit by construction, and its score by load.

A recipe names its fitting runs (``--fit-run``, ``--fit-decode-run``) and, apart, its
held-out runs (``--held-out PATTERN``, shell patterns on run keys ``CONFIG/LABEL``, e.g.
``*/ladder@23.03rps#*``: a load level; ``*#z``: every run of one folder, i.e. one trace).
``held_out_runs`` enforces the split before anything is fitted:

- a pattern that matches no run is refused (a typo would hold nothing out);
- a fitting run that a pattern matches is refused: the fitter never sees a held-out run;
- a held-out run whose exact request file (trace digest) a fitting run replays is refused:
  the same requests at the same times would be fitted under another name.

Each held-out run is then either a **held-out trace** (its request lengths come from a trace
source, ``lengths_from``, that no fitting run draws from) or a **held-out load level** (its
source is fitted, at other rates or request counts). Rows are banded by load: a ladder's
request rate over its server's ShareGPT saturation rate (below 50%, 50-80%, 80% and above),
and ``saturation`` for bursts (every request at t = 0) and partial-window runs.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from simulator.errors import SimulatorInputError
from simulator.validation.harness import HarnessResults, HarnessRun

BANDS = ("< 50%", "50-80%", ">= 80%", "saturation", "load ?")
MID_LOAD = (0.5, 0.8)


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def held_out_runs(h: HarnessResults, patterns: Iterable[str], fitting: Iterable[HarnessRun]
                  ) -> dict[str, str]:
    """{run key: kind} of the held-out runs (kind: ``trace`` or ``load level``), after the
    checks above; ``fitting``: the fitting runs."""
    patterns = list(patterns)
    fitting = list(fitting)
    if not patterns:
        return {}
    keys = [r.key for r in h.runs]
    for p in patterns:
        if not fnmatch.filter(keys, p):
            raise SimulatorInputError(f"--held-out {p!r} matches no run; runs are "
                                      f"{', '.join(keys)}")
    for r in fitting:
        hit = [p for p in patterns if fnmatch.fnmatchcase(r.key, p)]
        if hit:
            raise SimulatorInputError(f"fitting run {r.key} is held out (--held-out {hit[0]}):"
                                      " a held-out run is never fitted")
    fitted_files = {_digest(r.trace_path): r.key for r in fitting}
    fitted_sources = {r.lengths_from for r in fitting}
    out: dict[str, str] = {}
    for r in h.runs:
        if not any(fnmatch.fnmatchcase(r.key, p) for p in patterns):
            continue
        same = fitted_files.get(_digest(r.trace_path))
        if same is not None:
            raise SimulatorInputError(f"held-out run {r.key} replays the request file of "
                                      f"fitting run {same} ({r.trace_path.name}): the fit "
                                      "would see its requests")
        out[r.key] = "load level" if r.lengths_from in fitted_sources else "trace"
    return out


def band(load: float | None, workload: str) -> str:
    """The load band of a row: a ladder's fraction of saturation, else ``saturation``."""
    if workload != "ladder":
        return "saturation"
    if load is None:
        return "load ?"
    if load < MID_LOAD[0]:
        return BANDS[0]
    return BANDS[1] if load < MID_LOAD[1] else BANDS[2]


def score_by_band(rows: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """{band: (PASS, rows with a verdict)} over ``rows`` (each with a ``band``)."""
    out: dict[str, tuple[int, int]] = {}
    for b in BANDS:
        scored = [r for r in rows if r.get("band") == b and r["verdict"] in ("PASS", "MISS")]
        if scored:
            out[b] = (sum(r["verdict"] == "PASS" for r in scored), len(scored))
    return out


def band_table(groups: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: one line per band, PASS / scored for each group of rows (columns)."""
    scores = {name: score_by_band(rows) for name, rows in groups.items()}
    head = "| load | " + " | ".join(groups) + " |"
    lines = [head, "|---|" + "---|" * len(groups)]
    for b in BANDS:
        cells = [f"{s[b][0]} / {s[b][1]}" if b in s else "-" for s in scores.values()]
        if any(c != "-" for c in cells):
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    totals = []
    for rows in groups.values():
        scored = [r for r in rows if r["verdict"] in ("PASS", "MISS")]
        totals.append(f"**{sum(r['verdict'] == 'PASS' for r in scored)} / {len(scored)}**")
    lines.append("| all | " + " | ".join(totals) + " |")
    return "\n".join(lines)
