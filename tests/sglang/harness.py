"""A CPU stand-in for one SGLang scheduler + model runner, driving real SGLang objects.

Real: ServerArgs (with our fix-ups), ModelRunnerKVCacheMixin's (patched) cell size and pool
construction, ReqToTokenPool / allocator / KV pool subclasses, ChunkCache, Req, PrefillAdder
(with our admission patch), ScheduleBatch.prepare_for_extend / prepare_for_decode /
check_decode_mem / retract_decode, release_kv_cache, ForwardBatch.init_new, RadixAttention
and the scheduler's own idle memory checks. Stand-ins: the transformer (q/k/v are a fixed
function of (token id, position, layer) so a retracted request recomputes the same K/V) and
the sampler (next token = a hash of the last one).

Two helpers SGLang runs as Triton kernels on GPUs (req_to_token writes, extend positions)
take their torch paths here, exactly as SGLang does for its torch_native backend.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import sglang_cpu_env  # noqa: E402

sglang_cpu_env.install()

import torch  # noqa: E402

from sglang_diffkv.sglang import plugin  # noqa: E402

plugin.register()  # idempotent; in an installed environment the .pth hook already did it

import sglang.srt.mem_cache.common as mem_common  # noqa: E402
import sglang.srt.model_executor.forward_batch_info as fbi  # noqa: E402
from sglang.srt.layers import dp_attention  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.managers.scheduler_runtime_checker_mixin import (  # noqa: E402
    SchedulerRuntimeCheckerMixin,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.model_executor.model_runner_kv_cache_mixin import (  # noqa: E402
    ModelRunnerKVCacheMixin,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

VOCAB = 1000


def cpu_sglang_helpers(monkeypatch: Any) -> None:
    """Torch paths for SGLang's Triton helper kernels; TP size 1 without process groups."""
    monkeypatch.setattr(mem_common, "support_triton", lambda backend: False)
    monkeypatch.setattr(fbi, "support_triton", lambda backend: False)
    monkeypatch.setattr(fbi, "enable_num_token_non_padded", lambda server_args: False)
    monkeypatch.setattr(dp_attention, "get_attention_tp_size", lambda: 1)


@dataclass
class ModelShape:
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    context_len: int = 512
    dtype: torch.dtype = torch.float32  # the Triton kernels want bf16/fp16 activations

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5


def budget_for_pages(shape: ModelShape, pages: int, max_reqs: int) -> int:
    """A KV memory budget that gives the DiffKV pool exactly ``pages`` pages for ``shape``
    under the current SGLANG_DIFFKV_CONFIG."""
    from sglang_diffkv.capacity import CapacityPlan, cache_rows
    from sglang_diffkv.config import DiffKVConfig

    plan = CapacityPlan.build(DiffKVConfig.from_env(), shape.head_dim, shape.num_layers,
                              shape.num_kv_heads)
    state = plan.request_state_bytes(cache_rows(max_reqs), shape.context_len + 4)
    # + one cell: the runner rounds the budget down to whole logical tokens
    return state + pages * (plan.geometry.page_bytes + 4) + plan.cell_bytes


class FakeModelConfig:
    def __init__(self, shape: ModelShape) -> None:
        self.head_dim = shape.head_dim
        self.v_head_dim = shape.head_dim
        self.num_attention_heads = shape.num_q_heads
        self.context_len = shape.context_len
        self.num_kv = shape.num_kv_heads
        self.is_hybrid_swa = False
        self.is_encoder_decoder = False
        self.is_multimodal = False
        self.is_matryoshka = False
        self.vocab_size = VOCAB
        self.hf_config = SimpleNamespace()

    def get_num_kv_heads(self, tp_size: int) -> int:
        return self.num_kv // tp_size


