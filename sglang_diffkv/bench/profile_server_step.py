"""Where a real SGLang server's decode step goes on the GPU (torch profiler, CUDA kernels).

Starts one server (the same command line as ``scripts/bench_e2e.py``), loads it with
long-generation requests (non-streaming, ignore_eos), waits until the running batch is
steady, then asks SGLang's ``/start_profile`` for ``--steps`` forward steps and reads the
trace it writes. Prints and writes (``--out``/profile.md, profile.json):

- the wall span of the profiled steps and the GPU busy time (union of kernel intervals):
  their difference is time the GPU waited for the host;
- the prefill and the decode steps apart (a step ends at the sampler's argmax; a prefill step
  launches the extend kernel): median span, GPU busy time, extend-kernel time, kernel count;
- kernel time per kernel name, largest first, with its share of the busy time.

``--summarize TRACE --steps N`` prints the same report for a trace written earlier.

``--requests`` may list several cumulative totals (``128,256,450``): each stage adds requests
up to its total, waits ``--warm-s``, profiles, and writes ``profile-<total>.{md,json}`` with
the last ``Decode batch`` line before the profile (running batch and tokens held), so one
server start profiles several batch sizes. ``--prompt-len`` sets the prompt range (short
prompts keep contexts short at a large batch).

``--at-batch 650,500,250`` profiles a drain instead: one ``--requests`` total is sent at once
(spread ``--output-len MIN,MAX`` so requests finish all along), and each profile starts when
the server log's running batch has fallen to that size (``profile-b<size>.{md,json}``): the
regime of a saturated benchmark's tail, with mixed contexts and requests finishing every step.
``--attach --at-seconds 40,90 --server-log LOG`` profiles a server another command runs (a
benchmark's open-loop ladder: prefill steps among the decode steps) at those seconds after it
first answers ``/health`` (``profile-t<seconds>.{md,json}``).
A profile's ``ms/step`` divides by ``--steps``, but SGLang's window may hold fewer decode
steps (9 of 10 in session 15's drain profiles): a per-layer kernel's launches over the layers
count the steps that ran.

    python -m sglang_diffkv.bench.profile_server_step --model /tmp/dummy-llama3-8b \\
        --config diffkv-mix \\
        --out /tmp/prof --requests 400 --warm-s 60 --steps 20
    python -m sglang_diffkv.bench.profile_server_step --model /tmp/dummy-llama3-8b \\
        --config bf16 \\
        --out /tmp/prof --requests 128,256,450 --prompt-len 16,256 --warm-s 8 --steps 10
    python -m sglang_diffkv.bench.profile_server_step --model /tmp/dummy-llama3-8b \\
        --config bf16 \\
        --out /tmp/prof --requests 750 --at-batch 650,500,380,250,120 --prompt-len 16,500 \\
        --output-len 64,1400 --warm-s 10 --steps 10 --stream \\
        --server-args=--cuda-graph-max-bs=1536
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from sglang_diffkv.bench.client import prompt_ids
from sglang_diffkv.bench.server import (
    LaunchOptions,
    ServerProcess,
    launch_command,
    launch_env,
    make_config,
)

MIX_30_50_20 = '{"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]}'


def post(url: str, body: dict, timeout: float = 600.0) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def send_requests(base: str, ids: range, prompt_len: tuple[int, int],
                  out_len: tuple[int, int], seed: int, stop: threading.Event,
                  stream: bool = False) -> None:
    lo, hi = prompt_len
    span_len = hi - lo + 1
    olo, ohi = out_len

    def one(i: int) -> None:
        body = {"input_ids": prompt_ids(seed, i, lo + (i * 97) % span_len),
                "sampling_params": {"max_new_tokens": olo + (i * 193) % (ohi - olo + 1),
                                    "temperature": 0.0,
                                    "ignore_eos": True}, "stream": stream}
        try:
            post(f"{base}/generate", body, timeout=3600)
        except Exception:  # noqa: BLE001 - the server is stopped under them at the end
            pass

    for i in ids:
        if stop.is_set():
            return
        threading.Thread(target=one, args=(i,), daemon=True).start()


def last_decode_line(log: Path) -> str:
    if not log.exists():
        return ""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Decode batch" in ln]
    return lines[-1].strip() if lines else ""


def wait_for_batch(log: Path, at_most: int, timeout_s: float) -> str:
    """The first Decode line whose running batch is at most ``at_most`` (polling the log),
    or '' when none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = last_decode_line(log)
        m = re.search(r"#running-req: (\d+)", line)
        if m and int(m.group(1)) <= at_most:
            return line
        time.sleep(0.1)
    return ""


