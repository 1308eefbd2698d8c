"""The .pth import hook registers diffkv in every process, with no call from the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _fresh_python(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if k != "SGLANG_DIFFKV_DISABLE"}
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


META_PATH = "import sys; print([type(f).__name__ for f in sys.meta_path])"


def test_pth_hook_is_installed_at_interpreter_start_without_importing_sglang_or_torch():
    code = META_PATH + "; print('sglang' in sys.modules, 'torch' in sys.modules)"
    finders, loaded = _fresh_python(code).splitlines()
    assert "PostImportFinder" in finders, (
        "sglang_diffkv.pth is not active: install the package (pip install -e .)"
    )
    assert loaded == "False False"


def test_disable_env_turns_the_hook_off():
    assert "PostImportFinder" not in _fresh_python(META_PATH, SGLANG_DIFFKV_DISABLE="1")


def test_spawned_scheduler_style_child_sees_every_registration():
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_DIFFKV_DISABLE"}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "spawn_probe.py")],
        capture_output=True, text=True, env=env, timeout=600, cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])["child"]
    assert child["imported_at_start"] == {"sglang": False, "torch": False}
    assert child["choice"] and child["factory"] and child["post_init"]
    # ModelRunner inherits the patched mixin methods; the scheduler's PrefillAdder too.
    assert child["pools"] == child["cell"] == child["admission"] == "sglang_diffkv.sglang.plugin"


def test_register_is_idempotent_in_process():
    import harness  # noqa: F401  (imports sglang with the CPU stand-ins, registers once)
    from sglang.srt import server_args
    from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin

    from sglang_diffkv.sglang import plugin

    init_pools = ModelRunnerKVCacheMixin._init_pools
    plugin.register()
    plugin.register()
    assert server_args.ATTENTION_BACKEND_CHOICES.count("diffkv") == 1
    assert ModelRunnerKVCacheMixin._init_pools is init_pools


def test_loop_trace_wraps_the_scheduler_only_when_asked(tmp_path):
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import harness; "
            "from sglang.srt.managers.scheduler import Scheduler; "
            "from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool as P; "
            "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as T; "
            "from sglang.srt.model_executor.model_runner import ModelRunner as R; "
            "print(Scheduler.run_batch.__module__, Scheduler.self_check_during_idle.__module__, "
            "*(hasattr(f, '_sglang_diffkv_loop_traced') for f in "
            "(P.set_kv_buffer, T.forward_extend, T.init_forward_metadata, R.forward_extend)))")
    assert _fresh_python(code).splitlines()[-1].split() == [
        "sglang.srt.managers.scheduler", "sglang.srt.managers.scheduler_runtime_checker_mixin",
        *["False"] * 4]
    traced = _fresh_python(code, SGLANG_DIFFKV_LOOP_TRACE=str(tmp_path))
    assert traced.splitlines()[-1].split() == ["sglang_diffkv.loop_trace"] * 2 + ["True"] * 4


def test_loop_trace_times_the_diffkv_backend_when_it_is_built(tmp_path):
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import harness as H; "
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
