"""Writes the synthetic results folders of a real P/D validation run that
tests/simulator/test_validate_disagg.py reads (call1/: the colocated control and the link
probes without Mooncake, call2/: the P/D replay and the probes with Mooncake), as
scripts/gpu_pd_run.sh would bring them back from two GPU calls; and ../pd_run_one_gpu/ (one
call on a one-GPU H200: both P/D servers on GPU 0 at --mem-fraction-static 0.30 / 0.68, the
Mooncake probe GPU 0 -> GPU 0, the colocated control). Nothing here was measured: the
"measured" times follow simple formulas (below) so the tests can compute what to expect.

    python tests/simulator/data/pd_run/make_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FIELDS = ["index", "arrival_s", "input_len", "output_len", "send_s", "first_token_s", "end_s",
          "tokens", "completed"]
DEVICE = "NVIDIA H100 80GB HBM3"
BW, LAT = 1.5e9, 0.002          # the synthetic link: what the Mooncake probe rows follow
ONE_GPU = HERE.parent / "pd_run_one_gpu"
ONE_DEVICE = "NVIDIA H200"
BW1, LAT1 = 0.8e9, 0.003        # the one-GPU fixture's same-GPU loopback link
KV_BYTES_PER_TOKEN = 131072     # Llama-3-8B bf16
FLAGS = ("--model-path /tmp/dummy-llama3-8b --load-format dummy --attention-backend triton "
         "--sampling-backend pytorch --grammar-backend none --skip-tokenizer-init "
         "--mem-fraction-static 0.85 --disable-piecewise-cuda-graph --disable-radix-cache "
         "--incremental-streaming-output --stream-interval 4 --decode-log-interval 10 "
         "--enable-metrics")
ARGS = {"attention_backend": "triton", "kv_cache_dtype": "auto", "chunked_prefill_size": "8192",
        "mem_fraction_static": "0.85", "disable_radix_cache": "True",
        "max_prefill_tokens": "16384", "cuda_graph_max_bs": "256", "max_running_requests": "None"}


def server(role: str, extra: str, pool: int, frac: str = "0.85") -> dict:
    flags = FLAGS.replace("--mem-fraction-static 0.85", f"--mem-fraction-static {frac}")
    return {"role": role, "log": f"{role}.log",
            "command": f"python3 -m sglang.launch_server {flags} {extra}",
            "max_total_num_tokens": pool, "max_running_requests": 4096,
            "server_args": dict(ARGS, mem_fraction_static=frac)}


def requests(rate: float, n: int, seed: int, pd: bool, cut: int | None = None,
             bw: float = BW, lat: float = LAT) -> list[list]:
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))])
    rows = []
    for i, t in enumerate(arrivals):
        inp = int(rng.integers(300, 1500))
        out = int(rng.integers(20, 60))
        send = round(float(t) + 0.0005, 5)
        # colocated: TTFT 30 ms + 20 us per prompt token, TPOT 8 ms; P/D: the KV's wire
        # time on the synthetic link on top, TPOT 6.5 ms
        ttft = 0.030 + 2e-5 * inp + ((lat + inp * KV_BYTES_PER_TOKEN / bw) if pd else 0.0)
        tpot = 0.0065 if pd else 0.008
        first = round(send + ttft, 5)
        end = round(first + tpot * (out - 1), 5)
        if cut is not None and i >= cut:       # cut at the run limit: sent, never answered
            rows.append([i, round(float(t), 5), inp, out, send, None, round(send + 1.0, 5), 0,
                         0])
        else:
            rows.append([i, round(float(t), 5), inp, out, send, first, end, out, 1])
    return rows


def transfer(rows: list[list], bw: float = BW, lat: float = LAT) -> dict:
    done = [r for r in rows if r[8]]
    lat_ms = [1e3 * (lat + r[2] * KV_BYTES_PER_TOKEN / bw) for r in done]
    mb = [r[2] * KV_BYTES_PER_TOKEN / 2**20 for r in done]
    return {"sglang:kv_transfer_latency_ms_sum": sum(lat_ms),
            "sglang:kv_transfer_latency_ms_count": float(len(done)),
            "sglang:kv_transfer_total_mb_sum": sum(mb),
            "sglang:kv_transfer_total_mb_count": float(len(done))}


def replay(deployment: str, runs: list[dict], servers: list[dict], router: str | None,
           device: str = DEVICE) -> dict:
    return {"schema": 1, "kind": "replay", "deployment": deployment, "device": device,
            "created": "2026-11-28T00:00:00+00:00", "url": "http://127.0.0.1:8000",
            "trace": {"name": "azure-conv", "seed": 0, "window_s": 6.0, "context_len": 8192,
                      "rates": "2,4"},
            "servers": servers, "router": router, "runs": runs, "notes": []}


def run(rate: float, rows: list[list], time_limited: bool, pd: bool, bw: float = BW,
        lat: float = LAT) -> dict:
    return {"rate": rate, "window_s": 6.0, "time_limited": time_limited, "wall_s": 9.0,
            "errors": {}, "transfer": transfer(rows, bw, lat) if pd else None,
            "fields": FIELDS, "requests": rows}


def link(mooncake: bool, one_gpu: bool = False) -> dict:
    bw, lat = (BW1, LAT1) if one_gpu else (BW, LAT)
    probes = {"socket_loopback": {"bytes": 4294967296, "seconds": 1.0, "bandwidth": 4294967296.0,
                                  "rtt_s": 3e-05},
              "memcpy": {"bytes": 1073741824, "to_device": "cuda:0" if one_gpu else "cuda:1",
                         "d2h_pinned": 2.0e10,
                         "h2d_pinned": 2.0e10, "d2h_pageable": 8e9, "h2d_pageable": 8e9}}
    if mooncake:
        rows = [[m * 2**20, 64, lat + m * 2**20 / bw] for m in (8, 32, 128, 512)
                for _ in range(3)]
        probes["mooncake_tcp"] = {"transfers": rows + [[128 * 2**20, 1, 0.09]],
                                  "protocol": "rdma", "receiver_protocol": "rdma",
                                  "sender_gpu": 0, "receiver_gpu": 0 if one_gpu else 1,
                                  "same_gpu": one_gpu}
    return {"schema": 1, "kind": "link", "device": ONE_DEVICE if one_gpu else DEVICE,
            "gpus": 1 if one_gpu else 2, "same_gpu": one_gpu, "probes": probes}


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")


def main() -> None:
    colo = [run(2.0, requests(2.0, 12, 1, False), False, False),
            run(4.0, requests(4.0, 16, 2, False, cut=15), True, False)]
    write(HERE / "call1" / "pd_runs_colocated.json",
          replay("colocated", colo, [server("colocated", "--base-gpu-id 0 --port 30000",
                                            426000)], None))
    write(HERE / "call1" / "pd_link.json", link(False))
    pd = [run(2.0, requests(2.0, 12, 1, True), False, True),
          run(4.0, requests(4.0, 16, 2, True), False, True)]
    router = ("python3 -m sglang_router.launch_router --pd-disaggregation --mini-lb --prefill "
              "http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 --host 127.0.0.1 "
              "--port 8000")
    write(HERE / "call2" / "pd_runs_pd.json",
          replay("pd", pd, [server("prefill", "--disaggregation-mode prefill "
                                   "--disaggregation-transfer-backend mooncake_tcp "
                                   "--base-gpu-id 0 --port 30000", 425000),
                            server("decode", "--disaggregation-mode decode "
                                   "--disaggregation-transfer-backend mooncake_tcp "
                                   "--base-gpu-id 1 --port 30001", 424000)], router))
    write(HERE / "call2" / "pd_link.json", link(True))
    # one call on a one-GPU H200: link, coloc and pd, both P/D servers on GPU 0
    write(ONE_GPU / "pd_link.json", link(True, one_gpu=True))
    write(ONE_GPU / "pd_runs_colocated.json",
          replay("colocated", [run(2.0, requests(2.0, 12, 1, False), False, False)],
                 [server("colocated", "--base-gpu-id 0 --port 30000", 780000)], None,
                 ONE_DEVICE))
    pd1 = replay("pd", [run(2.0, requests(2.0, 12, 1, True, bw=BW1, lat=LAT1), False, True,
                            BW1, LAT1)],
                 [server("prefill", "--disaggregation-transfer-backend mooncake_tcp "
                         "--disaggregation-mode prefill "
                         "--disaggregation-bootstrap-port 8998 --port 30000 --base-gpu-id 0",
                         220000, "0.30"),
                  server("decode", "--disaggregation-transfer-backend mooncake_tcp "
                         "--disaggregation-mode decode "
                         "--port 30001 --base-gpu-id 0", 390000, "0.68")], router, ONE_DEVICE)
    pd1["shared_gpu"] = True
    pd1["notes"] = ["one GPU: the prefill and decode servers shared it"]
    write(ONE_GPU / "pd_runs_pd.json", pd1)


if __name__ == "__main__":
    main()
