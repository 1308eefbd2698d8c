"""``DiffKVAttnBackend``: SGLang's attention backend for ``--attention-backend diffkv``.

Modelled on SGLang's ``TritonAttnBackend``: one metadata object built once per batch in
``init_forward_metadata`` (page allocation and index bookkeeping for every layer), then thin
per-layer ``forward_extend`` / ``forward_decode``.

- extend: exact causal attention on the fresh, packed K/V (flash varlen on CUDA, padded
  SDPA elsewhere), then the layer's prompts are scored, classified, quantised and stored;
  after the last layer the pages compression freed go back to the free list. With chunked
  prefill a prompt spans several extends: its chunks attend over the chunks already stored
  (extend attention), chunks before the last are stored at the high tier unscored, and the
  last one scores and compresses the whole prompt (``ops.DiffKVOps._chunked_extend_layer``).
- decode: per layer the policy step stores the new token (evicting / demoting), then paged
  mixed-precision attention over the compressed cache, which also accumulates scores.
- padded rows (``out_cache_loc == 0``: slot 0 is never allocated) are skipped.
- CUDA-graph decode (kernel path): SGLang captures one graph per batch size; the decode
  inputs live in static buffers (``graphs.DecodeGraphState``) that the replay's metadata
  step fills, padding rows pointing at the pool's empty pad request. Page allocation runs
  in that metadata step, outside the graph. Under graphs the per-step log line and the
  profile's step end are taken at the next step's metadata (the forward runs no Python).

The compute goes through one seam, ``ops.DiffKVOps``: the torch reference
(``sglang_diffkv.cache.CompressedKVCache``) or the Triton kernels on the same state.

``SGLANG_DIFFKV_PROFILE=1`` times the memory-management work of each step and the step
itself (``sglang_diffkv.sglang.step_profile``); off, the profiler is None and nothing is recorded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_diffkv.cache import ExtendRequests
from sglang_diffkv.sglang.graphs import DecodeGraphState
from sglang_diffkv.sglang.ops import DiffKVOps, want_kernels
from sglang_diffkv.sglang.pool import DiffKVPoolError, DiffKVTokenToKVPool
from sglang_diffkv.sglang.step_profile import span

logger = logging.getLogger("sglang_diffkv")


@dataclass
class DiffKVForwardMetadata:
    """Per-batch indices shared by every layer. Only real (unpadded) requests appear."""

    is_decode: bool
    rows: torch.Tensor | None  # int64 [B]: row of each request in the batch (None: all)
    req_idx: torch.Tensor  # int64 [B]: req_pool_idx of each request
    seq_lens: torch.Tensor  # int64 [B]: tokens after this step
    positions: torch.Tensor | None = None  # decode: position of the new token
    # decode: the longest sequence in the batch (host int): sizes the attention plan, since
    # no row holds more tokens than its sequence length
    max_seq_len: int = 0
    # decode: DiffKVOps.begin_decode_step's per-step inputs shared by every layer (None on
    # the reference path)
    step: Any = None
    # decode under a CUDA graph: the captured batch size (rows past req_idx's are padding);
    # 0 when eager
    graph_bs: int = 0
    # extend only: DiffKVOps.begin_prefill_step's per-step inputs shared by every layer
    prefill: Any = None


class DiffKVAttnBackend(AttentionBackend):
    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, DiffKVTokenToKVPool):
            raise DiffKVPoolError(
                "the diffkv attention backend needs the DiffKV memory pool, got "
                f"{type(pool).__name__}; is the sglang_diffkv plugin loaded "
                "(SGLANG_DIFFKV_DISABLE unset, SGLANG_PLUGINS empty or naming diffkv)?"
            )
        self.pool = pool
        # what SGLang's forward context hands model code (get_token_to_kv_pool(): e.g. the
        # fused RoPE + set-KV check reads the pool's dtype)
        self.token_to_kv_pool = pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.cache = pool.cache
        self.device = model_runner.device
        self.start_layer = pool.start_layer
        self.last_layer = pool.start_layer + pool.layer_num - 1
        self.forward_metadata: DiffKVForwardMetadata | None = None
        self.ops = DiffKVOps(self.cache, want_kernels(torch.device(self.device)))
        self.prof = pool.stats.profiler
        self.ops.prof = self.prof
        # this rank's query heads (its attention-TP share, as its KV heads in the pool):
        # sizes the CUDA-graph decode plans and the split-K choice
        self.num_q_heads = model_runner.model_config.get_num_attention_heads(
            model_runner.ps.attn_tp_size)
        self.graphs: DecodeGraphState | None = None
        # a replayed decode step whose end (profile, log line) the next metadata step takes
        self._graph_step_open: DiffKVForwardMetadata | None = None
        logger.info(
            "DiffKV attention backend: compute path = %s (SGLANG_DIFFKV_KERNELS=auto|1|0)",
            self.ops.name,
        )
        if self.ops.use_kernels:
            kv_heads = self.cache.spec.num_kv_heads
            logger.info("DiffKV attention backend: decode split-K pass = %s",
                        self.ops.k.describe_split_pass(
                            self.cache.geometry, self.num_q_heads // max(kv_heads, 1),
                            torch.device(self.device)))
        note = self.cache.config.bench_note
        if note is not None:
            logger.warning("DiffKV attention backend: %s", note)
        if self.prof is not None:
            logger.info("DiffKV attention backend: profiling memory management "
                        "(SGLANG_DIFFKV_PROFILE=1; lines every SGLANG_DIFFKV_LOG_INTERVAL steps)")

    # ---- metadata ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self._close_graph_step()
        self.pool.mark_forward_stream()
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
        elif mode.is_decode():
            if self.prof is not None:
                self.prof.begin_step()
            self.forward_metadata = self._decode_metadata(forward_batch)
        # (is_extend() leaves out DRAFT_EXTEND_V2 unless asked; sglang 0.5.17 has no
        # is_draft_extend())
        elif mode.is_extend_without_speculative():
            if self.prof is not None:
                self.prof.begin_step()
            self.forward_metadata = self._extend_metadata(forward_batch)
        else:
            raise NotImplementedError(f"diffkv: forward mode {mode.name} is not supported")

    def _decode_metadata(self, fb: Any) -> DiffKVForwardMetadata:
        # Padded rows (CUDA-graph style) carry out_cache_loc 0 and stale req_pool_indices.
        rows = torch.nonzero(fb.out_cache_loc != 0).squeeze(1)
        req = fb.req_pool_indices[rows].long()
        seq = fb.seq_lens[rows].long()
        seq_list = seq.tolist()  # (the eager path syncs anyway: nonzero above)
        self._allocate_decode(req, seq)
        positions = seq - 1
        max_seq_len = max(seq_list, default=0)
        return DiffKVForwardMetadata(
            True, rows, req, seq, positions=positions, max_seq_len=max_seq_len,
            step=self.ops.begin_decode_step(req, positions, max_seq_len),
        )

    def _allocate_decode(self, req: torch.Tensor, seq: torch.Tensor) -> None:
        """This step's page room for every request (the policy step then never fails), and
        the pool's per-request token counts. No host sync: the room's success flag is
        checked a step later (``pool.check_last_decode``)."""
        self.pool.flush_frees()  # (timed as "free" by the pool itself)
        with span(self.prof, "alloc"):
            self.pool.begin_decode(req, seq)

    def _extend_metadata(self, fb: Any) -> DiffKVForwardMetadata:
        """An extend step: whole prompts, and with chunked prefill the chunks of prompts
        spread over several steps (``fb.extend_prefix_lens_cpu`` > 0: the tokens earlier
        chunks stored). A prompt's first chunk takes the all-high pages of the whole prompt
        (what admission reserved), later chunks take none."""
        prefix = [int(p) for p in fb.extend_prefix_lens_cpu]
        lengths = [int(n) for n in fb.extend_seq_lens_cpu]
        req = fb.req_pool_indices.long()
        slots = req.tolist()
        with span(self.prof, "alloc"):
            totals = self.pool.begin_extend(slots, prefix, lengths)
        ext = ExtendRequests.build(req, slots, lengths, prefix, totals)
        # SGLang's device copy of the lengths (no host-to-device copy), when it has one
        lengths_dev = getattr(fb, "extend_seq_lens", None)
        step = self.ops.begin_prefill_step(req, lengths, lengths_dev, ext)
        seq = fb.seq_lens[:len(lengths)].long()  # prefix + fresh: tokens after this step
        return DiffKVForwardMetadata(False, None, req, seq, prefill=step)

    # ---- per-layer forward ---------------------------------------------------------------

    def _check_layer(self, layer: Any, save_kv_cache: bool) -> None:
        if not save_kv_cache:
            raise NotImplementedError(
                "diffkv: save_kv_cache=False (K/V written by the model itself) is not supported"
            )
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise NotImplementedError("diffkv: attention logit soft-capping is not supported")
        if getattr(layer, "sliding_window_size", -1) not in (None, -1):
            raise NotImplementedError("diffkv: sliding-window attention is not supported")
        if getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("diffkv: cross-attention is not supported")

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any
                       ) -> torch.Tensor:
        self._check_layer(layer, save_kv_cache)
        md = self.forward_metadata
        q3, k3, v3 = _per_head(layer, q, k, v)
        layer_idx = layer.layer_id - self.start_layer
        o = self.ops.extend_layer(layer_idx, md.prefill, q3, k3, v3, layer.scaling)
        if layer.layer_id == self.last_layer:
            with span(self.prof, "reclaim"):
                self.ops.end_prefill_step(md.prefill)
            if self.prof is not None:
                self.prof.end_step("prefill")
            self._maybe_log(md, "prefill")
        return o.to(q.dtype).reshape(-1, q3.shape[1] * o.shape[2])

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any
                       ) -> torch.Tensor:
        self._check_layer(layer, save_kv_cache)
        md = self.forward_metadata
        q3, k3, v3 = _per_head(layer, q, k, v)
        hq, dv = q3.shape[1], v3.shape[2]
        layer_idx = layer.layer_id - self.start_layer
        if md.graph_bs:
            # every row, padding included (it points at the empty pad request); no Python
            # may run per replay, so no profile span and no log line here
            self.ops.decode_store(layer_idx, md.req_idx, md.positions, k3, v3, step=md.step)
            out = self.ops.decode_attend(layer_idx, md.req_idx, q3, layer.scaling,
                                         step=md.step)
            return out.to(q.dtype).view(-1, hq * dv)
        rows = md.rows
        with span(self.prof, "policy"):
            self.ops.decode_store(layer_idx, md.req_idx, md.positions, k3[rows], v3[rows],
                                  step=md.step)
        out = self.ops.decode_attend(layer_idx, md.req_idx, q3[rows], layer.scaling,
                                     max_seq_len=md.max_seq_len, step=md.step)
        o = q.new_zeros(q3.shape[0], hq, dv)
        o[rows] = out.to(q.dtype)
        if layer.layer_id == self.last_layer:
            if self.prof is not None:
                self.prof.end_step("decode")
            self._maybe_log(md, "decode")
        return o.view(-1, hq * dv)

    def _maybe_log(self, md: DiffKVForwardMetadata, mode: str) -> None:
        text = self.pool.stats.step_line(self.pool, md.req_idx, md.seq_lens, mode)
        if text is not None:
            for line in text.splitlines():  # one record per line: log parsers read lines
                logger.info(line)

    # ---- CUDA-graph decode ----------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_num_tokens != max_bs:
            raise NotImplementedError(
                f"diffkv CUDA graphs capture decode only (one token per request); got "
                f"{max_num_tokens} tokens for {max_bs} requests"
            )
        self.graphs = DecodeGraphState(self.ops, self.pool.pad_req, max_bs, self.num_q_heads)
        logger.info("DiffKV attention backend: CUDA-graph decode for batch sizes up to %d",
                    max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # padding rows get sequence length 0 (they are never read: replays name their real
        # row count, and padding rows point at the empty pad request)
        return 0

    def _graph_state(self) -> DecodeGraphState:
        if self.graphs is None:
            raise RuntimeError("diffkv: CUDA-graph metadata before init_cuda_graph_state")
        return self.graphs

    def _graph_metadata(self, bs: int, seq: torch.Tensor) -> DiffKVForwardMetadata:
        """The captured batch size's metadata: its static buffers (rows past ``seq``'s real
        requests are padding)."""
        g = self._graph_state()
        return DiffKVForwardMetadata(True, None, g.req[:bs], seq, positions=g.positions[:bs],
                                     step=g.step(bs), graph_bs=bs)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False
                                        ) -> None:
        """The decode CUDA-graph runner's metadata step, before capture (``in_capture``) and
        before every replay (``forward_batch`` is then its padded view: ``batch_size`` is the
        captured size, the first ``batch_size - num_padding`` rows are real). Eager batches
        come through ``init_forward_metadata``. Nothing is recorded inside the graph: every
        per-step input is copied into ``DecodeGraphState``'s static buffers here."""
        mode = forward_batch.forward_mode
        if not mode.is_decode() or getattr(forward_batch, "spec_info", None) is not None:
            raise NotImplementedError(
                f"diffkv CUDA graphs capture plain decode only, not {mode.name}"
            )
        bs = forward_batch.batch_size
        self._close_graph_step()
        g = self._graph_state()
        if in_capture:
            # capture runs with every row padding: the kernels are recorded, nothing stored
            g.load(bs, g.req[:0], g.positions[:0])
            self.forward_metadata = self._graph_metadata(bs, forward_batch.seq_lens[:0])
            return
        self.pool.mark_forward_stream()
        n = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        if self.prof is not None:
            self.prof.begin_step()
        req = forward_batch.req_pool_indices[:n].long()
        seq = forward_batch.seq_lens[:n].long()
        self._allocate_decode(req, seq)
        g.load(bs, req, seq - 1)
        md = self._graph_metadata(bs, seq)
        self.forward_metadata = md
        self._graph_step_open = md

    def _close_graph_step(self) -> None:
        md, self._graph_step_open = self._graph_step_open, None
        if md is None:
            return
        if self.prof is not None:
            self.prof.end_step("decode")
        # the log line reads this step's requests: still theirs (frees wait for flush_frees)
        self._maybe_log(replace(md, req_idx=md.req_idx[:md.seq_lens.numel()]), "decode")


def _per_head(
    layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, H * D] projections as [T, H, D] with the layer's (tensor-parallel) head counts."""
    d = layer.qk_head_dim
    return (q.reshape(-1, layer.tp_q_head_num, d), k.reshape(-1, layer.tp_k_head_num, d),
            v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim))
