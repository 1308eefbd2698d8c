"""Resolve a deployment (model, GPU, KV format, settings, calibration) into what one replica
needs: the KV pool, the scheduler limits and the cost model, with SGLang's derived values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_diffkv.serving_io.trace import MOONCAKE_BLOCK_TOKENS
from simulator.kv.formats import KVFormat
from simulator.kv.pool import KVPool
from simulator.serving.cost import CostModel
from simulator.serving.memory import (
    MemoryBudget,
    cuda_graph_batch_sizes,
    default_chunk_and_graph,
    default_max_running_requests,
    kv_memory_budget,
    mem_fraction_static,
)
from simulator.serving.prefix_cache import PrefixCache
from simulator.serving.scheduler import Scheduler, SchedulerLimits
from simulator.serving.settings import DIFFKV_DEFAULT_CUDA_GRAPH_MAX_BS, ServerSettings
from simulator.specs.calibration import Calibration
from simulator.specs.gpu import GPUSpec
from simulator.specs.model import ModelSpec


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    gpu: GPUSpec
    kv_format: KVFormat
    settings: ServerSettings
    calibration: Calibration


class ResolvedServer:
    """Fixed after construction (the pool and the cost model only keep pure memo caches);
    replicas each build their own Scheduler from it."""

    def __init__(self, d: Deployment):
        s, model, gpu = d.settings, d.model, d.gpu
        model.check_tp(s.tp)
        self.deployment = d
        chunk_default, graph_default = default_chunk_and_graph(gpu.memory_mib, s.tp)
        chunk = s.chunked_prefill_size if s.chunked_prefill_size is not None else chunk_default
        self.chunked_prefill_size: int | None = None if chunk == -1 else chunk
        if d.kv_format.calibration_key == "diffkv":
            # the diffkv backend's own default (sglang_diffkv.sglang.args.apply_defaults),
            # set before SGLang sizes its memory, so mem_fraction_static sees it too
            graph_default = DIFFKV_DEFAULT_CUDA_GRAPH_MAX_BS
        self.cuda_graph_max_bs = s.cuda_graph_max_bs or graph_default
        self.mem_fraction_static = s.mem_fraction_static or mem_fraction_static(
            gpu.memory_mib, chunk, s.max_prefill_tokens, self.cuda_graph_max_bs, s.tp,
            s.enable_piecewise_cuda_graph)
        self.budget: MemoryBudget = kv_memory_budget(gpu, model, s.tp, self.mem_fraction_static,
                                                     d.calibration)
        # SGLang's order: the profiled token count (capped by --max-total-tokens) sets the
        # default request limit, then the pool is built from it (DiffKV's pages lose the
        # per-request page tables there, so the pool's own token count can be lower)
        profiled = d.kv_format.max_total_num_tokens(model, s.tp, self.budget.kv_rest)
        if s.max_total_tokens is not None:
            profiled = min(profiled, s.max_total_tokens)
        self.context_len = s.context_len or model.context_len
        self.max_running_requests = s.max_running_requests or default_max_running_requests(
            profiled, self.context_len)
        self.pool: KVPool = d.kv_format.build_pool(model, s.tp, profiled,
                                                   self.max_running_requests, self.context_len)
        tokens = self.pool.token_capacity
        self.limits = SchedulerLimits(
            chunked_prefill_size=self.chunked_prefill_size,
            max_prefill_tokens=s.max_prefill_tokens,
            max_running_requests=self.max_running_requests,
            context_len=self.context_len,
            max_req_len=min(self.context_len - 1, tokens - 1),
            conservativeness=s.schedule_conservativeness,
            enable_mixed_chunk=s.enable_mixed_chunk,
            ignore_eos_admission=s.disable_radix_cache and s.ignore_eos,
        )
        self.graph_sizes = cuda_graph_batch_sizes(self.cuda_graph_max_bs)
        self.cost = CostModel(model, gpu, d.calibration, self.pool, d.kv_format.calibration_key,
                              s.tp, self.graph_sizes, not s.disable_cuda_graph)

    @property
    def prefix_cache_enabled(self) -> bool:
        """SGLang's radix cache, unless disabled. Modelled for page-size-1 token pools (bf16,
        fp8); DiffKV is replayed as its calibration runs served it, without one (the cost of a
        suffix over a compressed prefix is not measured yet), and paged uniform formats are
        not modelled with it (their requests would hold partial pages of cached prefixes)."""
        return (not self.deployment.settings.disable_radix_cache and self.pool.unit == "tokens"
                and getattr(self.pool, "page_size", 1) == 1)

    def new_scheduler(self, seed: int, prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS
                      ) -> Scheduler:
        """A scheduler for one replica; its radix-cache model keys on prefix ids that name
        blocks of ``prefix_block_tokens`` (the workload's)."""
        cache = PrefixCache(prefix_block_tokens) if self.prefix_cache_enabled else None
        return Scheduler(self.pool, self.limits, np.random.default_rng(seed), cache)

    def describe(self) -> dict[str, Any]:
        d = self.deployment
        return {
            "model": d.model.name, "gpu": d.gpu.key, "tp": d.settings.tp,
            "kv_format": d.kv_format.name, "kv_format_detail": d.kv_format.describe(),
            "mem_fraction_static": self.mem_fraction_static,
            "memory": self.budget.to_dict(),
            "kv_pool_units": self.pool.capacity, "kv_pool_unit": self.pool.unit,
            "kv_pool_tokens": self.pool.token_capacity,
            "max_running_requests": self.max_running_requests,
            "chunked_prefill_size": self.chunked_prefill_size,
            "max_prefill_tokens": d.settings.max_prefill_tokens,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "context_len": self.context_len,
            "prefix_cache": self.prefix_cache_enabled,
            "calibration": d.calibration.source_file,
        }
