"""SGLang's plugin entry point for ``--attention-backend diffkv``.

SGLang calls ``register`` (the ``sglang.srt.plugins`` entry point in pyproject.toml) from
``load_plugins()``: in the launching process before the command line is parsed, and in every
scheduler process before it builds its model runner. It uses SGLang's official hooks:

- ``add_attention_backend_choices`` makes ``diffkv`` a valid ``--attention-backend``;
- ``register_attention_backend`` makes ``create_diffkv_backend`` its factory;
- ``register_radix_cache_backend`` makes ``radix.create_tree_cache`` the factory of
  ``--radix-cache-backend diffkv`` (the ServerArgs hook selects it);
- ``HookRegistry`` (hooks applied by ``load_plugins``) for the five places that have
  no dedicated extension point. Each leaves every other backend on SGLang's own code:

  ============================================  ============================================
  target                                        why
  ============================================  ============================================
  ``ServerArgs.__post_init__``                  refusals and forced settings (``args``)
  ``KVCacheConfigurator.configure``             the DiffKV pools (``runner``)
  ``PrefillAdder.add_one_req``                  exact physical admission (``admission``)
  ``Scheduler.get_next_batch_to_run``           TP > 1: one agreed page count per step
                                                (``tp_agreement``)
  ``SamplingParams.verify`` (AFTER)             per-request parameters (``request_check``)
  ============================================  ============================================

SGLang's platform entry point (``sglang.srt.platforms``) can supply KV pool and allocator
classes, but only to an out-of-tree *hardware* platform: activating one switches the whole
process off SGLang's CUDA paths (graph runner, fused RoPE, quantisation, op dispatch), it is
activated for every server in the environment whatever its backend, and it cannot supply the
request-to-token pool. docs/backend.md ("SGLang hooks") lists each hook with the test that
fails if SGLang changes the function it wraps.

``SGLANG_DIFFKV_DISABLE=1`` makes ``register`` do nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_diffkv.sglang.args import BACKEND_NAME

logger = logging.getLogger("sglang_diffkv")

DISABLE_ENV = "SGLANG_DIFFKV_DISABLE"

# (dotted SGLang target, "module:function" of our AROUND hook)
HOOKS: tuple[tuple[str, str], ...] = (
    ("sglang.srt.server_args.ServerArgs.__post_init__",
     "sglang_diffkv.sglang.args:post_init_hook"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
     "sglang_diffkv.sglang.runner:configure_hook"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
     "sglang_diffkv.sglang.admission:add_one_req_hook"),
    ("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
     "sglang_diffkv.sglang.tp_agreement:scheduler_step_hook"),
)
# (dotted SGLang target, "module:function" of our AFTER hook)
AFTER_HOOKS: tuple[tuple[str, str], ...] = (
    ("sglang.srt.sampling.sampling_params.SamplingParams.verify",
     "sglang_diffkv.sglang.request_check:verify_hook"),
)

_registered = False


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """Register the backend and its hooks (idempotent). Inside ``load_plugins`` SGLang applies
    the hooks itself right after; called directly (tests, scripts) they are applied here."""
    global _registered
    if disabled():
        return
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_diffkv_backend)
    _register_radix_cache()
    if not _registered:
        for target, hook in HOOKS:
            HookRegistry.register(target, _resolve(hook), HookType.AROUND)
        for target, hook in AFTER_HOOKS:
            HookRegistry.register(target, _resolve(hook), HookType.AFTER)
        _registered = True
        _install_loop_trace()
    HookRegistry.apply_hooks()  # skips targets already patched


def _register_radix_cache() -> None:
    """``--radix-cache-backend diffkv``: SGLang's tree-cache registry builds the DiffKV
    radix cache (``sglang_diffkv.sglang.radix``) through it."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    from sglang_diffkv.sglang.radix import BACKEND_NAME as RADIX_NAME
    from sglang_diffkv.sglang.radix import create_tree_cache

    if get_radix_cache_factory(RADIX_NAME) is None:
        register_radix_cache_backend(RADIX_NAME, create_tree_cache)


def hooks_applied() -> dict[str, bool]:
    """Each hook target -> whether SGLang's function there is now wrapped by ours."""
    import pkgutil

    out = {}
    for target, hook in HOOKS + AFTER_HOOKS:
        owner, attr = target.rsplit(".", 1)
        fn = getattr(pkgutil.resolve_name(owner), attr)
        out[target] = _wraps(fn, _resolve(hook))
    return out


def _wraps(fn: Any, hook: Any) -> bool:
    # HookRegistry's AROUND wrapper is a closure over (original_fn, hook)
    cells = getattr(fn, "__closure__", None) or ()
    return any(c.cell_contents is hook for c in cells)


def _resolve(spec: str) -> Any:
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def create_diffkv_backend(runner: Any) -> Any:
    from sglang_diffkv.sglang.backend import DiffKVAttnBackend
    from sglang_diffkv.sglang.ops import DiffKVOps

    # with the loop trace on: where an eager prefill's launches go (the same span names as
    # the triton backend's, plus the kernel path's score-and-compress and reclaim)
    _time_methods(DiffKVAttnBackend, {"forward_extend": "attn_extend",
                                      "init_forward_metadata": "attn_metadata"})
    _time_methods(DiffKVOps, {"_score_and_compress": "compress",
                              "end_prefill_step": "reclaim"})
    return DiffKVAttnBackend(runner)


# ---- the scheduler loop trace (SGLANG_DIFFKV_LOOP_TRACE=DIR, any backend) ------------------


def _loop_trace_dir() -> str:
    from sglang_diffkv.sglang.loop_trace import TRACE_ENV

    return os.environ.get(TRACE_ENV, "").strip()


def _install_loop_trace() -> None:
    """With SGLANG_DIFFKV_LOOP_TRACE=DIR set, time the scheduler loop's phases into DIR
    (``sglang_diffkv.sglang.loop_trace``); without it nothing is wrapped."""
    trace_dir = _loop_trace_dir()
    if not trace_dir:
        return
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.request_receiver import (
        SchedulerRequestReceiver,
    )

    from sglang_diffkv.sglang.loop_trace import WRAPPED, install

    # the loop receives through its request_receiver (Scheduler.recv_requests before 0.5.17)
    missing = [m for m in WRAPPED if not hasattr(
        SchedulerRequestReceiver if m == "recv_requests" else Scheduler, m)]
    if missing or not hasattr(Scheduler, "on_idle"):
        logger.warning("DiffKV: loop trace off: this SGLang's Scheduler has no %s",
                       ", ".join(missing or ["on_idle"]))
        return
    if install(Scheduler, trace_dir, receiver_cls=SchedulerRequestReceiver):
        logger.info("DiffKV: scheduler loop trace on, written to %s when the loop idles",
                    trace_dir)
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    # the eager extend forward (ModelRunner.forward_extend before sglang 0.5.17)
    _time_methods(EagerRunner, {"_execute_extend": "runner_extend"})
    _time_methods(TritonAttnBackend, {"forward_extend": "attn_extend",
                                      "init_forward_metadata": "attn_metadata"})
    _time_methods(MHATokenToKVPool, {"set_kv_buffer": "kv_store"})


def _time_methods(cls: Any, spans: dict[str, str]) -> None:
    """With the loop trace on, each run_batch record carries the host time of these methods
    (method name -> span name) inside it."""
    if not _loop_trace_dir():
        return
    from sglang_diffkv.sglang.loop_trace import time_method

    for name, span in spans.items():
        if hasattr(cls, name):
            time_method(cls, name, span)
