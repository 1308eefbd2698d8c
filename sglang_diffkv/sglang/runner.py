"""Model-runner side: the DiffKV pools, built in place of SGLang's for ``--attention-backend
diffkv`` (``configure_hook``, an AROUND hook on ``KVCacheConfigurator.configure``; other
backends run SGLang's own code).

Capacity flow: SGLang profiles the free memory left for the KV cache (its
``_profile_available_bytes``: free memory after the weights, less the non-static slack).
That byte budget is split as our ``CapacityPlan`` says: the per-request state (page tables,
counters) off the top, the rest in unified pages; the logical slot count SGLang schedules
with follows from the pages at the planning density. SGLang's own constraints still apply:
``--max-total-tokens`` caps the planning tokens, and the request count comes from SGLang's
``resolve_max_num_reqs``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.capacity import EXTRA_CONTEXT, CapacityPlan, cache_rows, capacity_report
from sglang_diffkv.config import ConfigError, DiffKVConfig
from sglang_diffkv.model_record import ModelRecord, embedding_norms, guard
from sglang_diffkv.sglang.args import forced_settings, uses_diffkv
from sglang_diffkv.sglang.pool import (
    DiffKVPoolError,
    DiffKVReqToTokenPool,
    DiffKVTokenToKVPool,
    DiffKVTokenToKVPoolAllocator,
)
from sglang_diffkv.sglang.tp_agreement import tp_cpu_group

logger = logging.getLogger("sglang_diffkv")


def check_model(runner: Any) -> None:
    """``runner``: SGLang's KVCacheConfigurator (or anything with the same fields)."""
    mc = runner.model_config
    if runner.use_mla_backend:
        raise DiffKVPoolError(
            "--attention-backend diffkv: MLA models are not supported; DiffKV compresses "
            "per-KV-head keys and values"
        )
    if getattr(runner, "is_hybrid_swa", False) or getattr(runner, "mambaish_config", None):
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


def chunked_prefill_line(server_args: Any, config: DiffKVConfig) -> str:
    """The start-up line saying how prompts are prefilled."""
    chunk = getattr(server_args, "chunked_prefill_size", None)
    if chunk is None or chunk <= 0:
        return (f"DiffKV chunked prefill: off (--chunked-prefill-size {chunk}): every prompt "
                "is scored and compressed in one extend")
    return (f"DiffKV chunked prefill: chunks of {chunk} tokens; a longer prompt's earlier "
            "chunks stay at the high tier (the whole prompt's all-high pages, reserved at "
            "admission) until its last chunk scores every token with the prompt's last "
            f"{config.score_queries} queries and compresses it")


def _num_kv_heads(runner: Any) -> int:
    """KV heads this rank stores (its attention-TP share)."""
    return runner.model_config.get_num_kv_heads(runner.ps.attn_tp_size)


def _layers(runner: Any) -> tuple[int, int]:
    """(first layer, number of layers) this rank stores."""
    info = runner.layer_info
    return info.start_layer, info.num_effective_layers


def _load_config() -> DiffKVConfig:
    try:
        return DiffKVConfig.from_env()
    except ConfigError as e:
        raise DiffKVPoolError(f"--attention-backend diffkv: {e}") from e


def served_model(runner: Any) -> ModelRecord:
    """The served model's record: its HF config, named by --model-path, with the weights
    fingerprint when the loaded model exposes its input embedding (SGLang's causal LMs do;
    the model is loaded before the KV cache is sized)."""
    model = getattr(runner, "model", None)
    norms = None
    get_embedding = getattr(model, "get_input_embeddings", None)
    if callable(get_embedding):
        weight = getattr(get_embedding(), "weight", None)
        if weight is not None and getattr(weight, "ndim", 0) == 2:
            norms = embedding_norms(weight)
    path = str(runner.server_args.model_path)
    return ModelRecord.from_hf_config(runner.model_config.hf_config,
                                      Path(path.rstrip("/")).name or path, norms)


def check_calibrated_model(runner: Any, config: DiffKVConfig) -> None:
    """The preset's recorded model against the served one (model_record.guard): a refusal
    stops the start-up, a mismatch is a warning."""
    dummy = str(getattr(runner.server_args, "load_format", "auto")).lower() == "dummy"
    verdict = guard(config.name, config.calibrated_for, served_model(runner),
                    alpha_l=config.alpha_l, allow_other_model=config.allow_other_model,
                    bench_mode=config.bench_mix is not None, dummy_weights=dummy)
    if verdict.refusal is not None:
        raise DiffKVPoolError(verdict.refusal)
    if verdict.warning is not None:
        logger.warning(verdict.warning)


