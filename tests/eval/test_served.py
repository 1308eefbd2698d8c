"""The served-path quality harness (diffkv-eval served) against two fake servers (the
project's CPU stand-in for SGLang, sglang_diffkv.bench.fakeserver, in its copy-model text
mode): a reference that keeps the whole prompt and a candidate that loses its middle."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from sglang_diffkv.eval import data, served, served_tasks
from sglang_diffkv.eval.cli import main

FILLER = data.wikitext(data.PACKAGE_DATA / data.EXCERPT[data.WIKITEXT])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake(forget: str | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, **({"FAKE_FORGET": forget} if forget else {})}
    srv = subprocess.Popen([sys.executable, "-m", "sglang_diffkv.bench.fakeserver", "--port",
                            str(port)], env=env, stdout=subprocess.DEVNULL,
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
def servers():
    ref, ref_url = _fake(None)
    cand, cand_url = _fake("0.4,0.6")  # loses the middle fifth of every prompt
    yield ref_url, cand_url
    for srv in (ref, cand):
        srv.terminate()
        srv.wait(timeout=10)


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
    # the needles whose passkey sentence lies wholly in the lost fifth, from the prompts
    lost = set()
    for c in served_tasks.cases(["needle"], [300], 5, FILLER):
        first = c.prompt.index(c.expected[0]) / len(c.prompt)
        last = c.prompt.rindex(c.expected[0]) / len(c.prompt)
        if 0.4 <= first and last < 0.6:
            lost.add(c.key)
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
    assert rows["needle"]["prompt_tokens"] == pytest.approx(300, rel=0.15)  # cut at a sentence
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
    with pytest.raises(ValueError, match="depth=2"):
        served_tasks.build("needle", 500, 0, 2.0, FILLER)
