"""``python -m sglang_diffkv.bench.link_probe --out DIR``: how fast KV can move between the two
GPUs of the machine a real P/D run uses, without RDMA, for ``diffkv-sim validate-disagg``'s
link (writes ``DIR/pd_link.json``, ``sglang_diffkv.serving_io.pd_run``). On a machine with one
GPU (or with ``--same-gpu``) the far side is GPU 0 too: another process's buffer on the same
GPU, what SGLang's mooncake_tcp moves when the prefill and decode servers share one GPU; the
file then says ``"same_gpu": true`` (and the Mooncake probe ``receiver_gpu`` 0).

SGLang's ``--disaggregation-transfer-backend mooncake_tcp`` moves a request's KV with Mooncake's
TCP transport: GPU -> host (cudaMemcpy), a local TCP socket, host -> GPU. Three probes, each
optional and each recorded with its error instead when it fails:

  socket_loopback  bytes through one 127.0.0.1 TCP connection (two threads, 8 MiB writes),
                   and the round trip of a 1-byte message
  memcpy           1 GiB GPU -> host and host -> GPU, pinned and pageable (torch)
  mooncake_tcp     Mooncake's engine itself (``--mooncake``): a second process registers GPU 1
                   memory (GPU 0 with one GPU or ``--same-gpu``), this one writes GPU 0
                   memory into it with ``batch_transfer_sync_write`` (SGLang's call), in 1
                   or 64 pieces (SGLang sends a request's KV as one piece per layer and K/V
                   buffer: 64 for Llama-3-8B), several sizes; ``fit_link`` turns the rows
                   into a latency and a bandwidth. The engine is set up as SGLang sets it up:
                   ``MC_FORCE_TCP=1``, handshake ``P2PHANDSHAKE``, protocol ``rdma`` (which
                   MC_FORCE_TCP turns into TCP); if that fails, protocol ``tcp``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_diffkv.serving_io.pd_run import LINK_FILE, SCHEMA, fit_link, link_rows

PROG = "python -m sglang_diffkv.bench.link_probe"
MIB = 2**20
# (total MiB, pieces) of the Mooncake transfers, each timed REPS times after one untimed
# transfer of the whole buffer (it opens the connection and touches the memory). 64 pieces:
# a Llama-3-8B request's KV at the fewest descriptors SGLang sends (a layer's K or V buffer
# each); 1 and 512 show what a descriptor costs (more when slots are not contiguous).
MOONCAKE_PLAN = ((8, 64), (32, 64), (128, 64), (512, 64), (128, 1), (128, 512))
REPS = 3


def socket_probe(total_bytes: int, chunk: int = 8 * MIB, pings: int = 200) -> dict[str, Any]:
    """Send ``total_bytes`` through one loopback TCP connection; then ``pings`` 1-byte round
    trips. Both ends are threads of this process: socket calls release the GIL."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = [0]

    def receiver() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            view = memoryview(bytearray(chunk))
            while got[0] < total_bytes:
                n = conn.recv_into(view)
                if n == 0:
                    return
                got[0] += n
            conn.sendall(b"k")
            for _ in range(pings):
                b = conn.recv(1)
                if not b:
                    return
                conn.sendall(b)

    th = threading.Thread(target=receiver, daemon=True)
    th.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = memoryview(os.urandom(chunk))
        t0 = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            c.sendall(data)
            sent += chunk
        if c.recv(1) != b"k":
            raise RuntimeError("the receiving end closed early")
        seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(pings):
            c.sendall(b"p")
            c.recv(1)
        rtt = (time.perf_counter() - t1) / pings
    th.join(timeout=10)
    srv.close()
    return {"bytes": sent, "seconds": seconds, "bandwidth": sent / seconds, "rtt_s": rtt}


