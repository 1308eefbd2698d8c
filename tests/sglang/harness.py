"""A CPU stand-in for one SGLang scheduler + model runner, driving real SGLang objects.

Real: ServerArgs (with our fix-ups), SGLang's KVCacheConfigurator.configure (through our
hook; only its GPU memory profile is replaced by a fixed budget), ReqToTokenPool / allocator
/ KV pool subclasses, ChunkCache, Req, PrefillAdder (with our admission hook),
ScheduleBatch.prepare_for_extend / prepare_for_decode / check_decode_mem / retract_decode,
release_kv_cache, resolve_forward_inputs, ForwardBatch.init_new, RadixAttention under the
runner's ForwardContext, the decode CUDA-graph runner's buffer registry and replay view, and
the scheduler's own idle memory checks (SchedulerInvariantChecker). Stand-ins: the
transformer (q/k/v are a fixed function of (token id, position, layer) so a retracted
request recomputes the same K/V) and the sampler (next token = a hash of the last one).

Two helpers SGLang runs as Triton kernels on GPUs (req_to_token writes, extend positions)
take their torch paths here, exactly as SGLang does for its torch_native backend.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import sglang_cpu_env  # beside this file (pytest's pythonpath); installs before any sglang import

sglang_cpu_env.install()

import torch  # noqa: E402
from transformers import LlamaConfig, PretrainedConfig  # noqa: E402

from sglang_diffkv.sglang import plugin  # noqa: E402

plugin.register()  # idempotent; a server gets it from load_plugins() (the entry point)

import sglang.srt.mem_cache.allocation as mem_allocation  # noqa: E402
import sglang.srt.mem_cache.common as mem_common  # noqa: E402
import sglang.srt.model_executor.forward_batch_info as fbi  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, prepare_abort  # noqa: E402
from sglang.srt.distributed.parallel_state_wrapper import ParallelState  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.managers.overlap_utils import (  # noqa: E402
    FutureMap,
    RelayPayload,
    resolve_forward_inputs,
)
from sglang.srt.managers.schedule_batch import (  # noqa: E402
    FINISH_ABORT,
    Req,
    ScheduleBatch,
    retract_all,
)
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.managers.scheduler_components.invariant_checker import (  # noqa: E402
    SchedulerInvariantChecker,
)
from sglang.srt.managers.scheduler_components.pool_stats_observer import (  # noqa: E402
    SchedulerPoolStatsObserver,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator  # noqa: E402
from sglang.srt.mem_cache.registry import (  # noqa: E402
    TreeCacheBuildContext,
    create_tree_cache,
)
from sglang.srt.model_executor.cuda_graph_buffer_registry import (  # noqa: E402
    build_decode_registry,
)
from sglang.srt.model_executor.forward_context import (  # noqa: E402
    ForwardContext,
    forward_context,
)
from sglang.srt.model_executor.model_runner_components.layer_setup import (  # noqa: E402
    ModelLayerInfo,
)
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (  # noqa: E402
    build_replay_fb_view,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

VOCAB = 1000


def cpu_sglang_helpers(monkeypatch: Any) -> None:
    """Torch paths for SGLang's Triton helper kernels; TP size 1 without process groups."""
    monkeypatch.setattr(mem_allocation, "support_triton", lambda backend: False)
    monkeypatch.setattr(fbi, "support_triton", lambda backend: False)
    monkeypatch.setattr(fbi, "enable_num_token_non_padded", lambda: False)


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
    return state + pages * plan.pool_bytes_per_page + plan.cell_bytes


