"""Interpreter-start hook, imported by ``sglang_diffkv.pth`` in every Python process.

It only installs a ``sys.meta_path`` finder (microseconds, no imports beyond the stdlib).
When one of sglang's target modules is imported later, in whatever process (the scheduler
runs in ``multiprocessing`` spawn children, which re-run ``site`` and therefore this file),
the finder lets the module execute normally and then calls ``sglang_diffkv.sglang.plugin``
to patch it. Set ``SGLANG_DIFFKV_DISABLE=1`` to turn the hook off.

This file must never raise: a broken hook would break every Python program in the
environment, so any failure is reported on stderr and the hook is skipped.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any

DISABLE_ENV = "SGLANG_DIFFKV_DISABLE"

# module name -> name of the patch function in sglang_diffkv.sglang.plugin
TARGETS: dict[str, str] = {
    "sglang.srt.server_args": "patch_server_args",
    "sglang.srt.layers.attention.attention_registry": "patch_attention_registry",
    "sglang.srt.model_executor.model_runner_kv_cache_mixin": "patch_kv_cache_mixin",
    "sglang.srt.managers.schedule_policy": "patch_schedule_policy",
    "sglang.srt.managers.scheduler": "patch_scheduler",
    "sglang.srt.model_executor.model_runner": "patch_model_runner",
    "sglang.srt.layers.attention.triton_backend": "patch_triton_backend",
    "sglang.srt.mem_cache.memory_pool": "patch_memory_pool",
}


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _run_patch(name: str, module: Any) -> None:
    from sglang_diffkv.sglang import plugin  # deferred: only once sglang itself is loading

    getattr(plugin, TARGETS[name])(module)


class _PatchingLoader(importlib.abc.Loader):
    """Wraps the real loader: execute the module, then patch it."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            _run_patch(self._name, module)
        except Exception as e:  # noqa: BLE001 - sglang must stay importable without us
            sys.stderr.write(f"sglang_diffkv: could not patch {self._name}: {e!r}\n")

    def __getattr__(self, item: str) -> Any:  # get_source, get_code, ... for tracebacks
        return getattr(self._inner, item)


class PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PatchingLoader):
                    spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def install() -> bool:
    """Install the finder (idempotent); patch targets already imported. Returns whether the
    hook is active."""
    if disabled():
        return False
    if not any(isinstance(f, PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())
    for name in TARGETS:
        module = sys.modules.get(name)
        if module is not None:
            _run_patch(name, module)
    return True


try:
    install()
except Exception as e:  # noqa: BLE001 - must never break interpreter start-up
    sys.stderr.write(f"sglang_diffkv: import hook not installed: {e!r}\n")
