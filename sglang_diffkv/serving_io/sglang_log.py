"""Parse an SGLang server log: the start-up pool size and the per-batch scheduler lines.

Recognised lines (SGLang 0.5.x, ``scheduler_metrics_mixin``; optional ``[YYYY-MM-DD HH:MM:SS]``
prefix, older ``#token``/``token usage`` and newer ``#full token``/``full token usage`` names):

  ... max_total_num_tokens=409907, chunked_prefill_size=8192, ... max_running_requests=4096 ...
  Prefill batch, #new-seq: 4, #new-token: 2048, #cached-token: 0, token usage: 0.05,
      #running-req: 12, #queue-req: 3, ...
  Decode batch, #running-req: 128, #token: 51234, token usage: 0.12, cuda graph: True,
      gen throughput (token/s): 4567.89, #queue-req: 0, ...

Decode lines appear every ``--decode-log-interval`` (40) decode steps, so they sample the
running batch; their mean is compared with the simulator's decode-step mean.

``gen throughput`` is the decode tokens of the interval since the previous Decode line divided
by the wall time of that interval, which includes any prefill forwards (and idle time) in it.
``decode_intervals`` walks the spans between consecutive Decode lines: each is the interval's
decode steps plus the prefill steps of the Prefill lines inside it, so only those without a
Prefill line measure decode steps alone (``simulator.validation.fit.decode_samples``).
For Prefill lines the new sequences, SGLang's ``input throughput`` (the previous Prefill line's
new tokens over the time between the two lines) and whether the previous scheduler line was a
Prefill line are kept, so back-to-back prefill steps can be timed
(``simulator.validation.fit.prefill_samples``).
Line numbers (1-based) are kept so a fit can name the lines it used.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sglang_diffkv.serving_io.errors import InputError

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_POOL = re.compile(r"max_total_num_tokens=(\d+)")
_MAX_RUNNING = re.compile(r"max_running_requests=(\d+)")
_DECODE = re.compile(
    r"Decode batch, #running-req: (\d+), #(?:full )?token: (\d+), (?:full )?token usage: " + _NUM)
_GEN = re.compile(r"gen throughput \(token/s\): " + _NUM)
_QUEUE = re.compile(r"#queue-req: (\d+)")
_PREFILL = re.compile(
    r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), "
    r"(?:full )?token usage: " + _NUM + r".*?#running-req: (\d+)")
_INPUT = re.compile(r"input throughput \(token/s\): " + _NUM)
_GRAPH = re.compile(r"cuda graph: (True|False)")
_SERVER_ARGS = re.compile(r"server_args=ServerArgs\((.*)\)\s*$")
_ARG = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\[[^\]]*\]|\{[^}]*\}|"
                  r"\w+\([^)]*\)|[^,()\[\]{}]+)")
_RETRACT = re.compile(r"#retracted-req: (\d+)|Retract requests: (\d+)|retract(?:ed)? (\d+) req",
                      re.IGNORECASE)


@dataclass
class ServerLog:
    path: str
    max_total_num_tokens: int | None = None
    max_running_requests: int | None = None
    decode_running: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    decode_usage: list[float] = field(default_factory=list)
    decode_gen_throughput: list[float] = field(default_factory=list)
    decode_line_no: list[int] = field(default_factory=list)
    decode_cuda_graph: list[bool | None] = field(default_factory=list)
    server_args: dict[str, str] = field(default_factory=dict)
    prefill_new_tokens: list[int] = field(default_factory=list)
    prefill_cached_tokens: list[int] = field(default_factory=list)
    prefill_new_seqs: list[int] = field(default_factory=list)
    # SGLang's "input throughput" on Prefill line i: the new tokens of Prefill line i-1 over
    # the wall time between the two lines (nan when the line has none)
    prefill_input_throughput: list[float] = field(default_factory=list)
    # the previous scheduler line (Prefill or Decode) was a Prefill line
    prefill_after_prefill: list[bool] = field(default_factory=list)
    prefill_line_no: list[int] = field(default_factory=list)
    retractions: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        total = sum(self.prefill_new_tokens) + sum(self.prefill_cached_tokens)
        return sum(self.prefill_cached_tokens) / total if total else None


@dataclass(frozen=True)
class DecodeInterval:
    """The span between Decode lines ``index - 1`` and ``index``: ``steps`` decode steps plus
    one prefill step per Prefill line in it (``prefills``: their positions in the log's
    prefill lists)."""

    index: int
    first_line: int
    last_line: int
    running: tuple[int, int]     # the two lines' #running-req
    tokens: float                # mean KV tokens of the two lines
    wall_s: float                # steps * mean batch / the later line's gen throughput
    prefills: range

    @property
    def batch(self) -> float:
        """The interval's decode batch, taken as the mean of its two lines'."""
        return 0.5 * (self.running[0] + self.running[1])


def decode_intervals(log: ServerLog, steps: int, first: int = 1) -> Iterator[DecodeInterval]:
    """The intervals ending at Decode lines ``first``.. that have a wall time (a gen
    throughput and a batch above 0); ``steps``: the server's decode_log_interval."""
    pf = log.prefill_line_no
    for i in range(max(1, first), len(log.decode_running)):
        g = log.decode_gen_throughput[i]
        run = (log.decode_running[i - 1], log.decode_running[i])
        batch = 0.5 * (run[0] + run[1])
        if not (g > 0 and batch > 0):
            continue
        a, b = log.decode_line_no[i - 1], log.decode_line_no[i]
        yield DecodeInterval(i, a, b, run,
                             0.5 * (log.decode_tokens[i - 1] + log.decode_tokens[i]),
                             steps * batch / g,
                             range(bisect.bisect_left(pf, a), bisect.bisect_left(pf, b)))


