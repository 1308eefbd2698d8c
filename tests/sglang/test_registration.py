"""SGLang loads diffkv through its plugin entry point (``sglang.srt.plugins``) in every
process that calls ``load_plugins()``, with no call from the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY_POINT = "sglang_diffkv.sglang.plugin:register"


def _fresh_python(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("SGLANG_DIFFKV_DISABLE", "SGLANG_PLUGINS")}
    full_env.update(env)
    # harness.py beside this file, as pytest's pythonpath setting gives the test process
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, full_env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _spawned_child(**env: str) -> dict:
    """spawn_probe.py in a fresh interpreter: SGLang's load_plugins() in a spawned child."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("SGLANG_DIFFKV_DISABLE", "SGLANG_PLUGINS")}
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "spawn_probe.py")],
        capture_output=True, text=True, env=full_env, timeout=600, cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["child"]


def test_the_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "diffkv"]
    assert len(eps) == 1, "install the package (pip install -e .) for its entry point"
    assert eps[0].value == ENTRY_POINT
    from sglang_diffkv.sglang import plugin

    assert eps[0].load() is plugin.register


def test_load_plugins_in_a_spawned_scheduler_style_child_registers_everything():
    child = _spawned_child()
    assert child["imported_before_load"] == {"sglang": False, "plugin": False}
    assert child["choice"] and child["factory"]
    assert child["hooks"] and all(child["hooks"].values()), child["hooks"]
    assert child["parsed"] == {"attention_backend": "diffkv", "page_size": 1}
    assert child["radix_factory"] and child["radix_cache_backend"] == "diffkv"


@pytest.mark.parametrize("env", [{"SGLANG_DIFFKV_DISABLE": "1"},
                                 {"SGLANG_PLUGINS": "some-other-plugin"}])
def test_disable_env_or_plugin_selection_turns_it_off(env):
    child = _spawned_child(**env)
    assert not child["choice"] and not child["factory"] and not child["radix_factory"]
    assert not any(child["hooks"].values())
    assert child["parsed"] is None  # --attention-backend diffkv is not a valid choice


def test_register_is_idempotent_in_process():
    import harness  # noqa: F401  (imports sglang with the CPU stand-ins, registers once)
    from sglang.srt import server_args
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    from sglang_diffkv.sglang import plugin

    configure = KVCacheConfigurator.configure
    plugin.register()
    plugin.register()
    assert server_args.ATTENTION_BACKEND_CHOICES.count("diffkv") == 1
    assert KVCacheConfigurator.configure is configure
    assert all(plugin.hooks_applied().values())


def test_loop_trace_wraps_the_scheduler_only_when_asked(tmp_path):
    code = ("import harness; "
            "from sglang.srt.managers.scheduler import Scheduler; "
            "from sglang.srt.managers.scheduler_components.request_receiver import "
            "SchedulerRequestReceiver as Rx; "
            "from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool as P; "
            "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as T; "
            "from sglang.srt.model_executor.runner.eager_runner import EagerRunner as R; "
            "print(Scheduler.run_batch.__module__, Scheduler.on_idle.__module__, "
            "Scheduler.get_next_batch_to_run.__module__, Rx.recv_requests.__module__, "
            "*(hasattr(f, '_sglang_diffkv_loop_traced') for f in "
            "(P.set_kv_buffer, T.forward_extend, T.init_forward_metadata, R._execute_extend)))")
    assert _fresh_python(code).splitlines()[-1].split() == [
        *["sglang.srt.managers.scheduler"] * 3,
        "sglang.srt.managers.scheduler_components.request_receiver", *["False"] * 4]
    traced = _fresh_python(code, SGLANG_DIFFKV_LOOP_TRACE=str(tmp_path))
    assert traced.splitlines()[-1].split() == ["sglang_diffkv.sglang.loop_trace"] * 4 + ["True"] * 4


def test_loop_trace_times_the_diffkv_backend_when_it_is_built(tmp_path):
    code = ("import harness as H; "
            "from sglang_diffkv.sglang.backend import DiffKVAttnBackend as B; "
            "from sglang_diffkv.sglang.ops import DiffKVOps as O; "
            "import pytest; H.cpu_sglang_helpers(pytest.MonkeyPatch()); shape = H.ModelShape(); "
            "s = H.MiniScheduler(shape, H.budget_for_pages(shape, 600, 8)); "
            "print(type(s.runner.attn_backend).__name__, "
            "*(hasattr(f, '_sglang_diffkv_loop_traced') for f in (B.forward_extend, "
            "B.init_forward_metadata, O._score_and_compress, O.end_prefill_step)))")
    assert _fresh_python(code).splitlines()[-1].split() == ["DiffKVAttnBackend", *["False"] * 4]
    traced = _fresh_python(code, SGLANG_DIFFKV_LOOP_TRACE=str(tmp_path))
    assert traced.splitlines()[-1].split() == ["DiffKVAttnBackend", *["True"] * 4]
