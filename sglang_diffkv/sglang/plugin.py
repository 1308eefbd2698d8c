"""The patches the import hook applies to sglang 0.5.10.post1, one function per module.

Every patch is idempotent (newer sglang may also call ``register`` through its
``sglang.srt.plugins`` entry point) and leaves other attention backends on SGLang's own code.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_diffkv.sglang.args import BACKEND_NAME, uses_diffkv, wrap_post_init

logger = logging.getLogger("sglang_diffkv")

_MARK = "_sglang_diffkv_patched"


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group, and the manual way in: install the
    post-import hook (unless SGLANG_DIFFKV_DISABLE is set) and patch what is loaded."""
    from sglang_diffkv.sglang import _bootstrap

    _bootstrap.install()


def _once(obj: Any) -> bool:
    """True the first time it is asked for ``obj``."""
    if getattr(obj, _MARK, False):
        return False
    setattr(obj, _MARK, True)
    return True


def patch_server_args(mod: Any) -> None:
    """``--attention-backend diffkv`` is an accepted choice; ServerArgs applies our fix-ups."""
    if not _once(mod):
        return
    if BACKEND_NAME not in mod.ATTENTION_BACKEND_CHOICES:
        mod.add_attention_backend_choices([BACKEND_NAME])
    mod.ServerArgs.__post_init__ = wrap_post_init(mod.ServerArgs.__post_init__)


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


def patch_attention_registry(mod: Any) -> None:
    if not _once(mod):
        return
    mod.register_attention_backend(BACKEND_NAME)(create_diffkv_backend)


def patch_kv_cache_mixin(mod: Any) -> None:
    """Cell size and pool construction; ModelRunner inherits both from the mixin."""
    cls = mod.ModelRunnerKVCacheMixin
    if not _once(cls):
        return
    original_cell = cls.get_cell_size_per_token
    original_init = cls._init_pools

    def get_cell_size_per_token(self: Any, num_layers: int) -> int:
        if uses_diffkv(self.server_args):
            from sglang_diffkv.sglang.runner import cell_size_per_token

            return cell_size_per_token(self, num_layers)
        return original_cell(self, num_layers)

    def _init_pools(self: Any) -> None:
        if uses_diffkv(self.server_args):
            from sglang_diffkv.sglang.runner import init_pools

            return init_pools(self)
        return original_init(self)

    cls.get_cell_size_per_token = get_cell_size_per_token
    cls._init_pools = _init_pools


def patch_schedule_policy(mod: Any) -> None:
    """Exact physical admission: a prompt joins a prefill batch only if its all-high pages,
    plus the next decode step's reserve for every request, fit in the free pages. (The token
    budget SGLang keeps is in logical slots and cannot see the per-request page rounding.)"""
    cls = mod.PrefillAdder
    if not _once(cls):
        return
    original = cls.add_one_req
    no_token = mod.AddReqResult.NO_TOKEN

    def add_one_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        kv = getattr(self.token_to_kv_pool_allocator, "diffkv_pool", None)
        if kv is None:
            return original(self, req, *args, **kwargs)
        pages, reqs = getattr(self, "_diffkv_pending", (0, 0))
        need = kv.prefill_pages(req.extend_input_len)
        if not kv.admits(pages + need, reqs + 1):
            if not kv.fits_empty_pool(req.extend_input_len):
                logger.error(
                    "DiffKV: a %d-token prompt can never fit in %d pages (rid %s)",
                    req.extend_input_len, kv.num_pages, getattr(req, "rid", "?"),
                )
            return no_token
        before = len(self.can_run_list)
        result = original(self, req, *args, **kwargs)
        if len(self.can_run_list) > before:
            self._diffkv_pending = (pages + need, reqs + 1)
        return result

    cls.add_one_req = add_one_req


def patch_scheduler(mod: Any) -> None:
    """With SGLANG_DIFFKV_LOOP_TRACE=DIR set, time the scheduler loop's phases into DIR
    (``sglang_diffkv.loop_trace``); without it the scheduler is left as it is."""
    from sglang_diffkv.loop_trace import install

    trace_dir = _loop_trace_dir()
    if trace_dir and install(mod.Scheduler, trace_dir):
        logger.info("DiffKV: scheduler loop trace on, written to %s when the loop idles",
                    trace_dir)


def _loop_trace_dir() -> str:
    from sglang_diffkv.loop_trace import TRACE_ENV

    return os.environ.get(TRACE_ENV, "").strip()


def _time_methods(cls: Any, spans: dict[str, str]) -> None:
    """With the loop trace on, each run_batch record carries the host time of these methods
    (method name -> span name) inside it."""
    if not _loop_trace_dir():
        return
    from sglang_diffkv.loop_trace import time_method

    for name, span in spans.items():
        time_method(cls, name, span)


def patch_model_runner(mod: Any) -> None:
    _time_methods(mod.ModelRunner, {"forward_extend": "runner_extend"})


def patch_triton_backend(mod: Any) -> None:
    _time_methods(mod.TritonAttnBackend, {"forward_extend": "attn_extend",
                                          "init_forward_metadata": "attn_metadata"})


def patch_memory_pool(mod: Any) -> None:
    _time_methods(mod.MHATokenToKVPool, {"set_kv_buffer": "kv_store"})
