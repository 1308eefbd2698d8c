"""Model-runner side: per-token cell size and pool construction for diffkv.

Replaces ``ModelRunnerKVCacheMixin.get_cell_size_per_token`` and ``_init_pools`` when the
attention backend is diffkv (``plugin`` wraps them; other backends run SGLang's own code).

Capacity flow: SGLang profiles free memory ``rest`` and sets ``max_total_num_tokens =
rest // cell`` with our cell = bytes per logical token at the planning mix. ``_init_pools``
turns that budget back into bytes, takes the per-request state (page tables, counters) off
the top, fills the rest with unified pages, and sets the logical slot count from the pages.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.capacity import EXTRA_CONTEXT, CapacityPlan, cache_rows, capacity_report
from sglang_diffkv.config import ConfigError, DiffKVConfig
from sglang_diffkv.sglang.args import forced_settings
from sglang_diffkv.sglang.pool import (
    DiffKVPoolError,
    DiffKVReqToTokenPool,
    DiffKVTokenToKVPool,
    DiffKVTokenToKVPoolAllocator,
)

logger = logging.getLogger("sglang_diffkv")


def check_model(runner: Any) -> None:
    mc = runner.model_config
    if runner.use_mla_backend:
        raise DiffKVPoolError(
            "--attention-backend diffkv: MLA models are not supported; DiffKV compresses "
            "per-KV-head keys and values"
        )
    if getattr(mc, "is_hybrid_swa", False) or getattr(runner, "mambaish_config", None):
        raise DiffKVPoolError(
            "--attention-backend diffkv: hybrid sliding-window / linear-attention models are "
            "not supported in stage 1"
        )
    if getattr(mc, "is_encoder_decoder", False):
        raise DiffKVPoolError(
            "--attention-backend diffkv: encoder-decoder models are not supported"
        )
    if mc.head_dim != mc.v_head_dim:
        raise DiffKVPoolError(
            f"--attention-backend diffkv: head_dim {mc.head_dim} != v_head_dim {mc.v_head_dim} "
            "is not supported"
        )


def _num_kv_heads(runner: Any) -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return runner.model_config.get_num_kv_heads(get_attention_tp_size())


def _load_config() -> DiffKVConfig:
    try:
        return DiffKVConfig.from_env()
    except ConfigError as e:
        raise DiffKVPoolError(f"--attention-backend diffkv: {e}") from e


def plan_for(runner: Any, num_layers: int) -> CapacityPlan:
    check_model(runner)
    config = _load_config()
    try:
        return CapacityPlan.build(
            config, runner.model_config.head_dim, num_layers, _num_kv_heads(runner)
        )
    except ConfigError as e:
        raise DiffKVPoolError(f"--attention-backend diffkv: {e}") from e


def cell_size_per_token(runner: Any, num_layers: int) -> int:
    return plan_for(runner, num_layers).cell_bytes


def init_pools(runner: Any) -> None:
    """Build the request pool, the DiffKV pool and the logical-slot allocator on ``runner``."""
    if runner.req_to_token_pool is not None:
        raise DiffKVPoolError("--attention-backend diffkv: draft workers are not supported")
    num_layers = runner.end_layer - runner.start_layer
    plan = plan_for(runner, num_layers)
    max_reqs = runner.max_running_requests
    context_len = runner.model_config.context_len
    max_context = context_len + EXTRA_CONTEXT
    budget = runner.max_total_num_tokens * plan.cell_bytes
    num_pages, slots = plan.size_pool(runner.max_total_num_tokens, max_reqs, context_len)
    if num_pages < plan.min_pages:
        raise DiffKVPoolError(
            f"--attention-backend diffkv: the KV budget of {budget / 2**30:.2f} GiB leaves "
            f"{num_pages} pages after the page tables of {max_reqs} requests; one request "
            f"needs at least {plan.min_pages}. Raise --mem-fraction-static or lower "
            "--max-running-requests / --context-length"
        )
    cache = CompressedKVCache(
        plan.config,
        head_dim=plan.geometry.head_dim,
        num_layers=num_layers,
        num_kv_heads=plan.num_kv_heads,
        num_pages=num_pages,
        max_reqs=cache_rows(max_reqs),
        max_context=max_context,
        device=runner.device,
        validate=False,
    )
    kv = DiffKVTokenToKVPool(
        cache, plan, slots, num_layers, runner.device, runner.start_layer, runner.end_layer - 1
    )
    runner.token_to_kv_pool = kv
    runner.req_to_token_pool = DiffKVReqToTokenPool(
        kv,
        size=max_reqs,
        max_context_len=max_context,
        device=runner.device,
        enable_memory_saver=runner.server_args.enable_memory_saver,
    )
    runner.token_to_kv_pool_allocator = DiffKVTokenToKVPoolAllocator(
        slots, dtype=runner.kv_cache_dtype, device=runner.device, kvcache=kv
    )
    # The scheduler reads the slot count from here (tp_worker.get_worker_info).
    runner.max_total_num_tokens = slots
    for name, value, why in forced_settings():
        logger.info("diffkv: %s=%s (forced): %s", name, value, why)
    for line in capacity_report(plan, num_pages, slots, max_reqs, context_len):
        logger.info(line)
    if not kv.fits_empty_pool(context_len):
        logger.warning(
            "DiffKV KV cache: a %d-token prompt needs more pages than the pool has; such "
            "prompts can never be admitted", context_len,
        )
