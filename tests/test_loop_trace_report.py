"""sglang_diffkv.bench.loop_trace_report on hand-built loop traces with hand-computed numbers."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from sglang_diffkv.bench import loop_trace_report as ltr
from sglang_diffkv.bench.loop_records import Mode, Phase

EXT, DEC = int(Mode.EXTEND), int(Mode.DECODE)


class Trace:
    """Loop-trace rows written the way LoopRecorder.flush writes them; times in ms."""

    def __init__(self, offset: float = 0.0) -> None:
        self.rows: list[dict] = [{"pid": 1, "wall_minus_perf": offset}]
        self.base = 0.0

    def segment(self, base_s: float) -> Trace:
        self.base = base_s
        return self

    def rec(self, p: Phase, t0: float, t1: float, m: int = 0, n: int = 0, tok: int = 0,
            w: float = 0.0, rids: tuple[str, ...] = ()) -> None:
        row: dict = {"p": int(p), "t0": self.base + t0 / 1e3, "t1": self.base + t1 / 1e3,
                     "m": m, "n": n, "tok": tok}
        if w:
            row["w"] = w / 1e3
        if rids:
            row["rids"] = list(rids)
        self.rows.append(row)

    def it(self, t: float, mode: int, run_ms: float, *, tok: int = 1, n: int = 1,
           next_ms: float = 1.0, recv: tuple[str, ...] = (), result: int | None = None,
           result_ms: float = 0.0, wait_ms: float = 0.0, finish: tuple[str, ...] = ()) -> None:
        """One iteration from ``t`` ms: RECV [t, t+1], INPUT [t+1, t+2] of ``recv``, NEXT,
        RUN [t+2+next_ms, +run_ms] (an extend launches ``recv``), optionally RESULT (of a
        ``result`` batch finishing ``finish``) for ``result_ms`` from the run's end, SAMPLE
        for 1 ms after."""
        self.rec(Phase.RECV, t, t + 1, n=len(recv))
        if recv:
            self.rec(Phase.INPUT, t + 1, t + 2, n=len(recv), rids=recv)
        r0 = t + 2 + next_ms
        self.rec(Phase.NEXT, t + 2, r0, mode, n, tok)
        r1 = r0 + run_ms
        self.rec(Phase.RUN, r0, r1, mode, n, tok, rids=recv if mode == EXT else ())
        end = r1
        if result is not None:
            end = r1 + result_ms
            self.rec(Phase.RESULT, r1, end, result, len(finish) or 1, 0, wait_ms,
                     finish if result == EXT else ())
        self.rec(Phase.SAMPLE, end, end + 1)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        return path


def trace_a() -> Trace:
    tr = Trace(0.0)
    # kept segment 0, from 100 s (the label's first record)
    tr.segment(100.0)
    tr.it(0, EXT, 4, tok=1, recv=("a1",))                        # 1-token 4 ms; queue 1
    tr.it(10, DEC, 2, result=EXT, result_ms=6, wait_ms=5, finish=("a1",))   # step 21-3=18
    tr.it(30, EXT, 6, tok=2, next_ms=4, recv=("a2",), result=DEC, result_ms=3,
          wait_ms=2)                                             # 1-token 6 ms; queue 36-32=4
    tr.it(50, DEC, 3, result=EXT, result_ms=10, wait_ms=8, finish=("a2",))  # step 66-36=30
    tr.it(70, EXT, 100, tok=512, recv=("a3",), result=DEC, result_ms=2,
          wait_ms=1)                                             # not 1-token; queue 1
    tr.it(180, DEC, 4, result=EXT, result_ms=10, wait_ms=9, finish=("a3",))  # step 197-73
    tr.it(200, DEC, 2, result=DEC, result_ms=5, wait_ms=4)       # ends 211 ms
    # a 5 ms segment at 101 s: below --min-s, not numbered
    tr.segment(101.0)
    tr.it(0, EXT, 1, tok=1, recv=("short",))
    # kept segment 1, from 102 s
    tr.segment(102.0)
    tr.it(0, EXT, 8, tok=2, n=2, recv=("a4", "a5"))              # 1-token 8 ms; queue 1, 1
    tr.it(20, DEC, 3, n=2, result=EXT, result_ms=14, wait_ms=12, finish=("a4", "a5"))  # 37
    tr.it(50, EXT, 10, tok=1, next_ms=5, recv=("a6",), result=DEC, result_ms=3,
          wait_ms=2)                                             # 1-token 10 ms; queue 5
    tr.it(80, DEC, 5, result=EXT, result_ms=12, wait_ms=10, finish=("a6",))  # step 100-57
    tr.it(110, DEC, 3, result=DEC, result_ms=4, wait_ms=3)       # ends 121 ms
    return tr


def trace_b_first(tr: Trace) -> Trace:
    tr.segment(50.0)
    tr.it(0, EXT, 5, tok=1, recv=("b1",))                        # 1-token 5; queue 1
    tr.it(10, DEC, 2, result=EXT, result_ms=10, wait_ms=7, finish=("b1",))  # step 25-3=22
    tr.it(30, EXT, 7, tok=2, recv=("b2",), result=DEC, result_ms=2, wait_ms=1)  # 7; queue 1
    tr.it(50, EXT, 12, tok=1, next_ms=3, recv=("b3",), result=EXT, result_ms=3, wait_ms=2,
          finish=("b2",))                                        # 12; queue 3; b2 step 70-33
    tr.it(80, EXT, 50, tok=300, recv=("b4",), result=EXT, result_ms=7, wait_ms=5,
          finish=("b3",))                                        # not 1-token; b3 step 140-55
    tr.it(150, DEC, 4, result=EXT, result_ms=13, wait_ms=11, finish=("b4",))  # b4 170-83
    return tr                                                    # ends 171 ms


def trace_b() -> Trace:
    tr = trace_b_first(Trace(1000.0))
    tr.segment(53.0)
    tr.it(0, EXT, 6, tok=2, recv=("b5",))                        # 1-token 6; queue 1
    tr.it(20, DEC, 3, result=EXT, result_ms=10, wait_ms=9, finish=("b5",))  # step 36-3=33
    tr.it(40, DEC, 3, result=DEC, result_ms=4, wait_ms=2)
    tr.it(60, DEC, 6, result=DEC, result_ms=11, wait_ms=10)
    tr.it(100, DEC, 3, result=DEC, result_ms=4, wait_ms=1)       # ends 111 ms
    return tr


def trace_c() -> Trace:
    """One segment, no one-token extend."""
    tr = Trace(0.0).segment(10.0)
    tr.it(0, EXT, 20, tok=64, recv=("c1",))                      # queue 1
    tr.it(30, DEC, 2, result=EXT, result_ms=10, wait_ms=8, finish=("c1",))  # step 45-3=42
    tr.it(50, DEC, 2, result=DEC, result_ms=45, wait_ms=40)      # ends 101 ms
    return tr


def _row(rows: list[dict], label: str, segment: int) -> dict:
    (row,) = [r for r in rows if r["label"] == label and r["segment"] == segment]
    return row


A0 = {"start_s": 0.0, "duration_s": 0.211, "prefills": 3,
      "queue_median_ms": 1.0, "queue_mean_ms": 2.0,
      "step_median_ms": 30.0, "step_mean_ms": 172 / 3,
      "extend_iterations": 3, "one_token_n": 2,
      "one_token_p10_ms": 4.2, "one_token_median_ms": 5.0, "one_token_mean_ms": 5.0,
      "decode_iterations": 4, "decode_wall_ms": 71 / 4, "decode_wait_ms": 26 / 4,
      "decode_run_ms": 11 / 4}
A1 = {"start_s": 2.0, "duration_s": 0.121, "prefills": 3,
      "queue_median_ms": 1.0, "queue_mean_ms": 7 / 3,
      "step_median_ms": 37.0, "step_mean_ms": 39.0,
      "extend_iterations": 2, "one_token_n": 2,
      "one_token_p10_ms": 8.2, "one_token_median_ms": 9.0, "one_token_mean_ms": 9.0,
      "decode_iterations": 3, "decode_wall_ms": 71 / 3, "decode_wait_ms": 25 / 3,
      "decode_run_ms": 11 / 3}
B0 = {"start_s": 0.0, "duration_s": 0.171, "prefills": 4,
      "queue_median_ms": 1.0, "queue_mean_ms": 1.5,
      "step_median_ms": 61.0, "step_mean_ms": 57.75,
      "extend_iterations": 4, "one_token_n": 3,
      "one_token_p10_ms": 5.4, "one_token_median_ms": 7.0, "one_token_mean_ms": 8.0,
      "decode_iterations": 2, "decode_wall_ms": 20.5, "decode_wait_ms": 9.0,
      "decode_run_ms": 3.0}
B1 = {"start_s": 3.0, "duration_s": 0.111, "prefills": 1,
      "queue_median_ms": 1.0, "queue_mean_ms": 1.0,
      "step_median_ms": 33.0, "step_mean_ms": 33.0,
      "extend_iterations": 1, "one_token_n": 1,
      "one_token_p10_ms": 6.0, "one_token_median_ms": 6.0, "one_token_mean_ms": 6.0,
      "decode_iterations": 4, "decode_wall_ms": 91 / 4, "decode_wait_ms": 22 / 4,
      "decode_run_ms": 15 / 4}
C0 = {"start_s": 0.0, "duration_s": 0.101, "prefills": 1,
      "queue_median_ms": 1.0, "queue_mean_ms": 1.0,
      "step_median_ms": 42.0, "step_mean_ms": 42.0,
      "extend_iterations": 1, "one_token_n": 0,
      "one_token_p10_ms": None, "one_token_median_ms": None, "one_token_mean_ms": None,
      "decode_iterations": 2, "decode_wall_ms": 35.5, "decode_wait_ms": 24.0,
      "decode_run_ms": 2.0}


def _check(row: dict, want: dict) -> None:
    for k, v in want.items():
        if v is None or isinstance(v, int):
            assert row[k] == v, k
            assert type(row[k]) is type(v), k
        else:
            assert row[k] == pytest.approx(v, abs=1e-6), k


def test_report_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_dir = tmp_path / "fp8"
    trace_a().write(a_dir / "loop-11.jsonl")
    (a_dir / "notes.txt").write_text("not a trace\n")
    b = trace_b().write(tmp_path / "bf16" / "loop-22.jsonl")
    c = trace_c().write(tmp_path / "c" / "loop-33.jsonl")
    out = tmp_path / "out" / "report.json"
    rc = ltr.main([f"fp8={a_dir}", f"bf16={b}", f"nocache={c}", "--min-s", "0.1",
                   "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["gap_s"] == 0.3 and got["min_s"] == 0.1
    rows = got["segments"]
    assert [(r["label"], r["segment"]) for r in rows] == [
        ("fp8", 0), ("fp8", 1), ("bf16", 0), ("bf16", 1), ("nocache", 0)]
    for (label, seg), want in {("fp8", 0): A0, ("fp8", 1): A1, ("bf16", 0): B0,
                               ("bf16", 1): B1, ("nocache", 0): C0}.items():
        _check(_row(rows, label, seg), want)

    cmp = got["comparison"]
    assert [(r["label"], r["base"], r["segment"]) for r in cmp] == [
        ("bf16", "fp8", 0), ("bf16", "fp8", 1), ("nocache", "fp8", 0)]
    assert [(r["one_token_n"], r["base_one_token_n"]) for r in cmp] == [(3, 2), (1, 2), (0, 2)]
    assert cmp[0]["d_one_token_median_ms"] == pytest.approx(7 - 5, abs=1e-6)
    assert cmp[0]["d_one_token_mean_ms"] == pytest.approx(8 - 5, abs=1e-6)
    assert cmp[1]["d_one_token_median_ms"] == pytest.approx(6 - 9, abs=1e-6)
    assert cmp[1]["d_one_token_mean_ms"] == pytest.approx(6 - 9, abs=1e-6)
    assert cmp[2]["d_one_token_median_ms"] is None
    assert cmp[2]["d_one_token_mean_ms"] is None

    text = capsys.readouterr().out
    lines = text.splitlines()
    for label in ("fp8", "bf16", "nocache"):
        assert any(line.startswith(label) for line in lines), label
    nocache = [line for line in lines if line.startswith("nocache")]
    assert len(nocache) == 2  # its segment row and its comparison row
    assert "-/-/-" in nocache[0]
    assert nocache[1].split()[-2:] == ["-", "-"]
    bf16_cmp = [line for line in lines if line.startswith("bf16") and " fp8 " in line]
    assert [line.split()[-2:] for line in bf16_cmp] == [["+2.00", "+3.00"], ["-3.00", "-3.00"]]
    assert sum(line.startswith("seg: ") for line in lines) == 1
    assert sum(line.startswith("d median/mean ms: ") for line in lines) == 1


def test_single_label_has_no_comparison(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    a = trace_a().write(tmp_path / "loop-1.jsonl")
    out = tmp_path / "r.json"
    assert ltr.main([f"only={a}", "--min-s", "0.1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["segment"] for r in got["segments"]] == [0, 1]
    assert got["comparison"] == []
    text = capsys.readouterr().out
    assert "d median/mean ms" not in text
    assert text.splitlines()[2].startswith("only")


def test_gap_and_min_s_options(tmp_path: Path) -> None:
    a = trace_a().write(tmp_path / "loop-1.jsonl")
    recs = ltr.read_loop_trace(a)
    # gaps of 0.79 s and 0.99 s: a 1.5 s gap keeps all of it as one segment
    (one,) = ltr.segment_rows(recs, "a", gap_s=1.5, min_s=0.1)
    assert one["duration_s"] == pytest.approx(2.121, abs=1e-6)
    assert one["one_token_n"] == 5  # 4, 6, the short segment's 1, 8, 10 ms
    assert one["one_token_median_ms"] == pytest.approx(6.0, abs=1e-6)
    # the default --min-s of 5 s leaves nothing; min_s 0 keeps the short one as segment 1
    assert ltr.segment_rows(recs, "a", gap_s=0.3, min_s=5.0) == []
    rows = ltr.segment_rows(recs, "a", gap_s=0.3, min_s=0.0)
    assert [(r["segment"], r["one_token_n"]) for r in rows] == [(0, 2), (1, 1), (2, 2)]
    assert rows[1]["start_s"] == pytest.approx(1.0, abs=1e-6)


def test_several_files_in_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace_a().write(tmp_path / "x" / "loop-5.jsonl")
    trace_b_first(Trace(30.0)).write(tmp_path / "x" / "loop-7.jsonl")  # starts at 80 s
    out = tmp_path / "r.json"
    assert ltr.main([f"x={tmp_path / 'x'}", "--min-s", "0.1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["segments"]
    assert [(Path(r["file"]).name, r["part"], r["segment"]) for r in rows] == [
        ("loop-5.jsonl", 0, 0), ("loop-5.jsonl", 0, 1), ("loop-7.jsonl", 1, 0)]
    # start times count from the label's first record over its files: 80 s
    assert [r["start_s"] for r in rows] == pytest.approx([20.0, 22.0, 0.0], abs=1e-6)
    text = capsys.readouterr().out
    assert "x:loop-5" in text and "x:loop-7" in text


def test_percentile_helpers() -> None:
    assert ltr.percentile([], 10) is None
    assert ltr.median([]) is None and ltr.mean([]) is None
    assert ltr.percentile([7.0], 10) == 7.0
    assert ltr.percentile([30.0, 10.0, 20.0, 40.0], 10) == pytest.approx(13.0)
    assert ltr.percentile([30.0, 10.0, 20.0, 40.0], 50) == pytest.approx(25.0)


def test_missing_path_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = trace_a().write(tmp_path / "loop-1.jsonl")
    missing = tmp_path / "nowhere"
    assert ltr.main([f"a={a}", f"b={missing}"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such file or folder" in err


def test_folder_without_traces_is_an_error(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "server.log").write_text("no trace here\n")
    assert ltr.main([f"a={empty}"]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "no loop-*.jsonl" in err


def test_bad_trace_line_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "loop-3.jsonl"
    bad.write_text('{"pid": 1, "wall_minus_perf": 0.0}\n{"p": 3, "t0": 1.0}\n')
    assert ltr.main([f"a={bad}"]) == 2
    assert f"{bad}:2" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["fp8", "=/tmp/x", "fp8="])
def test_bad_label_path_is_an_argparse_error(bad: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    good = trace_a().write(tmp_path / "loop-1.jsonl")
    with pytest.raises(SystemExit) as e:
        ltr.main([f"ok={good}", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert repr(bad) in err and "LABEL=PATH" in err


def test_duplicate_label_is_an_argparse_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    good = trace_a().write(tmp_path / "loop-1.jsonl")
    with pytest.raises(SystemExit) as e:
        ltr.main([f"a={good}", f"a={good}"])
    assert e.value.code == 2
    assert "more than once: a" in capsys.readouterr().err


def _last_run(tr: Trace) -> dict:
    return next(r for r in reversed(tr.rows) if r.get("p") == int(Phase.RUN))


def _bench_folder(root: Path, name: str, run_ms: tuple[float, float], store_ms: float) -> Path:
    """A bench_e2e.py result folder: two runs (ladder@6rps at 1000 s, ladder@10rps at 1010 s)
    and a loop trace whose one-token extends carry a kv_store span."""
    folder = root / name
    tr = Trace(0.0)
    for start, run in zip((1000.0, 1010.0), run_ms, strict=True):
        tr.segment(start)
        tr.it(0.0, EXT, run, recv=("a",))
        _last_run(tr)["x"] = {"kv_store": store_ms / 1e3, "runner_extend": run * 0.9 / 1e3}
        tr.it(20.0, EXT, run + 2.0, recv=("b",), result=EXT, finish=("a",))
        _last_run(tr)["x"] = {"kv_store": (store_ms + 1.0) / 1e3}
        tr.it(50.0, DEC, 3.0, result=EXT, finish=("b",))
    tr.write(folder / "loop" / "loop-7.jsonl")
    runs = [{"config": name, "label": label, "wall_start_unix": t0,
             "client": {"duration": 8.0}}
            for label, t0 in (("ladder@6rps", 1000.0), ("ladder@10rps", 1010.0))]
    (folder / "results.json").write_text(json.dumps({"runs": runs}))
    return folder


def test_bench_result_folder_segments_by_run_and_means_the_spans(tmp_path: Path) -> None:
    fp8 = _bench_folder(tmp_path, "fp8", (10.0, 14.0), 2.0)
    bf16 = _bench_folder(tmp_path, "bf16", (8.0, 9.0), 1.0)
    out = tmp_path / "r.json"
    assert ltr.main([f"fp8={fp8}", f"bf16={bf16}", "--min-s", "0", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    rows = got["segments"]
    assert [(r["label"], r["segment"]) for r in rows] == [
        ("fp8", "ladder@6rps"), ("fp8", "ladder@10rps"),
        ("bf16", "ladder@6rps"), ("bf16", "ladder@10rps")]
    first = rows[0]
    assert first["one_token_n"] == 2
    assert first["one_token_mean_ms"] == pytest.approx(11.0)  # 10 and 12 ms
    # kv_store 2 and 3 ms; runner_extend only on the first extend: (9 + 0) / 2
    assert first["one_token_spans_ms"] == pytest.approx({"kv_store": 2.5, "runner_extend": 4.5})
    cmp = {r["segment"]: r for r in got["comparison"]}
    assert cmp["ladder@6rps"]["d_one_token_mean_ms"] == pytest.approx(9.0 - 11.0)
    assert cmp["ladder@10rps"]["d_one_token_mean_ms"] == pytest.approx(10.0 - 15.0)


def test_ladder_one_prompt_launches_pool_by_configuration_across_folders(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _bench_folder(tmp_path / "a", "bf16", (10.0, 14.0), 2.0)   # extends 10, 12, 14, 16 ms
    b = _bench_folder(tmp_path / "b", "bf16", (8.0, 9.0), 1.0)     # 8, 10, 9, 11 ms
    c = _bench_folder(tmp_path / "c", "fp8", (20.0, 30.0), 1.0)    # 20, 22, 30, 32 ms
    # c's first extend batches two prompts: not a one-prompt launch
    loop = c / "loop" / "loop-7.jsonl"
    rows = [json.loads(line) for line in loop.read_text().splitlines()]
    first = next(r for r in rows if r.get("p") == int(Phase.RUN) and r.get("m") == EXT)
    first["n"] = 2
    loop.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert ltr.main([f"a={a}", f"b={b}", f"c={c}", "--min-s", "0", "--json", str(out)]) == 0
    got = {r["config"]: r for r in json.loads(out.read_text())["one_prompt_launches"]}
    assert got["bf16"]["n"] == 8
    assert got["bf16"]["mean_ms"] == pytest.approx((10 + 12 + 14 + 16 + 8 + 10 + 9 + 11) / 8)
    assert got["bf16"]["median_ms"] == pytest.approx(10.5)
    assert got["fp8"]["n"] == 3
    assert got["fp8"]["mean_ms"] == pytest.approx((22 + 30 + 32) / 3)
    printed = capsys.readouterr().out
    assert "fp8         3    28.00" in printed


def test_a_results_file_that_does_not_read_is_an_error(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    folder = _bench_folder(tmp_path, "x", (10.0, 14.0), 2.0)
    (folder / "results.json").write_text(json.dumps({"runs": [{"label": "a"}]}))
    assert ltr.main([f"x={folder}"]) == 2
    assert "not a bench_e2e.py results file" in capsys.readouterr().err


def _client_log(folder: Path, files: dict[str, str]) -> None:
    """logs.tar.gz holding logs/NAME (gzipped TEXT) for each NAME: TEXT."""
    with tarfile.open(folder / "logs.tar.gz", "w:gz") as tar:
        for name, text in files.items():
            data = gzip.compress(text.encode())
            info = tarfile.TarInfo(f"logs/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _req(send_ms: float, first_ms: float | None) -> str:
    return json.dumps({"send_s": send_ms / 1e3,
                       "first_token_s": None if first_ms is None else first_ms / 1e3}) + "\n"


def test_client_ttft_is_split_at_the_schedulers_receipt_launch_and_stream(tmp_path: Path) -> None:
    # ladder@6rps from 1000 s, one-token extends of 10 and 12 ms: request a is received at
    # 2 ms, launched at 3, streamed at 23 + 12 = 35 (with b's launch); b received at 22,
    # launched at 23, streamed at 56 (the decode iteration's result)
    fp8 = _bench_folder(tmp_path, "fp8", (10.0, 14.0), 2.0)
    _client_log(fp8, {"requests__fp8__ladder@6rps.jsonl.gz":
                      _req(0.5, 35.7) + _req(20.0, 56.4) + _req(30.0, None)})
    out = tmp_path / "r.json"
    assert ltr.main([f"fp8={fp8}", "--min-s", "0", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["ttft_split"]  # ladder@10rps has no client file
    assert (row["label"], row["run"], row["client_n"], row["joined_n"]) == (
        "fp8", "ladder@6rps", 2, 2)
    want = {"ttft": (35.2, 36.4), "pre": (1.5, 2.0), "queue": (1.0, 1.0),
            "step": (32.0, 33.0), "post": (0.7, 0.4)}
    for k, (a, b) in want.items():
        assert row[f"{k}_mean_ms"] == pytest.approx((a + b) / 2, abs=1e-6), k
        assert row[f"{k}_median_ms"] == pytest.approx((a + b) / 2, abs=1e-6), k
    # the parts add up to the client's TTFT
    assert sum(row[f"{k}_mean_ms"] for k in ("pre", "queue", "step", "post")) == pytest.approx(
        row["ttft_mean_ms"])


def test_the_poll_wait_comes_off_pre_and_the_first_token_latency_pools_by_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # ladder@6rps from 1000 s; iterations (wall ms): 100 (10), 110 (10), 120 (the loop idles
    # to 500: its records cover 6 of 380 ms, left out), 500 (20), 520 (the last: untimed).
    # The poll wait: (10^2 + 10^2 + 20^2) / (2 * 40) = 7.5 ms
    tr = Trace(0.0).segment(1000.0)
    tr.it(100.0, EXT, 4.0, recv=("a",))
    tr.it(110.0, DEC, 3.0, result=EXT, finish=("a",))
    tr.it(120.0, DEC, 3.0)
    tr.it(500.0, EXT, 16.0, recv=("b",))
    tr.it(520.0, DEC, 3.0, result=EXT, finish=("b",))
    seg = ltr.read_loop_trace(tr.write(tmp_path / "x.jsonl"))
    assert ltr.poll_wait_s(seg) == pytest.approx(7.5e-3)
    # a burst run from 1010 s: all its requests arrive at once, so no poll wait is taken
    tr.segment(1010.0).it(0.0, EXT, 8.0, recv=("c",))
    tr.it(10.0, DEC, 3.0, result=EXT, finish=("c",))
    folder = tmp_path / "bf16"
    tr.write(folder / "loop" / "loop-3.jsonl")
    runs = [{"config": "bf16", "label": label, "wall_start_unix": t0,
             "client": {"duration": 5.0}}
            for label, t0 in (("ladder@6rps", 1000.0), ("sharegpt", 1010.0))]
    (folder / "results.json").write_text(json.dumps({"runs": runs}))
    # a: received 102, streamed 116; b: received 502, streamed 526 (ms after the run's start)
    _client_log(folder, {"requests__bf16__ladder@6rps.jsonl.gz": _req(90.0, 116.6)
                         + _req(494.0, 526.4),
                         "requests__bf16__sharegpt.jsonl.gz": _req(0.0, 17.0)})
    out = tmp_path / "r.json"
    assert ltr.main([f"x={folder}", "--min-s", "0", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    ladder, burst = got["ttft_split"]
    assert ladder["pre_mean_ms"] == pytest.approx(10.0)        # 12 and 8
    assert ladder["post_mean_ms"] == pytest.approx(0.5)        # 0.6 and 0.4
    assert ladder["poll_wait_ms"] == pytest.approx(7.5)
    assert ladder["first_token_ms"] == pytest.approx(10.0 - 7.5 + 0.5)
    assert burst["poll_wait_ms"] is None and burst["first_token_ms"] is None
    (pooled,) = got["one_prompt_launches"]
    assert (pooled["config"], pooled["n"], pooled["first_token_n"]) == ("bf16", 2, 2)
    assert pooled["mean_ms"] == pytest.approx(10.0)            # a's 4 ms and b's 16
    assert pooled["first_token_ms"] == pytest.approx(3.0)
    line = capsys.readouterr().out.splitlines()[-2]
    # turnarounds: 116 - 107 and 526 - 519 ms (the burst's extend is no ladder's)
    assert (pooled["turnaround_n"], pooled["turnaround_ms"]) == (2, pytest.approx(8.0))
    assert line.split() == ["bf16", "2", "10.00", "5.2/10.0/14.8", "2", "3.00", "2", "8.00"]


def test_the_turnaround_runs_from_an_extends_launches_to_the_next_launch(
        tmp_path: Path) -> None:
    tr = trace_b_first(Trace(0.0))
    # an extend the loop idles after (an iteration that launches nothing), then a decode
    tr.it(200, EXT, 5, tok=1, recv=("b5",), result=DEC, result_ms=2)   # run 203-208
    tr.rec(Phase.RECV, 230, 231)
    tr.it(240, DEC, 3, result=EXT, finish=("b5",))                      # run 243-246
    seg = ltr.read_loop_trace(tr.write(tmp_path / "b.jsonl"))
    # E->D to the decode's graph launch (its run's end): 15 - 8 and 157 - 133; E->E to the
    # next extend's first launch (its run's start): 55 - 40 and 83 - 67; D->E and the
    # extend followed by an idle iteration count nothing
    assert ltr.turnaround_ms(seg) == pytest.approx([7.0, 15.0, 16.0, 24.0])


def test_a_send_after_every_receipt_is_not_joined(tmp_path: Path) -> None:
    fp8 = _bench_folder(tmp_path, "fp8", (10.0, 14.0), 2.0)
    _client_log(fp8, {"requests__fp8__ladder@6rps.jsonl.gz": _req(0.5, 35.7) + _req(25.0, 60.0)})
    rows, splits, *_ = ltr.report_rows([("fp8", str(fp8))], 0.3, 0.0)
    assert rows and [(s["client_n"], s["joined_n"]) for s in splits] == [(2, 1)]
    assert splits[0]["pre_mean_ms"] == pytest.approx(1.5)


def test_a_bad_client_record_is_named_with_its_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fp8 = _bench_folder(tmp_path, "fp8", (10.0, 14.0), 2.0)
    _client_log(fp8, {"requests__fp8__ladder@6rps.jsonl.gz": _req(0.5, 35.7) + "{not json\n"})
    assert ltr.main([f"fp8={fp8}"]) == 2
    err = capsys.readouterr().err
    assert "requests__fp8__ladder@6rps.jsonl.gz:2: bad request record" in err


def test_graph_max_bs_times_the_decode_iterations_either_side_of_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tr = Trace(0.0).segment(50.0)
    t = 0.0
    # (batch, iteration ms): graphed edge (6.4, 8], eager edge (8, 10], and outside both
    for b, ms in ((6, 99.0), (7, 20.0), (8, 22.0), (8, 24.0), (9, 31.0), (10, 35.0),
                  (10, 33.0), (11, 99.0), (40, 99.0)):
        tr.it(t, DEC, 2, n=b)
        t += ms
    tr.it(t, EXT, 4, recv=("x",))         # the last iteration ends the one before it
    path = tr.write(tmp_path / "loop-1.jsonl")
    rc = ltr.main([f"a={path}", "--min-s", "0", "--graph-max-bs", "8",
                   "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["segments"]
    assert (row["graphed_edge_n"], row["eager_edge_n"]) == (3, 3)
    assert row["graphed_edge_median_ms"] == pytest.approx(22.0)
    assert row["eager_edge_median_ms"] == pytest.approx(33.0)
    out = capsys.readouterr().out
    assert "eager - graphed" in out and "+11.00" in out
    # without the option there is no such table or number
    ltr.main([f"a={path}", "--min-s", "0", "--json", str(tmp_path / "s.json")])
    (plain,) = json.loads((tmp_path / "s.json").read_text())["segments"]
    assert "eager_edge_n" not in plain and "eager - graphed" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ltr.main([f"a={path}", "--graph-max-bs", "0"])
    assert "--graph-max-bs 0: want the servers' cuda_graph_max_bs" in capsys.readouterr().err


def test_graph_max_bs_fits_the_eager_host_iteration_as_a_line_in_the_batch(
        tmp_path: Path) -> None:
    """Eager iterations (batch above N = 64) whose walls follow 12 ms + 40 us per request,
    with one iteration in every band of seven 60 ms slower (a garbage collection): the line
    runs through the band means, the slow iterations' time included."""
    rng = np.random.default_rng(7)
    tr = Trace(0.0).segment(20.0)
    t = 0.0
    for band in range(4):                    # N / HOST_BANDS = 16 requests a band
        for i in range(7):
            b = int(65 + 16 * band + rng.integers(0, 16))
            ms = 12.0 + 0.040 * b + (60.0 if i == 3 else rng.uniform(-0.05, 0.05))
            tr.it(t, DEC, 2, n=b)
            t += ms
    for b in (60, 64, 30):                  # graphed: not on the line
        tr.it(t, DEC, 2, n=b)
        t += 90.0
    tr.it(t, EXT, 4, recv=("x",))
    path = tr.write(tmp_path / "loop-1.jsonl")
    assert ltr.main([f"a={path}", "--min-s", "0", "--graph-max-bs", "64",
                     "--json", str(tmp_path / "r.json")]) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["segments"]
    assert row["eager_host_bands"] == 4
    assert row["eager_host_base_ms"] == pytest.approx(12.0 + 60.0 / 7, abs=0.3)
    assert row["eager_host_per_req_us"] == pytest.approx(40.0, rel=0.05)