def memcpy_probe(nbytes: int, reps: int = 3, same_gpu: bool = False) -> dict[str, Any]:
    """Bytes/s of GPU -> host and host -> GPU copies of ``nbytes`` (median of ``reps``), pinned
    and pageable host memory; GPU 0 to host to GPU 1 when there are two (and not
    ``same_gpu``)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst_dev = "cuda:1" if torch.cuda.device_count() > 1 and not same_gpu else "cuda:0"
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    out: dict[str, Any] = {"bytes": nbytes, "to_device": dst_dev}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        for name, d, s in ((f"d2h_{kind}", host, src), (f"h2d_{kind}", dst, host)):
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                d.copy_(s, non_blocking=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[name] = nbytes / sorted(times)[len(times) // 2]
    return out


def _engine(protocol: str) -> Any:
    """A Mooncake transfer engine on 127.0.0.1 set up as SGLang's MooncakeTransferEngine does
    (``MC_FORCE_TCP`` must be set before the import)."""
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(protocol={protocol!r}) returned {rc}")
    return e


def _engine_any() -> tuple[Any, str]:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    errors = []
    for protocol in ("rdma", "tcp"):
        try:
            return _engine(protocol), protocol
        except Exception as e:  # noqa: BLE001 - the engine raises plain RuntimeErrors
            errors.append(str(e))
    raise RuntimeError("; ".join(errors))


def _buffer(nbytes: int, host: bool) -> tuple[Any, int]:
    """(the object that keeps it alive, its address): ``nbytes`` on GPU 0 of this process,
    or in host memory (``host``: a rehearsal of the probe on a machine without a GPU)."""
    if host:
        import numpy as np

        a = np.zeros(nbytes, dtype=np.uint8)
        return a, int(a.ctypes.data)
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    return t, int(t.data_ptr())


def mooncake_receiver(handoff: Path, nbytes: int, host: bool = False) -> int:
    """The receiving process: register ``nbytes`` of GPU memory, publish where it is in
    ``handoff``, wait until ``handoff``.done appears (or 300 s)."""
    buf, ptr = _buffer(nbytes, host)
    engine, protocol = _engine_any()
    if engine.register_memory(ptr, nbytes) != 0:
        raise RuntimeError("register_memory failed on the receiving side")
    tmp = handoff.with_suffix(".tmp")
    tmp.write_text(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "ptr": ptr,
                               "bytes": nbytes, "protocol": protocol}))
    tmp.replace(handoff)
    done = Path(str(handoff) + ".done")
    t0 = time.monotonic()
    while not done.exists() and time.monotonic() - t0 < 300:
        time.sleep(0.2)
    return 0


def mooncake_probe(plan: Sequence[tuple[int, int]] = MOONCAKE_PLAN, reps: int = REPS,
                   host: bool = False, same_gpu: bool = False) -> dict[str, Any]:
    """Time Mooncake transfers GPU 0 -> GPU 1 (another process) per ``plan`` row (total MiB,
    pieces). Rows: [bytes, pieces, seconds]. With one GPU, or ``same_gpu``: GPU 0 -> another
    process's buffer on GPU 0 (``same_gpu`` true in the result). ``host``: host memory on both
    sides instead."""
    import tempfile

    nbytes = max(m for m, _ in plan) * MIB
    out: dict[str, Any] = {"transfers": [], "plan": [list(p) for p in plan], "reps": reps,
                           "memory": "host" if host else "gpu"}
    with tempfile.TemporaryDirectory() as tmp:
        handoff = Path(tmp) / "peer.json"
        env = dict(os.environ, MC_FORCE_TCP="1", PYTHONUNBUFFERED="1")
        if not host:
            import torch

            # the receiver's cuda:0 is the GPU CUDA_VISIBLE_DEVICES names (as this
            # process sees them: an inherited list is honoured)
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                       if v.strip()]
            rx = 1 if torch.cuda.device_count() > 1 and not same_gpu else 0
            if visible:
                env["CUDA_VISIBLE_DEVICES"] = visible[rx]
            elif rx:
                env["CUDA_VISIBLE_DEVICES"] = "1"
            out["sender_gpu"] = 0
            out["receiver_gpu"] = rx
            out["same_gpu"] = rx == 0
        log = open(Path(tmp) / "receiver.log", "w+")  # noqa: SIM115 - read back below
        peer = subprocess.Popen([sys.executable, "-m", "sglang_diffkv.bench.link_probe",
                                 "--mooncake-receiver", str(handoff),
                                 "--receiver-bytes", str(nbytes)]
                                + (["--mooncake-host-memory"] if host else []),
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            src, ptr = _buffer(nbytes, host)
            engine, protocol = _engine_any()
            out["protocol"] = protocol
            if engine.register_memory(ptr, nbytes) != 0:
                raise RuntimeError("register_memory failed on the sending side")
            t0 = time.monotonic()
            while not handoff.exists():
                if peer.poll() is not None or time.monotonic() - t0 > 120:
                    log.seek(0)
                    raise RuntimeError("the receiving process did not start: "
                                       + log.read()[-800:].replace("\n", " | "))
                time.sleep(0.2)
            far = json.loads(handoff.read_text())
            out["receiver_protocol"] = far["protocol"]

            def send(total: int, pieces: int) -> float:
                size = total // pieces
                bufs = [ptr + k * size for k in range(pieces)]
                peers = [far["ptr"] + k * size for k in range(pieces)]
                t = time.perf_counter()
                rc = engine.batch_transfer_sync_write(far["session"], bufs, peers,
                                                      [size] * pieces)
                dt_s = time.perf_counter() - t
                if rc < 0:
                    raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
                return dt_s

            out["first_transfer_s"] = send(nbytes, 1)  # opens the connection, touches memory
            for mib, pieces in plan:
                for _ in range(reps):
                    out["transfers"].append([mib * MIB, pieces, send(mib * MIB, pieces)])
            rows = link_rows(out["transfers"])
            lat, bw = fit_link(rows)
            out["fit"] = {"latency_s": lat, "bandwidth": bw, "pieces": int(rows[0][1])}
        finally:
            Path(str(handoff) + ".done").touch()
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
            log.close()
    return out


def _probe(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        res = fn(*args)
    except Exception as e:  # noqa: BLE001 - a failed probe is recorded, the others still run
        res = {"error": f"{type(e).__name__}: {e}"}
    res["probe_s"] = round(time.monotonic() - t0, 2)
    line = res.get("error") or ", ".join(
        f"{k} {v / 1e9:.2f} GB/s" for k, v in res.items()
        if k in ("bandwidth", "d2h_pinned", "h2d_pinned", "d2h_pageable", "h2d_pageable"))
    if "fit" in res:
        line = (f"fit {res['fit']['bandwidth'] / 1e9:.2f} GB/s + "
                f"{res['fit']['latency_s'] * 1e3:.2f} ms per transfer of "
                f"{res['fit']['pieces']} pieces ({res['protocol']}"
                + (f", GPU 0 -> GPU {res['receiver_gpu']}" if "receiver_gpu" in res else "")
                + (": the same GPU, another process" if res.get("same_gpu") else "") + ")")
    print(f"link_probe {name}: {line}", flush=True)
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for pd_link.json")
    p.add_argument("--socket-gib", type=float, default=4.0,
                   help="GiB through the loopback socket (0: skip; default: %(default)s)")
    p.add_argument("--memcpy-gib", type=float, default=1.0,
                   help="GiB per GPU<->host copy (0: skip; default: %(default)s)")
    p.add_argument("--mooncake", action=argparse.BooleanOptionalAction, default=False,
                   help="also time Mooncake's TCP transport between GPU 0 and GPU 1")
    p.add_argument("--same-gpu", action="store_true",
                   help="the far side on GPU 0 too even with more GPUs (the one-GPU P/D "
                        "layout; with one GPU it is so anyway)")
    p.add_argument("--mooncake-host-memory", action="store_true",
                   help="the Mooncake probe on host memory (a rehearsal without GPUs)")
    p.add_argument("--mooncake-receiver", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--receiver-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _device() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout
        if out.strip():
            return out.strip().splitlines()[0].strip()
    return ""


def _gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without it)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                             check=False).stdout
        return sum(line.startswith("GPU ") for line in out.splitlines())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.mooncake_receiver is not None:
        return mooncake_receiver(a.mooncake_receiver, a.receiver_bytes, a.mooncake_host_memory)
    if a.out is None:
        print(f"{PROG}: error: --out is required", file=sys.stderr)
        return 2
    probes: dict[str, Any] = {}
    if a.socket_gib > 0:
        probes["socket_loopback"] = _probe("socket_loopback", socket_probe,
                                           int(a.socket_gib * 2**30) // (8 * MIB) * 8 * MIB)
    if a.memcpy_gib > 0:
        probes["memcpy"] = _probe("memcpy", memcpy_probe, int(a.memcpy_gib * 2**30), 3,
                                  a.same_gpu)
    if a.mooncake:
        probes["mooncake_tcp"] = _probe("mooncake_tcp", mooncake_probe, MOONCAKE_PLAN, REPS,
                                        a.mooncake_host_memory, a.same_gpu)
    gpus = _gpu_count()
    doc = {"schema": SCHEMA, "kind": "link", "device": _device(), "gpus": gpus,
           "same_gpu": bool(a.same_gpu or gpus == 1),
           "created": dt.datetime.now(dt.timezone.utc).isoformat(), "probes": probes}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / LINK_FILE).write_text(json.dumps(doc, indent=1))
    print(f"{PROG}: wrote {a.out / LINK_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
