"""Named server configurations -> ``sglang.launch_server`` command lines, and the server process.

Configurations (``make_config``):
  bf16           ``--attention-backend triton``, bf16 KV cache (SGLang's default dtype)
  fp8            triton + ``--kv-cache-dtype fp8_e4m3``
  diffkv[-NAME]  ``--attention-backend diffkv`` with ``SGLANG_DIFFKV_CONFIG`` = a JSON given by
                 the caller (default ``DEFAULT_DIFFKV_CONFIG``: the Llama-3-8B preset with a
                 forced 30/50/20 high/low/pruned tier mix; ``diffkv-measured`` defaults to
                 the ``bench-measured`` preset: the mix the calibrated preset produced,
                 ``NAMED_DIFFKV_CONFIGS``)

Every configuration gets the same common arguments (``COMMON_ARGS``): dummy weights, pytorch
sampling, no grammar backend, no tokenizer (requests carry ``input_ids``),
``--mem-fraction-static 0.85``, and ``--disable-piecewise-cuda-graph`` so all three run the
same (eager) prefill path: diffkv forces piecewise graphs off, and leaving them on for triton
would also cost 22-74 s of capture per start. Decode CUDA graphs stay at SGLang's default for
triton; diffkv forces them off. ``--incremental-streaming-output`` makes every streamed chunk
carry only its new token ids (the default repeats all ids so far, O(n^2) bytes for 4096-token
outputs), and ``--stream-interval`` (default 4) sends one chunk per 4 tokens per request, so
neither SGLang's output path nor our client is the bottleneck at batch sizes of several hundred.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_diffkv.bench.errors import BenchInputError

READY_MARKER = "The server is fired up and ready to roll!"
DEFAULT_DIFFKV_CONFIG = '{"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]}'
# diffkv variants whose name alone picks their config (a --diffkv-config still overrides)
NAMED_DIFFKV_CONFIGS = {"diffkv-measured": '{"preset": "bench-measured"}'}
BASE_CONFIGS = ("bf16", "fp8", "diffkv")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration: its name (used in file names), attention backend, KV dtype,
    and the environment variables it adds."""

    name: str
    attention_backend: str
    kv_cache_dtype: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise BenchInputError(
                f"configuration name {self.name!r} must be letters, digits, '_', '.', '-' "
                "(it names log files)")
        if self.attention_backend not in ("triton", "diffkv", "flashinfer"):
            raise BenchInputError(
                f"attention backend {self.attention_backend!r}: allowed triton, diffkv, "
                "flashinfer")

    @property
    def is_diffkv(self) -> bool:
        return self.attention_backend == "diffkv"

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