def plan_for(runner: Any, num_layers: int) -> CapacityPlan:
    check_model(runner)
    config = _load_config()
    check_calibrated_model(runner, config)
    try:
        return CapacityPlan.build(
            config, runner.model_config.head_dim, num_layers, _num_kv_heads(runner)
        )
    except ConfigError as e:
        raise DiffKVPoolError(f"--attention-backend diffkv: {e}") from e


def configure_hook(original: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``KVCacheConfigurator.configure``: the DiffKV pools when the backend is diffkv."""
    if not uses_diffkv(kvc.server_args):
        return original(kvc, *args, **kwargs)
    pre_model_load_memory = kwargs.get("pre_model_load_memory", args[0] if args else None)
    return build_pools(kvc, kvc._profile_available_bytes(pre_model_load_memory))


def build_pools(kvc: Any, budget_bytes: int) -> Any:
    """SGLang's ``KVCacheConfigResult`` for a KV budget of ``budget_bytes`` on ``kvc``."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigResult
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    if kvc.req_to_token_pool is not None or kvc.is_draft_worker:
        raise DiffKVPoolError("--attention-backend diffkv: draft workers are not supported")
    start_layer, num_layers = _layers(kvc)
    plan = plan_for(kvc, num_layers)
    # planning tokens: the budget at the planning density, capped by --max-total-tokens
    tokens = kvc._apply_token_constraints(budget_bytes // plan.cell_bytes)
    max_reqs = kvc.resolve_max_num_reqs(tokens)
    kv, req_pool, allocator, slots = init_pools(kvc, plan, tokens, max_reqs, start_layer)
    config = MemoryPoolConfig(max_total_num_tokens=slots, max_running_requests=max_reqs,
                              mem_fraction_static=kvc.server_args.mem_fraction_static)
    return KVCacheConfigResult(
        max_total_num_tokens=slots, max_running_requests=max_reqs,
        full_max_total_num_tokens=None, swa_max_total_num_tokens=None,
        req_to_token_pool=req_pool, token_to_kv_pool=kv, token_to_kv_pool_allocator=allocator,
        memory_pool_config=config,
    )


def init_pools(kvc: Any, plan: CapacityPlan, tokens: int, max_reqs: int, start_layer: int
               ) -> tuple[DiffKVTokenToKVPool, DiffKVReqToTokenPool,
                          DiffKVTokenToKVPoolAllocator, int]:
    """The DiffKV pool, the request pool and the logical-slot allocator for ``tokens``
    planning tokens and ``max_reqs`` requests; returns them and the logical slot count."""
    num_layers = plan.num_layers
    context_len = kvc.model_config.context_len
    max_context = context_len + EXTRA_CONTEXT
    budget = tokens * plan.cell_bytes
    num_pages, slots = plan.size_pool(tokens, max_reqs, context_len)
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
        device=kvc.device,
        validate=False,
    )
    kv = DiffKVTokenToKVPool(
        cache, plan, slots, num_layers, kvc.device, start_layer, start_layer + num_layers - 1
    )
    tp_group = tp_cpu_group(kvc.ps)
    if tp_group is not None:  # TP > 1: one free-page count for every rank's scheduler
        kv.agree_across_ranks(tp_group)
    req_pool = DiffKVReqToTokenPool(
        kv,
        size=max_reqs,
        max_context_len=max_context,
        device=kvc.device,
        enable_memory_saver=kvc.server_args.enable_memory_saver,
    )
    allocator = DiffKVTokenToKVPoolAllocator(
        slots, dtype=kvc.kv_cache_dtype, device=kvc.device, kvcache=kv
    )
    for name, value, why in forced_settings():
        logger.info("diffkv: %s=%s (forced): %s", name, value, why)
    logger.info(chunked_prefill_line(kvc.server_args, plan.config))
    for line in capacity_report(plan, num_pages, slots, max_reqs, context_len):
        logger.info(line)
    if not kv.fits_empty_pool(context_len):
        logger.warning(
            "DiffKV KV cache: a %d-token prompt needs more pages than the pool has; such "
            "prompts can never be admitted", context_len,
        )
    return kv, req_pool, allocator, slots