class FakeModelConfig:
    """SGLang's ModelConfig fields the pools read; ``hf_config`` (the HF config the model was
    loaded from) defaults to a Llama config of ``shape``."""

    def __init__(self, shape: ModelShape, hf_config: PretrainedConfig | None = None) -> None:
        self.head_dim = shape.head_dim
        self.v_head_dim = shape.head_dim
        self.num_attention_heads = shape.num_q_heads
        self.num_hidden_layers = shape.num_layers
        self.context_len = shape.context_len
        self.num_kv = shape.num_kv_heads
        self.is_hybrid_swa = False
        self.is_encoder_decoder = False
        self.is_multimodal = False
        self.is_matryoshka = False
        self.model_is_mrope = False
        self.vocab_size = VOCAB
        self.hf_config = hf_config or LlamaConfig(
            architectures=["LlamaForCausalLM"], num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_q_heads, num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, hidden_size=shape.num_q_heads * shape.head_dim,
            vocab_size=VOCAB)
        self.hf_text_config = self.hf_config
        self.linear_attn_registry_result = None  # (not a linear-attention model)

    def get_num_kv_heads(self, tp_size: int) -> int:
        return self.num_kv // tp_size

    def get_num_attention_heads(self, tp_size: int) -> int:
        return self.num_attention_heads // tp_size


@dataclass(kw_only=True)
class FixedBudgetConfigurator(KVCacheConfigurator):
    """SGLang's KVCacheConfigurator with a fixed KV byte budget in place of its GPU memory
    profile (``_profile_available_bytes``: free memory after the weights, less the slack)."""

    kv_budget_bytes: int = 0

    def _profile_available_bytes(self, pre_model_load_memory: int) -> int:
        return self.kv_budget_bytes