def _check_diffkv_json(name: str, text: str) -> str:
    """SGLANG_DIFFKV_CONFIG also accepts a preset name or a path; only inline JSON is checked
    here (the server validates the rest at start-up, before any GPU work)."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise BenchInputError(
                f"diffkv config for {name!r} is not valid JSON ({e.msg} at column {e.colno}): "
                f"{text!r}") from e
        if not isinstance(obj, dict):
            raise BenchInputError(f"diffkv config for {name!r} must be a JSON object: {text!r}")
    elif not stripped:
        raise BenchInputError(f"diffkv config for {name!r} is empty")
    return stripped


def make_config(name: str, diffkv_configs: Mapping[str, str] | None = None,
                diffkv_env: Mapping[str, str] | None = None,
                variant_env: Mapping[str, Mapping[str, str]] | None = None) -> ServerConfig:
    """``bf16``, ``fp8``, or ``diffkv``/``diffkv-<variant>`` (its SGLANG_DIFFKV_CONFIG from
    ``diffkv_configs[name]``, else ``NAMED_DIFFKV_CONFIGS[name]``, else
    ``DEFAULT_DIFFKV_CONFIG``; ``diffkv_env`` is added to every diffkv variant's environment,
    e.g. SGLANG_DIFFKV_PROFILE=1, and ``variant_env[name]`` to this variant's only, e.g.
    SGLANG_DIFFKV_FUSED_ARGMIN=1 for one side of an A/B)."""
    diffkv_configs = diffkv_configs or {}
    variant_env = variant_env or {}
    for what, given in (("diffkv config", diffkv_configs), ("variant environment",
                                                            variant_env)):
        unused = [k for k in given if not (k == "diffkv" or k.startswith("diffkv-"))]
        if unused:
            raise BenchInputError(
                f"{what} given for {unused[0]!r}: only configurations named 'diffkv' or "
                "'diffkv-<variant>' take one")
    if name == "bf16":
        return ServerConfig(name, "triton")
    if name == "fp8":
        return ServerConfig(name, "triton", kv_cache_dtype="fp8_e4m3")
    if name == "diffkv" or (name.startswith("diffkv-") and len(name) > len("diffkv-")):
        cfg_json = _check_diffkv_json(name, diffkv_configs.get(
            name, NAMED_DIFFKV_CONFIGS.get(name, DEFAULT_DIFFKV_CONFIG)))
        env = {**(diffkv_env or {}), **variant_env.get(name, {}),
               "SGLANG_DIFFKV_CONFIG": cfg_json}
        return ServerConfig(name, "diffkv", env=tuple(sorted(env.items())))
    raise BenchInputError(
        f"unknown configuration {name!r}; allowed: bf16, fp8, diffkv, diffkv-<variant> "
        "(e.g. diffkv-mix)")


def parse_config_list(text: str, diffkv_configs: Mapping[str, str] | None = None,
                      diffkv_env: Mapping[str, str] | None = None,
                      variant_env: Mapping[str, Mapping[str, str]] | None = None
                      ) -> list[ServerConfig]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchInputError(f"--configs {text!r} names no configuration")
    if len(set(names)) != len(names):
        raise BenchInputError(f"--configs {text!r} names a configuration twice")
    configs = [make_config(n, diffkv_configs, diffkv_env, variant_env) for n in names]
    for what, given in (("a diffkv config", diffkv_configs), ("a variant environment",
                                                              variant_env)):
        missing = sorted(set(given or {}) - set(names))
        if missing:
            raise BenchInputError(
                f"{what} was given for {missing[0]!r}, which is not in --configs {text!r}")
    return configs


@dataclass(frozen=True)
class LaunchOptions:
    """What every configuration's command line shares."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    load_format: str = "dummy"
    mem_fraction_static: float = 0.85
    decode_log_interval: int = 10
    stream_interval: int = 4
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise BenchInputError(f"port {self.port} must be in 1..65535")
        if not 0 < self.mem_fraction_static < 1:
            raise BenchInputError(
                f"mem_fraction_static {self.mem_fraction_static} must be in (0, 1)")
        for name in ("decode_log_interval", "stream_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BenchInputError(f"{name}={v!r} must be an integer >= 1")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def launch_command(cfg: ServerConfig, opts: LaunchOptions) -> list[str]:
    argv = [
        opts.python, "-m", "sglang.launch_server",
        "--model-path", opts.model, "--load-format", opts.load_format,
        "--attention-backend", cfg.attention_backend,
        "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--skip-tokenizer-init",
        "--mem-fraction-static", f"{opts.mem_fraction_static:g}",
        "--disable-piecewise-cuda-graph",
        "--incremental-streaming-output",
        "--stream-interval", str(opts.stream_interval),
        "--decode-log-interval", str(opts.decode_log_interval),
        "--host", opts.host, "--port", str(opts.port),
    ]
    if cfg.kv_cache_dtype:
        argv += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    return argv + list(cfg.extra_args) + list(opts.extra_args)


def launch_env(cfg: ServerConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file as they happen
    env.update(cfg.env_dict)
    return env


def shell_line(argv: Sequence[str], env: Mapping[str, str] = ()) -> str:
    """The command as one copy-pasteable shell line (for results.json and the docs)."""
    import shlex

    pre = [f"{k}={shlex.quote(v)}" for k, v in dict(env).items()]
    return " ".join(pre + [shlex.quote(a) for a in argv])


class ServerStartError(RuntimeError):
    """The server exited or did not become ready; the message carries the log's tail."""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class ServerProcess:
    """One launch_server process in its own session (setsid), logging to ``log_path``; stopped
    by SIGTERM to its process group, then SIGKILL: the scheduler and detokenizer children die
    with it and free the GPU."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_s: float | None = None
    _scan_offset: int = 0
    _log_file: Any = field(default=None, repr=False)

    def start(self, host: str = "127.0.0.1", port: int = 30000) -> None:
        if port_in_use(host, port):
            raise ServerStartError(
                f"{host}:{port} already accepts connections; stop that server or pick --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _ready_in_log(self) -> bool:
        with open(self.log_path, "rb") as f:
            f.seek(self._scan_offset)
            chunk = f.read()
        # keep the last marker-length bytes: the marker may straddle two reads
        keep = len(READY_MARKER)
        found = READY_MARKER.encode() in chunk
        self._scan_offset = max(self._scan_offset, self._scan_offset + len(chunk) - keep)
        return found

    def wait_ready(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Seconds from start to the ready line; ServerStartError on early exit or timeout
        (the process group is stopped first)."""
        if self.proc is None:
            raise ServerStartError("wait_ready() before start()")
        deadline = self.started_at + timeout_s
        while True:
            if self._ready_in_log():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise ServerStartError(
                    f"server exited with code {code} during start-up; log tail:\n"
                    f"{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"server not ready after {timeout_s:.0f} s; log tail:\n{_tail(self.log_path)}")
            time.sleep(poll_s)

    def _group_alive(self, pgid: int) -> bool:
        if self.proc is not None:
            self.proc.poll()  # reap the launcher so its zombie does not count
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, grace_s: float = 30.0) -> float:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; returns seconds taken."""
        t0 = time.monotonic()
        if self.proc is None:
            return 0.0
        pgid = self.proc.pid  # start_new_session: the launcher leads its own group
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not self._group_alive(pgid):
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end and self._group_alive(pgid):
                time.sleep(0.25)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self.proc = None
        return time.monotonic() - t0