class FakeRunner(ModelRunnerKVCacheMixin):
    """What SGLang's ModelRunner holds that the pools, ForwardBatch and backend read."""

    def __init__(self, server_args: ServerArgs, shape: ModelShape, kv_budget_bytes: int,
                 max_running_requests: int, *, use_mla_backend: bool = False,
                 hybrid_swa: bool = False) -> None:
        self.server_args = server_args
        self.model_config = FakeModelConfig(shape)
        self.model_config.is_hybrid_swa = hybrid_swa
        self.device = "cpu"
        self.use_mla_backend = use_mla_backend
        self.mambaish_config = None
        self.is_hybrid_swa = False
        self.is_draft_worker = False
        self.start_layer, self.end_layer = 0, shape.num_layers
        self.kv_cache_dtype = torch.bfloat16
        self.req_to_token_pool = None
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.use_ngram_embedding = False
        self.model_is_mrope = False
        self.lora_manager = None
        self.max_running_requests = max_running_requests
        # profile_max_num_token's arithmetic, with a fixed budget instead of free GPU memory
        self.max_total_num_tokens = kv_budget_bytes // self.get_cell_size_per_token(
            shape.num_layers
        )
        self._init_pools()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.attn_backend = ATTENTION_BACKENDS[server_args.attention_backend](self)