class FakeRunner:
    """What SGLang's ModelRunner holds that the pools, ForwardBatch and backend read. The pools
    come from ``KVCacheConfigurator.configure`` as in ``ModelRunner.alloc_memory_pool`` (our
    hook builds the DiffKV pools there)."""

    def __init__(self, server_args: ServerArgs, shape: ModelShape, kv_budget_bytes: int,
                 max_running_requests: int, *, use_mla_backend: bool = False,
                 hybrid_swa: bool = False, ps: ParallelState | None = None,
                 hf_config: PretrainedConfig | None = None) -> None:
        # the scheduler process publishes its ServerArgs before building the model runner;
        # the configurator reads --max-running-requests & co. from it
        server_args.max_running_requests = max_running_requests
        set_global_server_args_for_scheduler(server_args)
        self.server_args = server_args
        self.model_config = FakeModelConfig(shape, hf_config)
        self.model_config.is_hybrid_swa = hybrid_swa
        self.device = "cpu"
        self.gpu_id = 0
        self.use_mla_backend = use_mla_backend
        self.is_hybrid_swa = hybrid_swa
        self.is_draft_worker = False
        self.ps = ps or ParallelState.trivial()
        self.kv_cache_dtype = torch.bfloat16
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.ngram_embedding_manager = SimpleNamespace(enabled=False)
        self.lora_manager = None
        self.layer_info = ModelLayerInfo(start_layer=0, end_layer=shape.num_layers,
                                         num_effective_layers=shape.num_layers)
        self.kv_cache_configurator = FixedBudgetConfigurator(
            device=self.device, gpu_id=self.gpu_id, ps=self.ps,
            pp_group=None, model=None, model_config=self.model_config, server_args=server_args,
            kv_cache_dtype=self.kv_cache_dtype, model_dtype=shape.dtype, page_size=1,
            sliding_window_size=None, spec_algorithm=self.spec_algorithm,
            is_draft_worker=False, post_capture_kv_active=False, spec_aux_config=None,
            is_hybrid_swa=hybrid_swa, is_hybrid_swa_compress=False,
            use_mla_backend=use_mla_backend, layer_info=self.layer_info, forward_stream=None,
            req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
            kv_budget_bytes=kv_budget_bytes,
        )
        result = self.kv_cache_configurator.configure(pre_model_load_memory=0)
        self.max_total_num_tokens = result.max_total_num_tokens
        self.max_running_requests = result.max_running_requests
        self.req_to_token_pool = result.req_to_token_pool
        self.token_to_kv_pool = result.token_to_kv_pool
        self.token_to_kv_pool_allocator = result.token_to_kv_pool_allocator
        self.memory_pool_config = result.memory_pool_config
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
class MiniScheduler:
    """The scheduler loop's memory-relevant steps, on SGLang's own objects."""

    shape: ModelShape
    kv_budget_bytes: int
    max_running_requests: int = 8
    server_args: ServerArgs = field(init=False)
    waiting: list[Req] = field(default_factory=list)
    running: ScheduleBatch | None = None
    last_batch: ScheduleBatch | None = None
    finished: list[Req] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    retractions: int = 0
    new_token_ratio: float = 0.7
    # eager decode rows appended as padding: out_cache_loc 0, a stale req_pool_idx naming a
    # live request (the backend must skip them whatever they name)
    pad_decode_rows: int = 0
    padded_rows_seen: int = 0
    padded_outputs: list[torch.Tensor] = field(default_factory=list)
    max_peak_logical_used: int = 0
    # CUDA-graph decode as SGLang's DecodeCudaGraphRunner drives the backend (capture sizes;
    # empty: eager). Emulated on the CPU: the "graph" is the captured metadata re-run as
    # recorded, on the runner's static input buffers.
    graph_bs: tuple[int, ...] = ()
    graph_replays: int = 0
    # this rank's parallel state (None: TP 1); its KV heads are shape.num_kv_heads / TP
    ps: ParallelState | None = None
    # SGLang's --chunked-prefill-size (None: whole prompts, one extend each); with it the
    # scheduler's chunked-request flow (Scheduler.get_next_batch_to_run /
    # get_new_batch_prefill) runs: one request at a time is prefilled in chunks, each
    # chunk an extend step of its own that may also carry other requests' prompts
    chunked_prefill_size: int | None = None
    chunked_req: Req | None = None
    # SGLang's radix cache through its tree-cache registry (--radix-cache-backend diffkv, as
    # the ServerArgs hook selects it); False: the ChunkCache of --disable-radix-cache
    radix: bool = False
    # (what ran each step: a request's chunk is recorded as (rid, prefix, fresh))
    chunks: list[tuple[str, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.server_args = ServerArgs(model_path="dummy", attention_backend="diffkv",
                                      chunked_prefill_size=self.chunked_prefill_size or -1,
                                      disable_radix_cache=not self.radix)
        self.runner = FakeRunner(self.server_args, self.shape, self.kv_budget_bytes,
                                 self.max_running_requests, ps=self.ps)
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.token_to_kv_pool_allocator = self.runner.token_to_kv_pool_allocator
        self.kv_pool = self.runner.token_to_kv_pool
        self.max_total_num_tokens = self.runner.max_total_num_tokens
        params = CacheInitParams(
            disable=not self.radix,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            page_size=1,
            chunked_prefill_size=self.server_args.chunked_prefill_size,
        )
        if self.radix:  # as kv_cache_builder.build_kv_cache builds it
            self.tree_cache = create_tree_cache(TreeCacheBuildContext(
                server_args=self.server_args, params=params, is_hybrid_swa=False,
                is_hybrid_ssm=False, enable_hierarchical_cache=False,
                disable_radix_cache=False,
                effective_chunked_prefill_size=self.server_args.chunked_prefill_size,
                tp_worker=None, model_config=self.runner.model_config, tp_size=1, tp_rank=0,
                tp_group=None))
        else:
            self.tree_cache = ChunkCache(params)
        # the next iteration's input ids, relayed per request slot as the scheduler does
        self.future_map = FutureMap(torch.device("cpu"), SpeculativeAlgorithm.NONE,
                                    self.req_to_token_pool)
        self._init_invariant_checker()
        tp = self.ps.attn_tp_size if self.ps is not None else 1  # this rank's heads
        self.layers = [
            RadixAttention(self.shape.num_q_heads // tp, self.shape.head_dim,
                           self.shape.scaling, self.shape.num_kv_heads // tp, layer_id=i)
            for i in range(self.shape.num_layers)
        ]
        if self.graph_bs:
            self._capture_graphs()

    def _init_invariant_checker(self) -> None:
        """The scheduler's pool observer and invariant checker (Scheduler.init_invariant_checker)
        on this scheduler's pools."""
        common = dict(
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            req_to_token_pool=self.req_to_token_pool,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            get_last_batch=lambda: self.last_batch,
            get_running_batch=lambda: self.running,
        )
        self.pool_stats_observer = SchedulerPoolStatsObserver(
            session_controller=SimpleNamespace(sessions={}),
            hisparse_coordinator=None,
            enable_hisparse=False,
            max_total_num_tokens=self.max_total_num_tokens * self.server_args.dcp_size,
            **common,
        )
        self.invariant_checker = SchedulerInvariantChecker(
            disaggregation_mode=DisaggregationMode.NULL,
            page_size=1,
            max_total_num_tokens=self.max_total_num_tokens,
            server_args=self.server_args,
            pool_stats_observer=self.pool_stats_observer,
            **common,
        )

    # -- CUDA-graph decode, as DecodeCudaGraphRunner drives it -------------------------------

    def _capture_graphs(self) -> None:
        backend = self.runner.attn_backend
        n = max(self.graph_bs)
        backend.init_cuda_graph_state(n, n)
        self.seq_len_fill_value = fill = backend.get_cuda_graph_seq_len_fill_value()
        # the runner's static decode inputs, with SGLang's per-slot padding policy (replays
        # zero req_pool_indices / positions / out_cache_loc past the batch, refill seq_lens)
        self.registry = build_decode_registry(
            device=torch.device("cpu"), max_bs=n, max_num_token=n, seq_len_fill_value=fill,
            cache_loc_dtype=torch.int64, share_pool=False,
        )
        buf = {name: self.registry.get_slot(name).buffer for name in self.registry.slot_names()}
        self.buffers = SimpleNamespace(**buf, encoder_lens=None, mamba_track_indices=None)
        self.buffers.seq_lens.fill_(fill)
        self.buffers.seq_lens_cpu.fill_(fill)
        self.captured: dict[int, Any] = {}
        with forward_context(ForwardContext(attn_backend=backend)):
            for bs in sorted(self.graph_bs, reverse=True):  # SGLang captures largest first
                b = self.buffers
                fb = fbi.ForwardBatch(
                    forward_mode=fbi.ForwardMode.DECODE, batch_size=bs,
                    input_ids=b.input_ids[:bs], req_pool_indices=b.req_pool_indices[:bs],
                    seq_lens=b.seq_lens[:bs], seq_lens_cpu=b.seq_lens_cpu[:bs],
                    orig_seq_lens=b.seq_lens[:bs], out_cache_loc=b.out_cache_loc[:bs],
                    seq_lens_sum=int(b.seq_lens[:bs].sum()), positions=b.positions[:bs],
                    return_logprob=False, spec_algorithm=SpeculativeAlgorithm.NONE,
                    spec_info=None, global_forward_mode=fbi.ForwardMode.DECODE,
                )
                backend.init_forward_metadata_out_graph(fb, in_capture=True)
                backend.init_forward_metadata_in_graph(fb)  # (recorded inside the graph)
                self.captured[bs] = backend.forward_metadata
                self._graph_forward(bs)

    def _graph_forward(self, bs: int) -> list[torch.Tensor]:
        backend = self.runner.attn_backend
        backend.forward_metadata = self.captured[bs]  # a graph replays its capture's inputs
        outs = []
        ids, pos = self.buffers.input_ids[:bs], self.buffers.positions[:bs]
        for layer in self.layers:
            q, k, v = fake_qkv(ids, pos, layer.layer_id, self.shape)
            outs.append((q, k, v, backend.forward_decode(q, k, v, layer, None)))
        return outs

    def _replay(self, fb: Any) -> list[tuple[torch.Tensor, ...]]:
        """DecodeCudaGraphRunner.load_batch, then the graph's replay."""
        raw = fb.batch_size
        bs = min(b for b in self.graph_bs if b >= raw)
        self.registry.fill_from(fb, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw,
                                padded_num_tokens=bs)
        fb_view = build_replay_fb_view(
            forward_batch=fb, buffers=self.buffers, bs=bs, raw_bs=raw, num_tokens=bs,
            seq_len_fill_value=self.seq_len_fill_value,
            capture_forward_mode=fbi.ForwardMode.DECODE, is_encoder_decoder=False,
        )
        self.runner.attn_backend.init_forward_metadata_out_graph(fb_view)
        self.graph_replays += 1
        self.padded_rows_seen += bs - raw
        return self._graph_forward(bs)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, rid: str, prompt: list[int], max_new_tokens: int,
                    custom_params: dict[str, Any] | None = None) -> Req:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                            custom_params=custom_params)
        sp.normalize(None)
        req = Req(rid, "", array("q", prompt), sp, vocab_size=VOCAB)
        self.waiting.append(req)
        return req

    # -- one scheduler iteration ----------------------------------------------------------

    def step(self) -> str:
        """Prefill new requests (and the chunked request's next chunk) if any fit, else
        decode the running batch. Returns what ran."""
        batch = self._new_prefill_batch()
        if batch is not None:
            self._run(batch)
            self._process(batch)
            # get_next_batch_to_run: the prefill batch joins the running batch, less the
            # request still in chunks (it comes back as the next prefill's chunk)
            if self.chunked_req is not None:
                batch.filter_batch(chunked_req_to_exclude=[self.chunked_req])
            if batch.is_empty():
                pass
            elif self.running is None or self.running.is_empty():
                self.running = batch
            else:
                self.running.merge_batch(batch)
            self._drop_finished()
            return "prefill"
        if self.running is None or self.running.is_empty():
            self.last_batch = None
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
            if self.step() == "idle" and not self.waiting and self.chunked_req is None:
                return
        raise AssertionError("requests did not finish")

    # -- a request between chunks: abort and retraction, as the scheduler does them ---------

    def abort_chunked(self) -> Req:
        """Scheduler.process_pending_chunked_abort: the request in chunks is aborted between
        two chunks and its slot and KV released."""
        req = self.chunked_req
        assert req is not None, "no request is being prefilled in chunks"
        prepare_abort(req, "Aborted")
        mem_common.release_kv_cache(req, self.tree_cache, is_insert=False)
        self.chunked_req = None
        self.finished.append(req)
        return req

    def abort(self, rid: str) -> Req:
        """Scheduler.abort_request: a waiting request is dropped; a running one finishes
        as aborted at its next step (its KV released then, by SGLang's own path)."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.finished.append(req)
                return req
        for req in self.running.reqs if self.running is not None else []:
            if req.rid == rid:
                req.to_finish = FINISH_ABORT()  # (abort method 3: set to_finish)
                return req
        raise KeyError(rid)

    def flush_cache(self) -> None:
        """Scheduler.flush_cache (only when idle): the tree and the pools are reset."""
        assert not self.waiting and (self.running is None or self.running.is_empty())
        self.last_batch = None
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()

    def retract_all(self) -> list[Req]:
        """Scheduler.pause_generation(mode="retract"): every running request and the one in
        chunks are retracted (released, reset) and go back to the waiting queue."""
        reqs = [r for r in self.running.reqs if not r.finished()] if self.running else []
        if self.chunked_req is not None and not self.chunked_req.finished():
            reqs.append(self.chunked_req)
        self.last_batch = None
        retract_all(reqs=reqs, server_args=self.server_args,
                    req_to_token_pool=self.req_to_token_pool,
                    token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                    tree_cache=self.tree_cache, hisparse_coordinator=None, offload_kv=False)
        self.running = None
        self.chunked_req = None
        self.retractions += len(reqs)
        self.waiting = reqs + self.waiting
        return reqs

    def _new_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        if self.chunked_req is not None:
            # get_next_batch_to_run: stash the previous chunk (ChunkCache sets the request's
            # prefix_indices to the slots of every token computed so far)
            mem_common.maybe_cache_unfinished_req(self.chunked_req, self.tree_cache,
                                                  chunked=True)
        running = self.running if self.running is not None else ScheduleBatch(reqs=[])
        adder = PrefillAdder(
            1, self.tree_cache, self.token_to_kv_pool_allocator, running,
            self.new_token_ratio, rem_input_tokens=16384,
            rem_chunk_tokens=self.chunked_prefill_size,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in list(self.waiting):
            if len(running.reqs) + len(adder.can_run_list) >= self.max_running_requests:
                break
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None,
                                    truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        if not adder.can_run_list:
            return None
        self.waiting = [r for r in self.waiting if r not in adder.can_run_list]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            adder.can_run_list, self.req_to_token_pool, self.token_to_kv_pool_allocator,
            self.tree_cache, self.runner.model_config, False, SpeculativeAlgorithm.NONE,
            chunked_req=self.chunked_req,
        )
        batch.prepare_for_extend()
        for r in batch.reqs:
            self.chunks.append((r.rid, r.extend_range.start, r.extend_range.length))
        return batch

    def _run(self, batch: ScheduleBatch) -> None:
        self.last_batch = batch
        resolve_forward_inputs(batch, self.future_map)
        fb = fbi.ForwardBatch.init_new(batch, self.runner, return_hidden_states_before_norm=False)
        real = fb.batch_size
        ids = fb.input_ids
        is_decode = fb.forward_mode.is_decode()
        n_real_tokens = real if is_decode else int(fb.input_ids.shape[0])
        record = StepRecord(
            "decode" if is_decode else "extend",
            [r.rid for r in batch.reqs], [], fb.positions[:n_real_tokens].clone(),
            fb.seq_lens[:real].tolist(), fb.req_pool_indices[:real].tolist(),
        )
        backend = self.runner.attn_backend
        # ModelRunner.forward runs the model inside the backend's ForwardContext
        with forward_context(ForwardContext(attn_backend=backend)):
            if is_decode and self.graph_bs and real <= max(self.graph_bs):
                layers = self._replay(fb)
            else:
                if self.pad_decode_rows and is_decode:
                    self._pad(fb, self.pad_decode_rows)
                backend.init_forward_metadata(fb)
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
        if is_decode:
            last = ids[:real]
        else:
            ends = torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu), 0) - 1
            last = ids[ends]
        next_ids = torch.tensor([next_token(int(t)) for t in last], dtype=torch.int64)
        self.output_ids = next_ids.tolist()
        # relayed to the next iteration's input ids (Scheduler._relay_forward_payload)
        self.future_map.stash(batch.req_pool_indices, RelayPayload(bonus_tokens=next_ids))
        batch.input_ids = None

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
        for req, tok in zip(batch.reqs, self.output_ids, strict=True):
            if req.inflight_middle_chunks > 0:  # a chunk before the prompt's last: no token
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(tok)
            req.update_finish_state()
            if req.finished():
                mem_common.release_kv_cache(req, self.tree_cache)
                self.finished.append(req)
            elif batch.forward_mode.is_extend():
                # process_batch_result_prefill: the prompt is cached (a radix tree inserts
                # it now; ChunkCache keeps the request's own slots)
                mem_common.maybe_cache_unfinished_req(req, self.tree_cache)

    def _drop_finished(self) -> None:
        if self.running is not None:
            keep = [i for i, r in enumerate(self.running.reqs) if not r.finished()]
            if len(keep) != len(self.running.reqs):
                self.running.filter_batch(keep_indices=keep)

    # -- SGLang's own idle checks (Scheduler.on_idle) ----------------------------------------

    def idle_leak_check(self) -> tuple[bool, str]:
        leak, messages = self.invariant_checker._check_all_pools(
            self.pool_stats_observer.get_pool_stats()
        )
        return leak, "\n".join(messages)

    def req_pool_leak(self) -> bool:
        try:  # raises under SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (on by default)
            self.invariant_checker._check_req_pool()
        except ValueError:
            return True
        return self.invariant_checker.count_req_pool_leak_warnings > 0