def drain_targets(text: str, stages: list[int]) -> list[int]:
    """--at-batch's batch sizes (decreasing; [] when not given); they need a single
    --requests total, all sent at once."""
    if not text:
        return []
    drain = int_list(text, "--at-batch")
    if len(stages) != 1 or drain != sorted(set(drain), reverse=True):
        raise SystemExit(f"--at-batch {text!r}: needs one --requests total (got "
                         f"{','.join(map(str, stages))}) and strictly decreasing batch sizes")
    return drain


def attach_offsets(text: str, server_log: str) -> list[float]:
    """--at-seconds for --attach: increasing offsets >= 0; --server-log must be given."""
    try:
        offsets = [float(x) for x in text.split(",")] if text else []
    except ValueError:
        offsets = []
    if not offsets or min(offsets) < 0 or offsets != sorted(set(offsets)):
        raise SystemExit(f"--attach needs --at-seconds as increasing seconds >= 0, got {text!r}")
    if not server_log:
        raise SystemExit("--attach needs --server-log (the attached server's log file)")
    return offsets


def attach(base: str, out: Path, offsets: list[float], log: Path, steps: int,
           cpu: bool) -> int:
    """Profile a server started elsewhere at ``offsets`` seconds after it first answers."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 900
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"no server answered at {base} within 900 s", flush=True)
                return 1
            time.sleep(1)
    t0 = time.monotonic()
    for off in offsets:
        time.sleep(max(0.0, t0 + off - time.monotonic()))
        if profile_stage(base, out, f"-t{off:g}", steps, log, cpu) != 0:
            return 1
    return 0


def stage_names(stages: list[int]) -> list[str]:
    """File suffix per stage: '' for one stage, '-<total>', or '-<total>-<k>' where a total
    repeats (a stage that adds no requests profiles the same load later)."""
    if len(stages) == 1:
        return [""]
    return [f"-{t}" if stages.count(t) == 1 else f"-{t}-{k + 1}" for k, t in enumerate(stages)]


def int_list(text: str, what: str, n: int | None = None) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{what} {text!r}: expected comma-separated integers") from None
    if any(v < 1 for v in vals) or (n is not None and len(vals) != n):
        raise SystemExit(f"{what} {text!r}: expected {n or 'one or more'} positive integers")
    return vals


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


# one per forward step: the sampler's argmax ends every step, prefill or decode
STEP_END_KERNEL = "ArgMaxOps"
# SGLang's triton extend kernel (its time is a step's extend_ms)
EXTEND_KERNEL = "_fwd_kernel"
# a step that launches one of these is a prefill step: the triton backend's extend kernel,
# DiffKV's prefill store (its extend attention is a flash kernel that other paths share)
PREFILL_KERNELS = (EXTEND_KERNEL, "_store_prefill_kernel")


def cut_steps(kernels: list[dict]) -> list[tuple[list[dict], float]]:
    """The trace's kernels in time order, cut into forward steps at each sampling argmax:
    per step its kernels (the argmax last) and the argmax's end (trace us). Kernels after the
    last argmax (a step the window cut) are left out."""
    ks = sorted(kernels, key=lambda e: float(e["ts"]))
    out, i = [], 0
    for e in ks:
        if STEP_END_KERNEL not in e["name"]:
            continue
        end = float(e["ts"]) + float(e["dur"])
        step = []
        while i < len(ks) and float(ks[i]["ts"]) < end:
            step.append(ks[i])
            i += 1
        if step:
            out.append((step, end))
    return out


def busy_ms(step: list[dict]) -> float:
    """GPU busy ms of a step's kernels (the union of their intervals)."""
    return union_ms([(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in step])


def is_prefill(step: list[dict]) -> bool:
    """Whether a step launches one of PREFILL_KERNELS."""
    return any(k["name"] in PREFILL_KERNELS for k in step)


def forward_steps(kernels: list[dict]) -> list[dict]:
    """``cut_steps``' steps: per step the span from its first kernel's start to the argmax's
    end (ms), GPU busy (ms), the extend kernel's time (ms), its kernel count, whether it is a
    prefill step (``is_prefill``) and whether the step before it was (None for the first)."""
    out: list[dict] = []
    for step, end in cut_steps(kernels):
        ext = [float(k["dur"]) for k in step if k["name"] == EXTEND_KERNEL]
        out.append({"span_ms": (end - float(step[0]["ts"])) / 1e3, "busy_ms": busy_ms(step),
                    "extend_ms": sum(ext) / 1e3, "kernels": len(step),
                    "prefill": is_prefill(step),
                    "after_prefill": out[-1]["prefill"] if out else None})
    return out


def summarize(trace_path: Path, steps: int) -> dict:
    with gzip.open(trace_path, "rt") if trace_path.suffix == ".gz" else open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise SystemExit(f"{trace_path}: no CUDA kernel events")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    wall_ms = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3
    busy = union_ms(spans)
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        per[e["name"]][0] += float(e["dur"]) / 1e3
        per[e["name"]][1] += 1
    rows = sorted(((n, t, c) for n, (t, c) in per.items()), key=lambda r: -r[1])
    host = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for e in events:
        # runtime calls and torch ops; of the Python frames only this package's (the rest
        # are threads and SGLang's loop, which span everything)
        cat = e.get("cat")
        if "dur" in e and (cat in ("cuda_runtime", "cpu_op") or (
                cat == "python_function" and "sglang_diffkv" in e.get("name", ""))):
            h = host[(cat, e["name"])]
            h[0] += float(e["dur"]) / 1e3
            h[1] += 1
            h[2] = max(h[2], float(e["dur"]) / 1e3)
    slow = sorted(host.items(), key=lambda kv: -kv[1][2])[:25]
    return {"trace": str(trace_path), "steps": steps, "wall_ms": wall_ms, "busy_ms": busy,
            "forward_steps": forward_steps(kernels),
            "kernels": [{"name": n, "ms": t, "count": c} for n, t, c in rows],
            "host_calls": [{"cat": c, "name": n, "ms": t, "count": k, "max_ms": m}
                           for (c, n), (t, k, m) in slow]}


def split_steps(steps: list[dict]) -> list[tuple[str, list[dict]]]:
    """(kind, steps) for the prefill steps, the decode steps, and the decode steps after a
    decode step and after a prefill step apart (the first step, whose predecessor the window
    cut, in neither); kinds without steps left out. A decode step after an eager prefill
    waits on the GPU for the host to finish that prefill's launches and prepare it."""
    dec = [f for f in steps if not f["prefill"]]
    kinds = (("prefill", [f for f in steps if f["prefill"]]), ("decode", dec),
             ("decode after a decode", [f for f in dec if f.get("after_prefill") is False]),
             ("decode after a prefill", [f for f in dec if f.get("after_prefill")]))
    return [(kind, st) for kind, st in kinds if st]


def step_line(kind: str, st: list[dict]) -> str:
    """Medians over one kind of forward step: a step whose span is much longer than its GPU
    busy time waited on the host (an eager prefill step launches every kernel itself)."""
    def med(key: str) -> float:
        return statistics.median(f[key] for f in st)
    return (f"{kind} steps: {len(st)}, median span {med('span_ms'):.2f} ms, GPU busy "
            f"{med('busy_ms'):.2f} ms, extend kernel {med('extend_ms'):.2f} ms, "
            f"{med('kernels'):.0f} kernels")


def report(s: dict) -> str:
    n = max(s["steps"], 1)
    lines = [f"profiled {s['steps']} steps: wall {s['wall_ms']:.1f} ms "
             f"({s['wall_ms'] / n:.2f} ms/step), GPU busy {s['busy_ms']:.1f} ms "
             f"({s['busy_ms'] / n:.2f} ms/step, {100 * s['busy_ms'] / s['wall_ms']:.1f}%)"]
    lines += [step_line(kind, st) for kind, st in split_steps(s.get("forward_steps") or [])]
    lines += ["", "| kernel | ms/step | % of busy | launches/step |", "|---|---|---|---|"]
    for k in s["kernels"][:25]:
        lines.append(f"| `{k['name'][:90]}` | {k['ms'] / n:.3f} | "
                     f"{100 * k['ms'] / s['busy_ms']:.1f}% | {k['count'] / n:.0f} |")
    if s.get("host_calls"):
        lines += ["", "| host call (longest single call first) | kind | max ms | ms/step | "
                  "calls/step |", "|---|---|---|---|---|"]
        lines += [f"| `{h['name'][:80]}` | {h['cat']} | {h['max_ms']:.2f} | {h['ms'] / n:.2f} "
                  f"| {h['count'] / n:.1f} |" for h in s["host_calls"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (required unless --attach)")
    ap.add_argument("--config", default="diffkv-mix", help="bf16, fp8, diffkv-mix")
    ap.add_argument("--out", help="folder for the profiles (required unless --summarize)")
    ap.add_argument("--requests", default="400",
                    help="requests in flight when profiling; a comma list of cumulative "
                         "totals profiles once per stage")
    ap.add_argument("--prompt-len", default="256,767", help="prompt lengths MIN,MAX")
    ap.add_argument("--output-len", default="4096",
                    help="output length, or MIN,MAX to spread them (requests then finish "
                         "all along the run)")
    ap.add_argument("--cpu", action="store_true",
                    help="profile the CPU too and list the host calls that took longest "
                         "(a synchronisation shows as a long cuda runtime call)")
    ap.add_argument("--warm-s", type=float, default=60.0,
                    help="load time before each stage's profile")
    ap.add_argument("--stream", action="store_true",
                    help="stream the outputs, as the serving benchmarks do (the scheduler then "
                         "sends every request's tokens each --stream-interval steps)")
    ap.add_argument("--at-batch", default="",
                    help="with one --requests total: send them all, then profile each time the "
                         "running batch has drained to at most these sizes (a decreasing comma "
                         "list, e.g. 600,400,200): a drain with requests finishing")
    ap.add_argument("--attach", action="store_true",
                    help="profile a server that another command started and loads (e.g. "
                         "scripts/gpu_e2e_run.sh's ladder) instead of starting one: wait for "
                         "its /health on --port, then profile at each --at-seconds")
    ap.add_argument("--at-seconds", default="",
                    help="with --attach: seconds after the server first answers /health at "
                         "which to profile, comma-separated and increasing")
    ap.add_argument("--server-log", default="",
                    help="with --attach: the server's log (its Decode lines are recorded with "
                         "each profile; it may not exist yet)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--server-args", default="", help="extra launch_server arguments")
    ap.add_argument("--summarize", metavar="TRACE", default="",
                    help="print the report of a trace written earlier (--steps: how many "
                         "steps it holds) and exit; --out is not written")
    a = ap.parse_args()
    if a.summarize:
        print(report(summarize(Path(a.summarize), a.steps)))
        return 0
    if not a.out:
        raise SystemExit("--out is required (unless --summarize)")
    if a.attach:
        offsets = attach_offsets(a.at_seconds, a.server_log)
        return attach(f"http://127.0.0.1:{a.port}", Path(a.out), offsets, Path(a.server_log),
                      a.steps, a.cpu)
    if not a.model:
        raise SystemExit("--model is required (unless --attach)")
    stages = int_list(a.requests, "--requests")
    if stages != sorted(stages):
        raise SystemExit(f"--requests {a.requests!r}: cumulative totals must not decrease")
    drain = drain_targets(a.at_batch, stages)
    lo, hi = int_list(a.prompt_len, "--prompt-len", 2)
    if lo > hi:
        raise SystemExit(f"--prompt-len {a.prompt_len!r}: MIN > MAX")
    outs = int_list(a.output_len, "--output-len")
    out_len = (outs[0], outs[-1])
    if len(outs) > 2 or out_len[0] > out_len[1]:
        raise SystemExit(f"--output-len {a.output_len!r}: expected N or MIN,MAX")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(a.config, {"diffkv-mix": MIX_30_50_20})
    opts = LaunchOptions(model=a.model, port=a.port, extra_args=tuple(a.server_args.split()))
    server = ServerProcess(launch_command(cfg, opts), launch_env(cfg), out / "server.log")
    stop = threading.Event()
    server.start(port=a.port)
    try:
        print(f"ready after {server.wait_ready(400):.0f} s", flush=True)
        sent = 0
        for name, total in zip(stage_names(stages), stages, strict=True):
            threading.Thread(target=send_requests, daemon=True,
                             args=(opts.base_url, range(sent, total), (lo, hi), out_len,
                                   0, stop, a.stream)).start()
            sent = total
            time.sleep(a.warm_s)
            # a drain (one stage): a profile each time the batch falls to a target size
            for b in drain:
                if not wait_for_batch(server.log_path, b, 600):
                    print(f"the batch never drained to {b}", flush=True)
                    return 1
                if profile_stage(opts.base_url, out, f"-b{b}", a.steps, server.log_path,
                                 a.cpu) != 0:
                    return 1
            if not drain and profile_stage(opts.base_url, out, name, a.steps,
                                           server.log_path, a.cpu) != 0:
                return 1
        return 0
    finally:
        stop.set()
        server.stop()


def summarize_when_written(trace: Path, steps: int, timeout_s: float,
                           poll_s: float = 1.0) -> dict | None:
    """``summarize`` once the trace file is whole: SGLang writes it after the profile
    (with CPU activity, tens of MB that take seconds), so wait until its size holds still,
    and retry a read that finds it cut short; None if it is not whole within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = trace.stat().st_size
        if size == last and size > 0:
            try:
                return summarize(trace, steps)
            except (EOFError, OSError, json.JSONDecodeError):
                pass
        last = size
        time.sleep(poll_s)
    return None


def profile_stage(base: str, out: Path, name: str, steps: int, log: Path, cpu: bool) -> int:
    trace_dir = out / f"trace{name}"
    decode_line = last_decode_line(log)
    post(f"{base}/start_profile",
         {"output_dir": str(trace_dir), "num_steps": steps,
          "activities": ["CPU", "GPU"] if cpu else ["GPU"]})
    deadline = time.monotonic() + 180
    traces: list[Path] = []
    while time.monotonic() < deadline and not traces:
        time.sleep(2)
        traces = sorted(trace_dir.glob("*.trace.json*"))
    if not traces:
        print(f"profile{name}: no trace written within 180 s", flush=True)
        return 1
    s = summarize_when_written(traces[-1], steps, 180)
    if s is None:
        print(f"profile{name}: {traces[-1]} was still incomplete after 180 s", flush=True)
        return 1
    s["decode_line_before"] = decode_line
    (out / f"profile{name}.json").write_text(json.dumps(s, indent=1))
    text = f"{decode_line}\n\n{report(s)}"
    (out / f"profile{name}.md").write_text(text + "\n")
    print(f"== profile{name}\n{text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
