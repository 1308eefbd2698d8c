"""The served-path quality harness (diffkv-eval served) against two fake servers (the
project's CPU stand-in for SGLang, sglang_diffkv.bench.fakeserver, in its copy-model text
mode): a reference that keeps the whole prompt and a candidate that loses its middle."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest

from sglang_diffkv.bench.fakeserver import fake_logprobs
from sglang_diffkv.eval import data, served, served_tasks
from sglang_diffkv.eval.cli import main

FILLER = data.wikitext(data.PACKAGE_DATA / data.EXCERPT[data.WIKITEXT])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake(forget: str | None = None, context: int | None = None,
          **env: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, **({"FAKE_FORGET": forget} if forget else {}), **env}
    args = ["--context-length", str(context)] if context else []
    srv = subprocess.Popen([sys.executable, "-m", "sglang_diffkv.bench.fakeserver", "--port",
                            str(port), *args], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return srv, f"http://127.0.0.1:{port}"
        except OSError:
            assert srv.poll() is None and time.monotonic() - t0 < 30
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fakes():
    """fakes(name) -> URL: the module's fake servers, each started once, on first use."""
    specs = {
        "ref": {},
        "forget": {"forget": "0.4,0.6"},  # loses the middle fifth of every prompt
        "ref2k": {"context": 2048},
        "ref2k-probe": {"context": 2048, "FAKE_NO_TOKENIZE": "1"},  # no /tokenize: probes
        "short": {"context": 1024},  # a 400 for every prompt over 1024 tokens
        "warm": {"FAKE_LOGIT_T": "5"},  # the same answers, flatter distributions
    }
    running: dict[str, tuple[subprocess.Popen, str]] = {}

    def get(name: str) -> str:
        if name not in running:
            running[name] = _fake(**specs[name])
        return running[name][1]

    yield get
    for srv, _ in running.values():
        srv.terminate()
        srv.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(fakes):
    return fakes("ref"), fakes("forget")


def test_the_harness_finds_what_the_candidate_lost(servers, tmp_path, capsys):
    ref_url, cand_url = servers
    out = tmp_path / "served.json"
    assert main(["served", "--reference", ref_url, "--candidate", cand_url, "--lengths", "300",
                 "--cases", "5", "--tasks", "needle,multikey,vartrack,cwe,continuation",
                 "--out", str(out), "--label", "fake"]) == 0
    res = json.loads(out.read_text())
    rows = {r["task"]: r for r in res["rows"]}
    assert set(rows) == set(served_tasks.TASKS)
    for task in ("needle", "multikey", "vartrack", "cwe"):
        assert rows[task]["reference"]["passed"] == 5, task  # the whole prompt: every answer
    # the needles whose passkey sentence lies wholly in the lost fifth, from the prompts sent
    # (the reference copy model answers with the whole prompt)
    lost = set()
    for a in res["answers"]:
        prompt, key = a["reference"], a["expected"][0] if a["expected"] else ""
        if a["case"].startswith("needle/"):
            first, last = prompt.index(key) / len(prompt), prompt.rindex(key) / len(prompt)
            if 0.4 <= first and last < 0.6:
                lost.add(a["case"])
    assert lost  # (else this run could not tell a harness that misses losses)
    needle = rows["needle"]["candidate"]
    k = 5 - len(lost)
    assert needle["passed"] == k and needle["ci95"] == pytest.approx(served.wilson(k, 5))
    failed = {a["case"] for a in res["answers"] if a["case"].startswith("needle/")
              and a["expected"][0] not in a["candidate"]}
    assert failed == lost
    # the chain of assignments crosses the lost middle from every depth < 0.4
    assert rows["vartrack"]["candidate"]["passed"] < 5
    cont = rows["continuation"]
    assert cont["exact"]["passed"] == 5 and cont["unit"] == "tokens"  # the ends agree
    for a in res["answers"]:  # sized by the reference's own count, within 3 % under 300
        assert 0.97 * 300 <= a["sized_tokens"] <= a["target_tokens"] == 300, a["case"]
    text = capsys.readouterr().out
    assert "| needle | 300 |" in text and "4/5 [" in text