def test_the_eager_host_line_needs_two_bands(tmp_path: Path) -> None:
    tr = Trace(0.0).segment(0.0)
    t = 0.0
    for _ in range(ltr.HOST_BAND_MIN):
        tr.it(t, DEC, 2, n=70)
        t += 30.0
    for _ in range(ltr.HOST_BAND_MIN - 1):    # a second band one iteration short
        tr.it(t, DEC, 2, n=90)
        t += 35.0
    tr.it(t, EXT, 4)
    recs = ltr.read_loop_trace(tr.write(tmp_path / "loop-1.jsonl"))
    line = ltr.eager_host_line(recs, 64)
    assert line == {"eager_host_bands": 1, "eager_host_base_ms": None,
                    "eager_host_per_req_us": None}


def _burst_folder(root: Path, batches: list[int], base_ms: float, per_req_us: float) -> Path:
    """A bench_e2e.py result folder of one diffkv-mix burst whose eager decode iterations
    (batch above 64) last base_ms + per_req_us x batch."""
    tr = Trace(0.0).segment(500.0)
    t = 0.0
    for b in batches:
        tr.it(t, DEC, 2, n=b)
        t += base_ms + per_req_us * b / 1e3
    tr.it(t, EXT, 4, recv=("z",))
    tr.write(root / "loop" / "loop-3.jsonl")
    runs = [{"config": "diffkv-mix", "label": "sharegpt", "wall_start_unix": 500.0,
             "client": {"duration": t / 1e3}}]
    (root / "results.json").write_text(json.dumps({"runs": runs}))
    return root