def parse_server_log(path: str | Path) -> ServerLog:
    p = Path(path)
    try:
        text = p.read_text(errors="replace")
    except OSError as e:
        raise InputError(f"cannot read SGLang log {str(p)!r}: {e.strerror}") from e
    log = ServerLog(str(p))
    after_prefill = False    # the last scheduler line was a Prefill line
    for no, line in enumerate(text.splitlines(), start=1):
        if not log.server_args and (sa := _SERVER_ARGS.search(line)):
            log.server_args = parse_server_args(sa.group(1))
            continue
        if log.max_total_num_tokens is None and (m := _POOL.search(line)):
            log.max_total_num_tokens = int(m.group(1))
            if mr := _MAX_RUNNING.search(line):
                log.max_running_requests = int(mr.group(1))
            continue
        if m := _DECODE.search(line):
            log.decode_running.append(int(m.group(1)))
            log.decode_tokens.append(int(m.group(2)))
            log.decode_usage.append(float(m.group(3)))
            g = _GEN.search(line)
            log.decode_gen_throughput.append(float(g.group(1)) if g else float("nan"))
            log.decode_line_no.append(no)
            cg = _GRAPH.search(line)
            log.decode_cuda_graph.append(None if cg is None else cg.group(1) == "True")
            after_prefill = False
            continue
        if m := _PREFILL.search(line):
            log.prefill_new_seqs.append(int(m.group(1)))
            log.prefill_new_tokens.append(int(m.group(2)))
            log.prefill_cached_tokens.append(int(m.group(3)))
            it = _INPUT.search(line)
            log.prefill_input_throughput.append(float(it.group(1)) if it else float("nan"))
            log.prefill_after_prefill.append(after_prefill)
            log.prefill_line_no.append(no)
            after_prefill = True
            continue
        if m := _RETRACT.search(line):
            log.retractions += int(next(g for g in m.groups() if g is not None))
    if log.max_total_num_tokens is None and not log.decode_running:
        raise InputError(
            f"{p}: no 'max_total_num_tokens=' start-up line and no 'Decode batch' lines; is "
            "this an SGLang server log?")
    return log


def parse_server_args(body: str) -> dict[str, str]:
    """``key=value`` pairs of SGLang's ``server_args=ServerArgs(...)`` start-up line, values as
    written (``'str'``, ``None``, ``True``, numbers); nested values are kept as text."""
    out: dict[str, str] = {}
    for m in _ARG.finditer(body):
        v = m.group(2).strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        out[m.group(1)] = v
    return out