def test_an_unreachable_server_is_one_line(servers, capsys):
    ref_url, _ = servers
    dead = f"http://127.0.0.1:{_free_port()}"
    assert main(["served", "--reference", ref_url, "--candidate", dead, "--lengths", "64",
                 "--cases", "1", "--tasks", "needle", "--out", os.devnull]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffkv-eval served: error: http://127.0.0.1:") and "\n" not in err
    assert main(["served", "--reference", ref_url, "--candidate", ref_url,
                 "--tasks", "needles"]) == 2
    assert "--tasks needles: unknown" in capsys.readouterr().err


def test_wilson_intervals_and_task_prompts():
    assert served.wilson(0, 0) == (0.0, 1.0)
    lo, hi = served.wilson(80, 96)
    # by hand: centre (p + z^2/2n) / (1 + z^2/n) = 0.8205, half-width 0.0742
    assert lo == pytest.approx(0.7463, abs=1e-3) and hi == pytest.approx(0.8947, abs=1e-3)
    assert served.wilson(5, 5)[1] == 1.0 and served.wilson(0, 5)[0] == 0.0
    a = served_tasks.build("multikey", 500, 2, 0.5, FILLER, seed=1)
    assert a == served_tasks.build("multikey", 500, 2, 0.5, FILLER, seed=1)  # seeded
    # each key once, and the question names the asked one again
    assert a.prompt.count("The passkey for") == served_tasks.MULTIKEY_KEYS + 1
    assert abs(len(a.prompt) - 500 * served_tasks.CHARS_PER_TOKEN) < 200
    for task in served_tasks.TASKS:  # resizing keeps the answer
        small, large = (served_tasks.build(task, 500, 1, 0.5, FILLER, chars=n)
                        for n in (1500, 2600))
        assert small.expected == large.expected and len(small.prompt) < len(large.prompt)
    with pytest.raises(ValueError, match="depth=2"):
        served_tasks.build("needle", 500, 0, 2.0, FILLER)


def test_prompts_are_sized_by_the_servers_token_count(fakes, tmp_path):
    """The fake tokenizer counts a digit as a token, so the numbered word list of cwe takes
    about twice the 4-characters-a-token estimate (as SmolLM2's did on the GPU, where the
    first prompt over the context ended the run): sizing by the server's count keeps every
    prompt within 3 % under its length, and under the context less the answer's tokens."""
    ref = fakes("ref2k")
    guess = served_tasks.build("cwe", 2048, 0, 0.0, FILLER)  # sized at 4 characters a token
    (n,) = served.count_tokens(ref, [guess.prompt])
    assert n > 1.6 * 2048 > 2048  # over the 2048-token context: the GPU run's HTTP 400
    assert served.server_limits(ref) == {"context_length": 2048, "max_req_input_len": 2042}
    sized = {}
    for name in ("ref2k", "ref2k-probe"):  # /tokenize, or one-token generations without it
        out = tmp_path / f"{name}.json"
        assert main(["served", "--reference", fakes(name), "--candidate", fakes(name),
                     "--lengths", "1024,2048", "--cases", "2", "--out", str(out)]) == 0
        res = json.loads(out.read_text())
        assert not res["errors"]
        for a in res["answers"]:
            task, length = a["case"].split("/")[:2]
            cap = 2048 - served_tasks.ANSWER_TOKENS[task]  # the prompt and its answer fit
            assert a["target_tokens"] == min(int(length), cap)
            assert 0.97 * a["target_tokens"] <= a["sized_tokens"] <= a["target_tokens"]
        for row in res["rows"]:  # the servers' own counts, as sized
            ids = [a for a in res["answers"]
                   if a["case"].startswith(f"{row['task']}/{row['length']}/")]
            assert row["prompt_tokens"] == pytest.approx(
                sum(a["sized_tokens"] for a in ids) / len(ids))
        sized[name] = [(a["case"], a["sized_tokens"]) for a in res["answers"]]
    assert sized["ref2k"] == sized["ref2k-probe"]
    assert served.token_cap(8192, None, 32) == 8160
    assert served.token_cap(8192, 8186, 1) == 8185
    assert served.token_cap(None, None, 32) is None


def test_a_prompt_error_is_a_row_and_the_run_goes_on(fakes, tmp_path, capsys):
    ref, short = fakes("ref"), fakes("short")  # the candidate's context is 1024 tokens
    out = tmp_path / "served.json"
    assert main(["served", "--reference", ref, "--candidate", short, "--lengths", "512,2048",
                 "--cases", "2", "--tasks", "needle,cwe", "--out", str(out)]) == 3
    res = json.loads(out.read_text())
    rows = {(r["task"], r["length"]): r for r in res["rows"]}
    for task in ("needle", "cwe"):
        assert rows[task, 512]["errors"] == {"reference": 0, "candidate": 0}
        assert rows[task, 512]["candidate"]["passed"] == 2
        assert rows[task, 2048]["errors"] == {"reference": 0, "candidate": 2}
        assert rows[task, 2048]["candidate"]["n"] == rows[task, 2048]["reference"]["n"] == 0
    assert sorted(e["case"] for e in res["errors"]) == [
        "cwe/2048/0", "cwe/2048/1", "needle/2048/0", "needle/2048/1"]
    std = capsys.readouterr()
    lines = [x for x in std.err.splitlines() if x.startswith("diffkv-eval served: candidate")]
    assert len(lines) == 4
    for e in res["errors"]:  # one line each: server, case, tokens, the server's own text
        line = (f"diffkv-eval served: candidate {short}: {e['case']} ({e['tokens']} tokens): "
                f"HTTP 400: The input ({e['tokens']} tokens) is longer than the model's "
                "context length (1024 tokens).")
        assert line in lines
    assert "| cwe | 2048 |" in std.out and "| – | – | 0 / 2 |" in std.out
    assert "4 prompt(s) got an error" in std.out
    with pytest.raises(SystemExit):
        main(["served", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 every prompt answered" in help_text
    assert "3 the run finished, but some prompts got an error" in help_text


def test_a_server_that_stops_answering_is_errors_not_an_end():
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens: as a server that crashed
    cases = served_tasks.cases(["needle"], [64], 3, FILLER)
    seen = []
    got = served.ask_all(dead, cases, 1, 5.0, on_error=lambda c, e: seen.append((c.key, e)))
    assert got[0].error.startswith("no answer: ")
    assert all(a.error.startswith(f"not sent: {dead}: not reachable") for a in got[1:])
    assert [k for k, _ in seen] == [c.key for c in cases]


def _full_kl(p: list[float], q: list[float]) -> float:
    return sum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True))


def test_kl_from_top_logprobs():
    p, q = fake_logprobs(100, 4.0), fake_logprobs(100, 5.0)
    full = _full_kl(p, q)
    everything = served.kl_topk(dict(enumerate(p)), dict(enumerate(q)))
    assert everything == pytest.approx(full, rel=1e-9)

    def top(d: list[float], k: int) -> dict[int, float]:
        return {i: d[i] for i in sorted(range(len(d)), key=lambda i: -d[i])[:k]}

    for k in (1, 5, 20, 60):  # coarse-grained: a lower bound, tightening with k
        assert 0 <= served.kl_topk(top(p, k), top(q, k)) <= full + 1e-12
    assert served.kl_topk(top(p, 20), top(q, 20)) > 0.5 * full
    assert served.kl_topk(top(p, 20), top(p, 20)) == 0.0
    # positions after the greedy tokens diverge condition on different text: not compared
    dist = tuple(top(fake_logprobs(t, 4.0), 20) for t in (65, 66, 67, 68))
    a = served.Answer("", (65, 66, 67, 68), 10, top_logprobs=dist)
    b = served.Answer("", (65, 66, 90, 68), 10, top_logprobs=dist)
    assert [t for t, _ in served.kl_positions(a, b, 8)] == [0, 1, 2]  # 3 follows 90 vs 67


def test_the_served_kl_against_the_reference_and_the_offline_one(fakes, tmp_path, capsys):
    """Two fakes that answer alike but with different temperatures: the served KL over the
    decode positions is the known one (all 256 ids listed) or a lower bound of it (top 20),
    printed beside the offline harness's KL for the config."""
    ref, warm = fakes("ref"), fakes("warm")
    offline = tmp_path / "quality.json"  # what `diffkv-eval run --out` writes, in part
    offline.write_text(json.dumps({"teacher_forcing": {"diffkv-smollm2-135m": {
        "summary": {"kl_mean": 0.0259, "tokens": 1024}}}}))
    res = {}
    for k in (256, 20):
        out = tmp_path / f"top{k}.json"
        assert main(["served", "--reference", ref, "--candidate", warm, "--lengths", "200",
                     "--cases", "3", "--tasks", "continuation,needle", "--kl-tokens", "8",
                     "--kl-top-k", str(k), "--label", "sglang_diffkv/presets/smollm2-135m.json",
                     "--offline", str(offline), "--out", str(out)]) == 0
        res[k] = json.loads(out.read_text())
    text = capsys.readouterr().out
    # by hand: each prompt's mean over positions 1..7 of the full KL, then over prompts
    means = []
    for a in res[256]["answers"]:
        if a["case"].startswith("continuation/"):
            ids = list(a["reference"].encode()[-32:])
            means.append(sum(_full_kl(fake_logprobs(t, 4.0), fake_logprobs(t, 5.0))
                             for t in ids[1:8]) / 7)
    kl = res[256]["kl"]["decode"]
    assert kl["prompts"] == 3 and kl["positions"] == 21
    assert kl["mean"] == pytest.approx(sum(means) / len(means), rel=1e-9)
    assert 0.5 * kl["mean"] < res[20]["kl"]["decode"]["mean"] <= kl["mean"]
    assert res[20]["rows"][0]["kl"]["top_k"] == 20
    assert res[20]["offline"]["config"] == "diffkv-smollm2-135m"
    assert "top-20 logprobs" in text and "its own fp32 reference): 0.0259." in text
    # a preset's provenance file: its eval-split KL, whatever the label
    assert served.offline_kl("sglang_diffkv/presets/smollm2-135m.provenance.json",
                             [])["kl_mean"] == pytest.approx(0.0261, abs=1e-4)
    assert main(["served", "--reference", ref, "--candidate", warm,
                 "--offline", str(tmp_path / "missing.json")]) == 2
    assert main(["served", "--reference", ref, "--candidate", warm, "--kl-tokens", "8",
                 "--kl-top-k", "0"]) == 2
    assert "--kl-top-k 0: must be >= 1" in capsys.readouterr().err


def test_a_candidate_that_dies_mid_run_leaves_the_reference_rows(fakes, tmp_path, capsys,
                                                                 monkeypatch):
    ref, dead = fakes("ref"), f"http://127.0.0.1:{_free_port()}"
    real, calls = served.check_reachable, []

    def reachable_at_first(url: str, timeout_s: float = 10.0) -> None:
        calls.append(url)
        if url != dead:  # it answered the pre-flight check, then died
            real(url, timeout_s)

    monkeypatch.setattr(served, "check_reachable", reachable_at_first)
    out = tmp_path / "served.json"
    assert main(["served", "--reference", ref, "--candidate", dead, "--lengths", "128",
                 "--cases", "4", "--tasks", "needle", "--inflight", "1",
                 "--out", str(out)]) == 3
    res = json.loads(out.read_text())
    assert res["rows"][0]["errors"] == {"reference": 0, "candidate": 4}
    text = capsys.readouterr().out
    assert f"- candidate {dead}: needle/128/0 (" in text and "): no answer: " in text
    assert f"- candidate {dead}: 3 prompt(s) from needle/128/1 on: not sent: {dead}: " in text


def test_the_gpu_script_rehearsed_on_the_fake_server(tmp_path):
    """scripts/gpu_served_quality.sh with REHEARSE=1 (the fake server in SGLang's place): one
    table per candidate in summary.md as each finishes, everything else in results.tar.gz
    (at most eight files come back from a GPU call), and a candidate the budget cannot hold
    skipped with a line."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_served_quality.sh"

    def rehearse(name: str, budget: int, candidates: str) -> tuple[int, Path]:
        out = tmp_path / name
        env = {**os.environ, "REHEARSE": "1", "OUT": str(out), "WORK": str(tmp_path / "work"),
               "BUDGET_S": str(budget), "CANDIDATES": candidates, "KL_TOKENS": "4"}
        done = subprocess.run(["bash", str(script), "--cases", "1", "--lengths", "256",
                               "--tasks", "needle,continuation"], env=env,
                              capture_output=True, text=True, timeout=300)
        return done.returncode, out

    p135 = "sglang_diffkv/presets/smollm2-135m.json"
    rc, out = rehearse("full", 300, f"{p135} fp8 {p135}@chunk512")
    summary = (out / "summary.md").read_text()
    assert rc == 0, summary
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.md"]
    assert "### smollm2-135m (diffkv-eval served exit 0" in summary
    assert "### fp8 (diffkv-eval served exit 0" in summary
    # a @chunkN candidate is the same preset served with --chunked-prefill-size N
    assert "### smollm2-135m@chunk512 (diffkv-eval served exit 0" in summary
    assert summary.count("| needle | 256 |") == 3
    # the preset's provenance beside it is the offline harness's KL for it
    assert "Offline harness (preset provenance, eval split" in summary
    with tarfile.open(out / "results.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./smollm2-135m.json", "./fp8.json", "./logs/reference.log"} <= names
    with tarfile.open(out / "results.tar.gz") as tar:
        log = tar.extractfile("./logs/smollm2-135m@chunk512.log").read().decode()
    assert "--attention-backend diffkv" in log and "--chunked-prefill-size 512" in log
    rc, out = rehearse("short", 30, "fp8")  # a candidate is first guessed at 120 s
    summary = (out / "summary.md").read_text()
    assert rc == 3 and "fp8: skipped: " in summary and "BUDGET_S=30" in summary
