"""The plugin against the newest SGLang release, ahead of the upgrade.

The suite runs on the SGLang it targets (0.5.17). The newest release is installed without its
dependencies into ``.sglang-next/`` (``scripts/setup_test_env.sh``; another directory with
``SGLANG_NEXT_DIR``), and this file runs itself in a subprocess with that directory first on
``PYTHONPATH``, so this process keeps its SGLang. The child checks, on that SGLang's own
classes: plugin registration, the ``ServerArgs`` fix-ups, and a small workload of the CPU
harness (``harness.MiniScheduler``) replayed on the reference cache as test_pool_backend.py
does, ending with SGLang's idle leak check.

A check that fails on a known release is a strict expected failure whose reason says what
differs and why, so a later release that fixes it (or a plugin change that adapts to it)
shows up as XPASS and fails the run until the mark is removed. A missing directory fails.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import traceback
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NEXT_DIR = os.path.abspath(
    os.environ.get("SGLANG_NEXT_DIR") or os.path.join(REPO, ".sglang-next"))
SETUP = "scripts/setup_test_env.sh"


def dist_version(directory: str) -> str | None:
    """The sglang version installed (pip --target) in ``directory``, or None."""
    for meta in glob.glob(os.path.join(directory, "sglang-*.dist-info", "METADATA")):
        with open(meta, encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


NEXT_VERSION = dist_version(NEXT_DIR)

# ---- what differs in each known release (the reasons of the strict xfails) ----------------

SERVER_ARGS_0_5_23 = (
    "sglang 0.5.23: the forced settings and refusals never run. Its ServerArgs is a msgspec "
    "Struct (msgspec.defstruct in server_args.py), no longer a dataclass, and msgspec binds "
    "__post_init__ when the class is created: HookRegistry's AROUND hook replaces the class "
    "attribute (hooks_applied() says True) but construction still calls the original. That "
    "__post_init__ is also empty now: resolution moved to ServerArgs.resolve_once -> "
    "arg_groups.pipeline.run_resolution_pipeline, which seals the record (writes raise) and "
    "takes decisions through declare_resolution / resolving_view. So the user's or SGLang's "
    "values stay (page_size None, or 16 when given; disable_radix_cache False; "
    "cuda_graph_backend_prefill None) and "
    "--pp-size 2 is accepted. Porting: hook resolve_once or a run_hook pipeline step "
    "(arg_groups.resolution_hooks) and declare the forced values there"
)
POOL_0_5_23 = (
    "sglang 0.5.23: the CPU harness cannot be built and the plugin cannot build its pools. "
    "Modules the harness imports are gone: sglang.srt.distributed.parallel_state_wrapper "
    "(ParallelState) and sglang.srt.mem_cache.chunk_cache (ChunkCache; a disabled radix "
    "cache is now a UnifiedRadixCache, mem_cache/registry.py). KVCacheConfigurator (now "
    "dataclass(slots=True)) has no `ps` field: parallel sizes come from "
    "runtime_context.get_parallel(), so the configure hook's kvc.ps.attn_tp_size "
    "(runner._num_kv_heads) raises AttributeError; the configurator also takes attn_dp_size "
    "and pp_size and reads resolved settings from runtime_context (get_memory(), "
    "get_schedule()), not from server_args"
)


def known_failure(reasons: dict[str, str]) -> pytest.MarkDecorator:
    """A strict xfail on the releases in ``reasons`` (version -> what differs and why)."""
    reason = reasons.get(NEXT_VERSION or "")
    return pytest.mark.xfail(reason is not None, reason=reason or "", strict=True)


# ---- the parent: run the child once, on the next SGLang ----------------------------------


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    if NEXT_VERSION is None:
        pytest.fail(f"no SGLang release in {NEXT_DIR} (SGLANG_NEXT_DIR): run {SETUP}, which "
                    "installs the newest release there (pip --no-deps --target)")
    env = dict(os.environ)
    env.pop("SGLANG_DIFFKV_DISABLE", None)
    env.pop("SGLANG_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (NEXT_DIR, REPO, os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result["error"]
    return result


def test_the_next_release_is_the_one_imported(child):
    got = _ok(child["version"])
    assert got["version"] == NEXT_VERSION
    assert got["file"].startswith(NEXT_DIR + os.sep), got["file"]


def test_plugin_registration(child):
    got = _ok(child["registration"])
    assert got["choice"] and got["factory"]
    assert got["hooks"] and all(got["hooks"].values()), got["hooks"]
    assert got["parsed"] == "diffkv"  # --attention-backend diffkv is accepted


@known_failure({"0.5.23": SERVER_ARGS_0_5_23})
def test_server_args_fix_ups(child):
    got = _ok(child["server_args"])
    assert got["built"] == got["forced"], "ServerArgs(attention_backend='diffkv')"
    assert got["parsed"] == got["forced"], "--page-size 16 --chunked-prefill-size 4096"
    assert got["refused"], "--pp-size 2 is not refused"


@known_failure({"0.5.23": POOL_0_5_23})
def test_pool_under_sglang_scheduler_classes(child):
    got = child["pool"]
    assert got["missing_modules"] == [], "modules the harness imports"
    assert got["configurator_fields_missing"] == [], "KVCacheConfigurator fields we read"
    _ok(got)
    assert got["finished"] == {"a": 8, "b": 5}  # every request ran to max_new_tokens
    assert got["compared"] == {"extend": 2, "decode": 7 + 4}  # matches the reference
    assert not got["leak"], got["leak_message"]  # SGLang's own idle check


# ---- the child: runs on the next SGLang (``python test_sglang_next.py``) -----------------

CONFIGURATOR_FIELDS_READ = (  # the harness passes / the configure hook reads
    "ps", "server_args", "device", "model_config", "kv_cache_dtype", "layer_info",
    "is_draft_worker", "req_to_token_pool", "use_mla_backend", "is_hybrid_swa",
)


def _check_version(out: dict[str, Any]) -> None:
    import sglang_cpu_env

    sglang_cpu_env.install()  # before the first import of sglang
    import sglang

    out.update(version=sglang.__version__, file=os.path.abspath(sglang.__file__))


def _check_registration(out: dict[str, Any]) -> None:
    from sglang_diffkv.sglang import plugin

    plugin.register()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, prepare_server_args

    parsed = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv"])
    out.update(hooks=plugin.hooks_applied(), choice="diffkv" in ATTENTION_BACKEND_CHOICES,
               factory=ATTENTION_BACKENDS.get("diffkv") is plugin.create_diffkv_backend,
               parsed=parsed.attention_backend)


def _check_server_args(out: dict[str, Any]) -> None:
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from sglang_diffkv.sglang.args import DiffKVUnsupportedError, forced_settings

    def fields(args: Any) -> dict[str, Any]:
        return {name: getattr(args, name) for name, _, _ in forced_settings()}

    built = ServerArgs(model_path="dummy", attention_backend="diffkv")
    parsed = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv",
                                  "--page-size", "16", "--chunked-prefill-size", "4096"])
    try:
        ServerArgs(model_path="dummy", attention_backend="diffkv", pp_size=2)
        refused = False
    except DiffKVUnsupportedError:
        refused = True
    out.update(forced={name: value for name, value, _ in forced_settings()},
               built=fields(built), parsed=fields(parsed), refused=refused)


def _check_pool(out: dict[str, Any]) -> None:
    with open(os.path.join(HERE, "harness.py"), encoding="utf-8") as f:
        modules = re.findall(r"^(?:from|import) (sglang\.[\w.]+)", f.read(), re.M)
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ImportError:
            missing.append(name)
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    have = {f.name for f in dataclasses.fields(KVCacheConfigurator)}
    out["missing_modules"] = missing
    out["configurator_fields_missing"] = [n for n in CONFIGURATOR_FIELDS_READ if n not in have]
    import harness as H
    import test_pool_backend as T

    H.cpu_sglang_helpers(pytest.MonkeyPatch())
    os.environ["SGLANG_DIFFKV_CONFIG"] = json.dumps(T.COMPRESSING)
    shape = H.ModelShape()
    s = H.MiniScheduler(shape, H.budget_for_pages(shape, 300, 8))
    s.add_request("a", [(7 * i) % 997 + 1 for i in range(30)], 8)
    s.add_request("b", [(3 * i) % 991 + 2 for i in range(20)], 5)
    s.run_until_idle()
    out["finished"] = {r.rid: len(r.output_ids) for r in s.finished}
    out["compared"] = T.replay_on_reference(s)
    leak, message = s.idle_leak_check()
    out["leak"], out["leak_message"] = leak, message
    T.assert_back_to_initial_state(s)


def _child_main() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, check in (("version", _check_version), ("registration", _check_registration),
                        ("server_args", _check_server_args), ("pool", _check_pool)):
        results[name] = out = {}
        try:
            check(out)
        except (Exception, SystemExit):  # (argparse exits) reported to the parent
            out["error"] = traceback.format_exc(limit=-4)
    return results


if __name__ == "__main__":
    print(json.dumps(_child_main(), default=str))