def fake_qkv(ids: torch.Tensor, pos: torch.Tensor, layer: int, shape: ModelShape
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic q/k/v per (token id, position, layer): a stand-in transformer.
    Pseudo-random rows from sin of a large per-token phase (vectorised, no per-token RNG)."""
    out = []
    seed = (ids.long() * 1009 + pos.long() * 9176 + layer * 131).double()
    scale = 1.0 + 3.0 * (ids % 5 == 0).double()  # some tokens draw much more attention
    for which, heads in enumerate((shape.num_q_heads, shape.num_kv_heads, shape.num_kv_heads)):
        freq = torch.arange(1, heads * shape.head_dim + 1, dtype=torch.float64) * (0.7548 + which)
        rows = torch.sin(seed[:, None] * freq[None, :] + which) * 1.7 * scale[:, None]
        out.append(rows.to(shape.dtype))
    return out[0], out[1], out[2]


def next_token(last: int) -> int:
    return (last * 7 + 3) % VOCAB


@dataclass
class StepRecord:
    mode: str
    rids: list[str]
    # per layer: (q, k, v) fed and o returned, rows in batch order
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    seq_lens: list[int]
    req_pool_indices: list[int]
    counts_after: torch.Tensor | None = None  # DiffKV counters of these requests after the step


@dataclass
class MiniScheduler(SchedulerRuntimeCheckerMixin):
    """The scheduler loop's memory-relevant steps, on SGLang's own objects."""

    shape: ModelShape
    kv_budget_bytes: int
    max_running_requests: int = 8
    server_args: ServerArgs = field(init=False)
    waiting: list[Req] = field(default_factory=list)
    running: ScheduleBatch | None = None
    finished: list[Req] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    retractions: int = 0
    new_token_ratio: float = 0.7
    # decode rows appended as CUDA-graph padding does: out_cache_loc 0, stale req_pool_idx
    pad_decode_rows: int = 0
    padded_rows_seen: int = 0
    padded_outputs: list[torch.Tensor] = field(default_factory=list)
    max_peak_logical_used: int = 0
    # CUDA-graph decode as SGLang's CudaGraphRunner drives the backend (capture sizes; empty:
    # eager). Emulated on the CPU: the "graph" is the captured metadata re-run as recorded.
    graph_bs: tuple[int, ...] = ()
    graph_replays: int = 0

    def __post_init__(self) -> None:
        self.server_args = ServerArgs(model_path="dummy", attention_backend="diffkv")
        set_global_server_args_for_scheduler(self.server_args)
        self.runner = FakeRunner(self.server_args, self.shape, self.kv_budget_bytes,
                                 self.max_running_requests)
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.token_to_kv_pool_allocator = self.runner.token_to_kv_pool_allocator
        self.kv_pool = self.runner.token_to_kv_pool
        self.max_total_num_tokens = self.runner.max_total_num_tokens
        self.tree_cache = ChunkCache(CacheInitParams(
            disable=True,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            page_size=1,
            chunked_prefill_size=self.server_args.chunked_prefill_size,
        ))
        self.layers = [
            RadixAttention(self.shape.num_q_heads, self.shape.head_dim, self.shape.scaling,
                           self.shape.num_kv_heads, layer_id=i)
            for i in range(self.shape.num_layers)
        ]
        if self.graph_bs:
            self._capture_graphs()

    # -- CUDA-graph decode, as CudaGraphRunner drives it ------------------------------------

    def _capture_graphs(self) -> None:
        backend = self.runner.attn_backend
        n = max(self.graph_bs)
        backend.init_cuda_graph_state(n, n)
        fill = backend.get_cuda_graph_seq_len_fill_value()
        # DecodeInputBuffers: stale rows past a replay's batch keep their old values, except
        # seq_lens (refilled with the fill value when the batch is padded)
        self.g_req = torch.zeros(n, dtype=torch.int64)
        self.g_seq = torch.full((n,), fill, dtype=torch.int64)
        self.g_seq_cpu = self.g_seq.clone()
        self.g_ids = torch.zeros(n, dtype=torch.int64)
        self.g_pos = torch.zeros(n, dtype=torch.int64)
        self.captured: dict[int, Any] = {}
        for bs in sorted(self.graph_bs, reverse=True):  # SGLang captures largest first
            backend.init_forward_metadata_capture_cuda_graph(
                bs, bs, self.g_req[:bs], self.g_seq[:bs], None, fbi.ForwardMode.DECODE, None)
            self.captured[bs] = backend.forward_metadata
            self._graph_forward(bs)

    def _graph_forward(self, bs: int) -> list[torch.Tensor]:
        backend = self.runner.attn_backend
        backend.forward_metadata = self.captured[bs]  # a graph replays its capture's inputs
        outs = []
        for layer in self.layers:
            q, k, v = fake_qkv(self.g_ids[:bs], self.g_pos[:bs], layer.layer_id, self.shape)
            outs.append((q, k, v, backend.forward_decode(q, k, v, layer, None)))
        return outs

    def _replay(self, fb: Any) -> list[tuple[torch.Tensor, ...]]:
        raw = fb.batch_size
        bs = min(b for b in self.graph_bs if b >= raw)
        fill = self.runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        if bs != raw:
            self.g_seq.fill_(fill)
            self.g_seq_cpu.fill_(fill)
        for buf, src in ((self.g_req, fb.req_pool_indices), (self.g_seq, fb.seq_lens),
                         (self.g_seq_cpu, fb.seq_lens_cpu), (self.g_ids, fb.input_ids),
                         (self.g_pos, fb.positions)):
            buf[:raw].copy_(src)
        self.runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.g_req[:bs], self.g_seq[:bs], int(self.g_seq[:bs].sum()), None,
            fbi.ForwardMode.DECODE, None, seq_lens_cpu=self.g_seq_cpu[:bs])
        self.graph_replays += 1
        self.padded_rows_seen += bs - raw
        return self._graph_forward(bs)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, rid: str, prompt: list[int], max_new_tokens: int,
                    custom_params: dict[str, Any] | None = None) -> Req:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                            custom_params=custom_params)
        sp.normalize(None)
        req = Req(rid, "", list(prompt), sp, vocab_size=VOCAB)
        self.waiting.append(req)
        return req

    # -- one scheduler iteration ----------------------------------------------------------

    def step(self) -> str:
        """Prefill new requests if any fit, else decode the running batch. Returns what ran."""
        batch = self._new_prefill_batch()
        if batch is not None:
            self._run(batch)
            self._process(batch)
            if self.running is None or self.running.is_empty():
                self.running = batch
            else:
                self.running.merge_batch(batch)
            self._drop_finished()
            return "prefill"
        if self.running is None or self.running.is_empty():
            return "idle"
        if not self.running.check_decode_mem():
            retracted, self.new_token_ratio, aborted = self.running.retract_decode(
                self.server_args
            )
            self.retractions += len(retracted)
            for r in aborted:
                self.finished.append(r)
            self.waiting = retracted + self.waiting
            if self.running.is_empty():
                return "retract"
        self.running.prepare_for_decode()
        self._run(self.running)
        self._process(self.running)
        self._drop_finished()
        return "decode"

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.step() == "idle" and not self.waiting:
                return
        raise AssertionError("requests did not finish")

    def _new_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting:
            return None
        running = self.running if self.running is not None else ScheduleBatch(reqs=[])
        adder = PrefillAdder(
            1, self.tree_cache, self.token_to_kv_pool_allocator, running,
            self.new_token_ratio, rem_input_tokens=16384, rem_chunk_tokens=None,
        )
        for req in list(self.waiting):
            if len(running.reqs) + len(adder.can_run_list) >= self.max_running_requests:
                break
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        if not adder.can_run_list:
            return None
        self.waiting = [r for r in self.waiting if r not in adder.can_run_list]
        batch = ScheduleBatch.init_new(
            adder.can_run_list, self.req_to_token_pool, self.token_to_kv_pool_allocator,
            self.tree_cache, self.runner.model_config, False, SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        return batch

    def _run(self, batch: ScheduleBatch) -> None:
        mwb = batch.get_model_worker_batch()
        fb = fbi.ForwardBatch.init_new(mwb, self.runner)
        real = fb.batch_size
        ids = fb.input_ids
        is_decode = fb.forward_mode.is_decode()
        n_real_tokens = real if is_decode else int(fb.input_ids.shape[0])
        record = StepRecord(
            "decode" if is_decode else "extend",
            [r.rid for r in batch.reqs], [], fb.positions[:n_real_tokens].clone(),
            fb.seq_lens[:real].tolist(), fb.req_pool_indices[:real].tolist(),
        )
        if is_decode and self.graph_bs and real <= max(self.graph_bs):
            layers = self._replay(fb)
        else:
            if self.pad_decode_rows and is_decode:
                self._pad(fb, self.pad_decode_rows)
            self.runner.attn_backend.init_forward_metadata(fb)
            layers = []
            for layer in self.layers:
                q, k, v = fake_qkv(fb.input_ids, fb.positions, layer.layer_id, self.shape)
                layers.append((q, k, v, layer(q, k, v, fb)))
        for q, k, v, o in layers:
            record.layers.append(
                (q[:n_real_tokens], k[:n_real_tokens], v[:n_real_tokens], o[:n_real_tokens])
            )
            if o.shape[0] > n_real_tokens:
                self.padded_outputs.append(o[n_real_tokens:])
        record.counts_after = self.kv_pool.cache.counts[fb.req_pool_indices[:real].long()].clone()
        self.records.append(record)
        alloc = self.token_to_kv_pool_allocator
        self.max_peak_logical_used = max(
            self.max_peak_logical_used, alloc.size - alloc.logical_available_size()
        )
        # sampling stand-in: next token from the last token of each request
        if fb.forward_mode.is_decode():
            last = ids[:real]
        else:
            ends = torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu), 0) - 1
            last = ids[ends]
        batch.output_ids = torch.tensor([next_token(int(t)) for t in last], dtype=torch.int64)

    def _pad(self, fb: Any, n: int) -> None:
        stale = fb.req_pool_indices[:1].repeat(n)  # names a live request, as stale rows can
        fb.req_pool_indices = torch.cat([fb.req_pool_indices, stale])
        fb.seq_lens = torch.cat([fb.seq_lens, torch.ones(n, dtype=fb.seq_lens.dtype)])
        fb.seq_lens_cpu = torch.cat([fb.seq_lens_cpu, torch.ones(n, dtype=fb.seq_lens_cpu.dtype)])
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, fb.out_cache_loc.new_zeros(n)])
        fb.positions = torch.cat([fb.positions, fb.positions.new_zeros(n)])
        fb.input_ids = torch.cat([fb.input_ids, fb.input_ids.new_zeros(n)])
        fb.batch_size += n
        self.padded_rows_seen += n

    def _process(self, batch: ScheduleBatch) -> None:
        for req, tok in zip(batch.reqs, batch.output_ids.tolist(), strict=True):
            req.output_ids.append(tok)
            req.check_finished()
            if req.finished():
                mem_common.release_kv_cache(req, self.tree_cache)
                self.finished.append(req)

    def _drop_finished(self) -> None:
        if self.running is not None:
            keep = [i for i, r in enumerate(self.running.reqs) if not r.finished()]
            if len(keep) != len(self.running.reqs):
                self.running.filter_batch(keep_indices=keep)

    # -- SGLang's own idle checks ------------------------------------------------------------

    def idle_leak_check(self) -> tuple[bool, str]:
        leak, msg = self._check_radix_cache_memory()
        return leak, msg

    def req_pool_leak(self) -> bool:
        return len(self.req_to_token_pool.free_slots) != self.req_to_token_pool.size