def test_the_eager_host_line_pools_the_starts_of_a_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One start reaches batches 65-96, another 97-128: neither alone spans the four bands,
    and each alone has its own host; pooled, the line runs through both."""
    low = _burst_folder(tmp_path / "low", [70, 75, 80, 85, 90, 95] * 2, 10.0, 50.0)
    high = _burst_folder(tmp_path / "high", [100, 105, 110, 115, 120, 125] * 2, 10.0, 50.0)
    out = tmp_path / "r.json"
    assert ltr.main([f"low={low}", f"high={high}", "--min-s", "0", "--graph-max-bs", "64",
                     "--json", str(out)]) == 0
    (pooled,) = json.loads(out.read_text())["eager_host_lines"]
    assert (pooled["config"], pooled["n"], pooled["eager_host_bands"]) == ("diffkv-mix", 24, 4)
    assert pooled["eager_host_base_ms"] == pytest.approx(10.0, abs=0.2)
    assert pooled["eager_host_per_req_us"] == pytest.approx(50.0, rel=0.03)
    assert "pooled by server configuration" in capsys.readouterr().out
    # without --graph-max-bs: no pooled line
    assert ltr.main([f"low={low}", "--min-s", "0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["eager_host_lines"] == []


def test_a_gc_pause_is_counted_and_its_requests_leave_the_first_token_latency() -> None:
    from sglang_diffkv.bench.loop_records import RequestTimes

    # (send, received, launched, streamed, client's first token), s; the poll wait 2 ms
    reqs = [(0.0, 0.005, 0.006, 0.030, 0.031),
            (1.0, 1.400, 1.401, 1.420, 1.421),    # sent into a 0.4 s pause: pre 400 ms
            (1.1, 1.402, 1.403, 1.440, 1.441),    # sent inside it too: pre 302 ms
            (0.9, 0.905, 0.906, 1.200, 1.410),    # its first token met the pause on its way out
            (3.0, 3.004, 3.005, 3.030, 3.0305)]
    times = {str(i): RequestTimes(*r[1:4]) for i, r in enumerate(reqs)}
    row = ltr.ttft_split(times, [(r[0], r[4]) for r in reqs], poll_s=0.002)
    assert (row["joined_n"], row["calm_n"], row["pauses"]) == (5, 2, 1)
    assert row["pause_max_ms"] == pytest.approx(410.0)       # 1.0 -> 1.41: one window
    # the calm two: pre 5 and 4 ms, post 1 and 0.5 ms
    assert row["first_token_ms"] == pytest.approx(4.5 - 2.0 + 0.75)
    assert row["first_token_all_ms"] > 100.0
    # a burst's queueing is no pause
    burst = ltr.ttft_split(times, [(r[0], r[4]) for r in reqs])
    assert burst["pauses"] == 0 and burst["first_token_ms"] is None
