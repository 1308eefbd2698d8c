"""Per-step cost: for each operator the larger of bytes / (eta_mem * bandwidth) and
flops / (eta_comp * peak), summed over operators and layers, plus per-layer, per-step and
per-sequence fixed costs (and eager-mode launch costs when no CUDA graph covers the step; a
prefill step whose launches the calibration times, ``eager_prefill_launch_s``, runs its kernels
(with ``prefill_token_overhead_s`` per prompt token, work on the GPU) under them and lasts the
longer of the two, its launches counted from when the host began
them: under the overlap scheduler, the start of the decode step before it, except for a KV
format whose prefill allocation waits for that step, ``SYNCED_PREFILL_KEYS``; the launches'
side also holds the host's turnaround to the next step's launch
(``eager_prefill_turnaround_s``), through which the GPU idles; likewise a
decode step above the largest CUDA graph whose host iteration the calibration times,
``eager_decode_host_s`` plus ``eager_decode_host_per_req_s`` per request, lasts the longer of
that iteration and its kernels with the fixed costs: the host's launches and scheduling
outlast a small eager batch's kernels).

Operators per layer: the four weight GEMM groups (qkv, o, gate+up, down), decode attention
(bytes follow the KV format: the pool says how many bytes a context reads), prefill attention
(causal FLOPs of each chunk against its cached past), and two all-reduces when tp > 1. Once per
step: the LM head over the sampled positions (one per sequence).

With measured grids in the calibration (``Calibration.measured``), an operator's time is its
speed-of-light time (``*_sol`` below: bytes at the datasheet bandwidth or FLOPs at the datasheet
peak, whichever is larger) divided by the measured efficiency at its shape: eta(m) for a GEMM of
m tokens, eta(batch, mean context) for decode attention, eta(chunk tokens, mean past) for
prefill attention. ``scripts/calibrate_gpu.py`` computes those etas with these same ``*_sol``
methods, so at a measured grid point the model reproduces the measured kernel time exactly.
SGLang's triton extend kernel (the bf16 and fp8 prefill) is the exception: its time is the key
tiles its launch computes at a per-tile time taken from the same grid (``extend_grid.py``),
since its work follows its tiles, not the chunk's query-key pairs.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from simulator.kv.pool import KVPool
from simulator.serving.extend_grid import ExtendTiles, ExtendTileTimes
from simulator.specs.calibration import Calibration, EtaGrid1D
from simulator.specs.gpu import GPUSpec
from simulator.specs.model import ModelSpec

ACT_BYTES = 2  # bf16 activations
# KV formats whose prefill runs SGLang's triton extend kernel (the others run DiffKV's)
TRITON_EXTEND_KEYS = frozenset({"bf16", "fp8"})
# KV formats whose prefill allocation waits on the host for the forward in flight (DiffKV's
# pool reads its allocation's success flag): their eager launches cannot begin under the
# decode step before them, so a prefill's launch floor counts from its own start (H200 loop
# traces, sessions 26-27: 5-7 ms in get_next_batch before every DiffKV extend, 0.8-1.0 bf16)
SYNCED_PREFILL_KEYS = frozenset({"diffkv"})


@dataclass(frozen=True)
class StepShape:
    """What one forward pass computes. ``decode_read_bytes`` is per layer, from the pool."""

    decode_reqs: int = 0
    decode_kv_tokens: int = 0
    decode_read_bytes: float = 0.0
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0        # sum over chunks of C * past + C^2 / 2
    prefill_past_tokens: int = 0
    prefill_seqs: int = 0             # chunks in the batch (each samples one position)
    released_reqs: int = 0            # requests released since the previous step
    # (extend, past) per chunk, for kernels whose cost depends on the mix (extend_grid.py);
    # empty: unknown, the chunks taken as alike
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    # seconds from the end of the previous prefill step to this step's start (0: back to
    # back; inf: none before), for the GPU's clocks (Calibration.prefill_clock_scale)
    prefill_gap_s: float = math.inf
    # seconds the host has been launching this prefill step's kernels when the step starts:
    # under the overlap scheduler an eager prefill is launched while the GPU runs the decode
    # step before it, so its launch floor (eager_prefill_launch_s) counts from there
    launch_head_start_s: float = 0.0

    def started(self, prefill_gap_s: float, launch_head_start_s: float) -> StepShape:
        """This shape as the engine starts it: ``replace`` of its two timing fields, built
        directly (the engine does it for every prefill step)."""
        return StepShape(self.decode_reqs, self.decode_kv_tokens, self.decode_read_bytes,
                         self.prefill_tokens, self.prefill_pairs, self.prefill_past_tokens,
                         self.prefill_seqs, self.released_reqs, self.prefill_chunks,
                         prefill_gap_s, launch_head_start_s)


def _alike_chunks(tokens: int, past_tokens: int, seqs: int) -> tuple[tuple[int, int], ...]:
    """``seqs`` chunks sharing ``tokens`` and ``past_tokens`` as evenly as integers allow."""
    n = max(1, min(seqs, tokens))
    e, er = divmod(tokens, n)
    p, pr = divmod(past_tokens, n)
    return tuple((e + (i < er), p + (i < pr)) for i in range(n))


class CostModel:
    def __init__(self, model: ModelSpec, gpu: GPUSpec, calib: Calibration, pool: KVPool,
                 attention_key: str, tp: int, graph_sizes: list[int], graphs_enabled: bool):
        self.calib = calib
        self.layers = model.num_layers
        self.bw = gpu.hbm_bandwidth
        self.flops = gpu.bf16_flops
        self.tp = tp
        self.mem_rate = calib.eta_mem_gemm * self.bw          # bytes/s GEMM weights stream
        self.comp_rate = calib.eta_comp_gemm * self.flops     # FLOP/s GEMMs
        self.attn_mem_rate = calib.attention_eta(attention_key) * self.bw
        self.attention_key = attention_key
        self.attention_scale = calib.attention_scale(attention_key)
        self.prefill_launch_s = calib.prefill_launch_s(attention_key)
        self.prefill_turnaround_s = calib.prefill_turnaround_s(attention_key)
        self.prefill_launch_overlaps = attention_key not in SYNCED_PREFILL_KEYS
        self.decode_host_s = calib.decode_host_s(attention_key)
        self.decode_host_per_req_s = calib.decode_host_per_req_s(attention_key)
        # whether the calibration times an eager decode step's host iteration, which then
        # bounds the step in place of its per-layer eager cost
        self.decode_host_timed = self.decode_host_s > 0.0 or self.decode_host_per_req_s > 0.0
        self.attn_comp_rate = calib.eta_comp_decode_attention * self.flops
        self.pf_comp_rate = calib.eta_comp_prefill_attention * self.flops
        self.net_rate = calib.eta_interconnect * gpu.interconnect_bandwidth
        h, d = model.hidden_size, model.head_dim
        q = model.num_heads * d // tp
        kv = model.kv_heads_per_rank(tp) * d
        inter = model.intermediate_size // tp
        bpp = model.weight_bytes_per_param
        # (weight bytes, params, in width, out width) of each GEMM group of a layer
        self.gemms = [
            (h * (q + 2 * kv) * bpp, h * (q + 2 * kv), h, q + 2 * kv),
            (q * h * bpp, q * h, q, h),
            (h * 2 * inter * bpp, h * 2 * inter, h, 2 * inter),
            (inter * h * bpp, inter * h, inter, h),
        ]
        self.gemm_names = ("qkv", "o", "gate_up", "down")
        self.lm_head = (model.vocab_size // tp * h * bpp, model.vocab_size // tp * h, h,
                        model.vocab_size // tp)
        grids = calib.measured
        # (op tuple, eta grid or None) per GEMM; the grid is looked up by (n, k) = (out, in)
        self._gemm_grids = [grids.gemm_grid(name, op[3], op[2])
                            for name, op in zip(self.gemm_names, self.gemms, strict=True)]
        self._lm_grid = grids.gemm_grid("lm_head", self.lm_head[3], self.lm_head[2])
        self._decode_grid = grids.decode_attention.get(attention_key)
        self._prefill_grid = (grids.prefill_attention.get(attention_key)
                              or grids.prefill_attention.get("bf16"))
        self._extend_tiles = (ExtendTiles.for_gpu(gpu.compute_capability, model.head_dim)
                              if attention_key in TRITON_EXTEND_KEYS else None)
        self.q_heads = model.num_heads // tp
        self.head_dim = d
        self.hidden = h
        self.write_bpt = pool.write_bytes_per_token_layer
        self._extend_times = None
        if self._extend_tiles is not None and self._prefill_grid is not None:
            g = self._prefill_grid
            self._extend_times = ExtendTileTimes.from_grid(
                self._extend_tiles, g.x.tolist(), g.y.tolist(),
                lambda c, p: self.prefill_attention_sol(c, p, c * p + c * c / 2) / g(c, p))
        self.graph_sizes = graph_sizes
        self.graphs_enabled = graphs_enabled and bool(graph_sizes)
        self.graph_max = graph_sizes[-1] if graph_sizes else 0
        self._dense_cache: dict[int, float] = {}
        self._lm_cache: dict[int, float] = {}
        self._prefill_attention_cache: dict[tuple, float] = {}
        # per batch size: decode_step_timer's and decode_attention_timer's functions
        self._decode_timers: dict[int, Callable[[int, float, int], float]] = {}
        self._attention_timers: dict[int, Callable[[int, float], float]] = {}

    def padded_batch(self, bs: int) -> int:
        """CUDA-graph batch padding: the smallest captured size >= bs."""
        i = bisect.bisect_left(self.graph_sizes, bs)
        return self.graph_sizes[i]

    # ---- speed-of-light times (datasheet bandwidth and peak, no efficiency) ----
    def gemm_sol(self, tokens: int, op: tuple[float, int, int, int]) -> float:
        wbytes, params, n_in, n_out = op
        nbytes = wbytes + tokens * (n_in + n_out) * ACT_BYTES
        return max(nbytes / self.bw, 2.0 * tokens * params / self.flops)

    def decode_attention_work(self, reqs: int, kv_tokens: int,
                              read_bytes: float) -> tuple[float, float]:
        """(bytes, FLOPs) of one layer's decode attention: the KV the contexts read, one new
        token's KV written per request, queries in and outputs out."""
        q_bytes = reqs * self.q_heads * self.head_dim * ACT_BYTES * 2
        nbytes = read_bytes + reqs * self.write_bpt + q_bytes
        return nbytes, 4.0 * self.q_heads * self.head_dim * kv_tokens

    def decode_attention_sol(self, reqs: int, kv_tokens: int, read_bytes: float) -> float:
        nbytes, fl = self.decode_attention_work(reqs, kv_tokens, read_bytes)
        return max(nbytes / self.bw, fl / self.flops)

    def prefill_attention_work(self, tokens: int, past_tokens: int,
                               pairs: float) -> tuple[float, float]:
        """(bytes, FLOPs) of one layer's prefill attention over chunks with ``pairs`` causal
        query-key pairs: the KV of past and new tokens, 4 * heads * d FLOPs per pair."""
        nbytes = (past_tokens + tokens) * self.write_bpt
        return nbytes, 4.0 * self.q_heads * self.head_dim * pairs

    def prefill_attention_sol(self, tokens: int, past_tokens: int, pairs: float) -> float:
        nbytes, fl = self.prefill_attention_work(tokens, past_tokens, pairs)
        return max(nbytes / self.bw, fl / self.flops)

    # ---- modelled times ----
    def _gemm(self, tokens: int, op: tuple[float, int, int, int], grid: EtaGrid1D | None = None
              ) -> float:
        if grid is not None:
            return self.gemm_sol(tokens, op) / grid(tokens)
        wbytes, params, n_in, n_out = op
        nbytes = wbytes + tokens * (n_in + n_out) * ACT_BYTES
        return max(nbytes / self.mem_rate, 2.0 * tokens * params / self.comp_rate)

    def decode_attention_time(self, reqs: int, kv_tokens: int, read_bytes: float) -> float:
        """One layer's decode attention for ``reqs`` requests holding ``kv_tokens`` in all,
        times the calibration's in-server factor for this KV format (``attention_scale``):
        ``decode_attention_sol`` over the grid's eta at (reqs, mean context), or, without a
        grid, the work (``decode_attention_work``) at the flat efficiencies."""
        return self.decode_attention_timer(reqs)(kv_tokens, read_bytes)

    def _attention_terms(self, reqs: int) -> tuple[float, int, int, float, float]:
        """What ``reqs`` requests' decode attention takes from the batch size alone: (the
        format's scale, requests for the mean context, query bytes, KV bytes written,
        FLOPs per context token), each as ``decode_attention_work`` computes it."""
        return (self.attention_scale, max(reqs, 1),
                reqs * self.q_heads * self.head_dim * ACT_BYTES * 2, reqs * self.write_bpt,
                4.0 * self.q_heads * self.head_dim)

    def decode_attention_timer(self, reqs: int) -> Callable[[int, float], float]:
        """``decode_attention_time`` for ``reqs`` requests as a function of (kv_tokens,
        read_bytes), memoised: the batch's terms of the work and its place on the grid's
        batch axis are found once. The arithmetic is ``decode_attention_work``'s, term for
        term."""
        f = self._attention_timers.get(reqs)
        if f is not None:
            return f
        scale, per_req, q_bytes, written, flops_per_token = self._attention_terms(reqs)
        if self._decode_grid is not None:
            bw, peak = self.bw, self.flops
            eta = self._decode_grid.at_x(reqs)

            def f(kv_tokens: int, read_bytes: float) -> float:
                sol = max((read_bytes + written + q_bytes) / bw,
                          flops_per_token * kv_tokens / peak)
                return sol / eta(kv_tokens / per_req) * scale
        else:
            mem, comp = self.attn_mem_rate, self.attn_comp_rate

            def f(kv_tokens: int, read_bytes: float) -> float:
                return max((read_bytes + written + q_bytes) / mem,
                           flops_per_token * kv_tokens / comp) * scale
        self._attention_timers[reqs] = f
        return f

    def prefill_attention_time(self, tokens: int, past_tokens: int, pairs: float,
                               seqs: int, chunks: tuple[tuple[int, int], ...] = ()) -> float:
        """One layer's prefill attention over ``chunks`` ((extend, past) per sequence; empty:
        ``seqs`` alike chunks of the totals). SGLang's triton extend kernel with a measured
        grid: the tiles its launch computes (``ExtendTileTimes``). Otherwise the grid at
        (tokens in the batch, mean past per chunk), or the flat efficiency, on the chunks'
        query-key pairs, the triton kernel's times its launch padding. Memoised: a search
        replays the same prompts again and again."""
        key = (tokens, past_tokens, pairs, seqs, chunks)
        t = self._prefill_attention_cache.get(key)
        if t is None:
            t = self._prefill_attention_cache[key] = self._prefill_attention(*key)
        return t

    def _prefill_attention(self, tokens: int, past_tokens: int, pairs: float, seqs: int,
                           chunks: tuple[tuple[int, int], ...]) -> float:
        if self._extend_times is not None:
            return self._extend_times(chunks or _alike_chunks(tokens, past_tokens, seqs))
        if self._prefill_grid is not None:
            t = (self.prefill_attention_sol(tokens, past_tokens, pairs)
                 / self._prefill_grid(tokens, past_tokens / max(seqs, 1)))
        else:
            nbytes, fl = self.prefill_attention_work(tokens, past_tokens, pairs)
            t = max(nbytes / self.mem_rate, fl / self.pf_comp_rate)
        if self._extend_tiles is not None and len(chunks) > 1:
            t *= self._extend_tiles.padding(chunks)
        return t

    def lm_head_time(self, sampled: int) -> float:
        """The LM head over ``sampled`` positions (memoised, as ``_dense_layer``)."""
        t = self._lm_cache.get(sampled)
        if t is None:
            t = self._lm_cache[sampled] = self._gemm(sampled, self.lm_head, self._lm_grid)
        return t

    def _dense_layer(self, tokens: int) -> float:
        """GEMMs and all-reduces of one layer for ``tokens`` tokens (memoised: decode steps
        repeat the same padded batch sizes)."""
        t = self._dense_cache.get(tokens)
        if t is None:
            t = sum(self._gemm(tokens, op, g)
                    for op, g in zip(self.gemms, self._gemm_grids, strict=True))
            if self.tp > 1:
                frac = 2.0 * (self.tp - 1) / self.tp
                t += 2 * (tokens * self.hidden * ACT_BYTES * frac / self.net_rate
                          + self.calib.allreduce_latency_s)
            self._dense_cache[tokens] = t
        return t

    def graphed(self, s: StepShape) -> bool:
        """Whether a CUDA graph runs the step: decode-only, within the captured sizes."""
        return (s.prefill_tokens == 0 and self.graphs_enabled
                and s.decode_reqs <= self.graph_max)

    def eager_decode(self, s: StepShape) -> bool:
        """Whether the step is a decode step that no CUDA graph runs (above the largest
        captured batch): it pays the calibration's ``eager_decode_layer_s`` per layer, or,
        where the calibration times its host iteration, lasts at least that."""
        return s.prefill_tokens == 0 and not self.graphed(s)

    def host_bound_floor(self, s: StepShape) -> float:
        """The least a step lasts whatever its kernels: the host's iteration around an eager
        decode step (``eager_decode_host_s`` + ``eager_decode_host_per_req_s`` x its batch), 0
        for any other step or where it is not timed."""
        if not self.eager_decode(s):
            return 0.0
        return self.decode_host_s + self.decode_host_per_req_s * s.decode_reqs

    def launch_s(self, s: StepShape) -> float:
        """How long the host is still launching a step's kernels after the step starts: an
        eager prefill's launch floor less its head start (``eager_prefill_launch_s``); 0 for
        a decode step (a graph replay, or an eager step whose host time its floor already
        bounds) or where launches are not timed. Under the overlap scheduler the host
        streams the previous step's tokens only after this (``Replica``)."""
        if not s.prefill_tokens or self.prefill_launch_s <= 0.0:
            return 0.0
        return max(0.0, self.prefill_launch_s - s.launch_head_start_s)

    def launch_floor_s(self, s: StepShape) -> float:
        """The least a prefill step with timed launches lasts from its start: its launches
        (``launch_s``), then the host's turnaround to the next step's launch
        (``eager_prefill_turnaround_s``), through which the GPU idles; 0 for any other step.
        A step whose kernels outlast this lasts its kernels: the turnaround runs under them."""
        if not s.prefill_tokens or self.prefill_launch_s <= 0.0:
            return 0.0
        return self.launch_s(s) + self.prefill_turnaround_s

    def layer_overhead(self, s: StepShape) -> float:
        """Fixed cost per layer: launches from a CUDA graph, or eager ones (a prefill step's,
        or a decode step's above the largest captured batch, which may differ; none where
        the host's iteration bounds that step instead, ``host_bound_floor``)."""
        c = self.calib
        if self.graphed(s):
            return c.layer_overhead_s
        if not self.eager_decode(s):
            return c.eager_layer_overhead_s
        return 0.0 if self.decode_host_timed else c.eager_decode_layer_s

    def decode_step_time(self, reqs: int, kv_tokens: int, read_bytes: float,
                         released: int = 0) -> float:
        """``step_time`` of a decode-only step (``StepShape(decode_reqs=reqs,
        decode_kv_tokens=kv_tokens, decode_read_bytes=read_bytes, released_reqs=released)``),
        without building the shape."""
        return self.decode_step_timer(reqs)(kv_tokens, read_bytes, released)

    def decode_step_timer(self, reqs: int) -> Callable[[int, float, int], float]:
        """``decode_step_time`` for batches of ``reqs`` requests, as a function of
        (kv_tokens, read_bytes, released): what depends on the batch size alone is worked
        out once (memoised), since the engine times runs of decode steps of one batch. The
        same operations in the same order as the prefill path of ``step_time``, so every
        step time is the same to the last bit."""
        f = self._decode_timers.get(reqs)
        if f is None:
            f = self._decode_timers[reqs] = self._make_decode_timer(reqs)
        return f

    def _make_decode_timer(self, reqs: int) -> Callable[[int, float, int], float]:
        c = self.calib
        graphed = self.graphs_enabled and reqs <= self.graph_max
        lin_tokens = self.padded_batch(reqs) if graphed else reqs
        dense = self._dense_layer(lin_tokens)
        lm_head = self.lm_head_time(lin_tokens)
        layers = self.layers
        # a graph's launches; above the largest graph the eager ones, or none where the
        # host's iteration bounds the step instead (host_bound_floor)
        overhead = layers * (c.layer_overhead_s if graphed else
                             0.0 if self.decode_host_timed else c.eager_decode_layer_s)
        fixed = c.step_overhead_s + c.seq_overhead_s * reqs
        per_release = c.release_overhead_s
        floor = 0.0 if graphed else self.decode_host_s + self.decode_host_per_req_s * reqs
        if not reqs:
            def idle(kv_tokens: int, read_bytes: float, released: int = 0) -> float:
                t = layers * dense + lm_head
                t += overhead
                t += fixed + per_release * released
                return max(t, floor)
            return idle
        # decode_attention_timer's arithmetic, inline: this runs for every step of a run
        scale, per_req, q_bytes, written, flops_per_token = self._attention_terms(reqs)
        if self._decode_grid is not None:
            bw, peak = self.bw, self.flops
            eta = self._decode_grid.at_x(reqs)

            def step(kv_tokens: int, read_bytes: float, released: int = 0) -> float:
                sol = max((read_bytes + written + q_bytes) / bw,
                          flops_per_token * kv_tokens / peak)
                t = layers * (dense + sol / eta(kv_tokens / per_req) * scale) + lm_head
                t += overhead
                t += fixed + per_release * released
                return max(t, floor)
            return step
        mem, comp = self.attn_mem_rate, self.attn_comp_rate

        def flat(kv_tokens: int, read_bytes: float, released: int = 0) -> float:
            attention = max((read_bytes + written + q_bytes) / mem,
                            flops_per_token * kv_tokens / comp) * scale
            t = layers * (dense + attention) + lm_head
            t += overhead
            t += fixed + per_release * released
            return max(t, floor)
        return flat

    def step_time(self, s: StepShape, launch_floor: bool = True) -> float:
        """Seconds one step of shape ``s`` lasts. ``launch_floor=False``: an eager prefill
        step's kernels as if its launches never held them back (the interval fit's
        kernel-bound side, ``step_fit``)."""
        if not s.prefill_tokens and not s.prefill_seqs:
            return self.decode_step_time(s.decode_reqs, s.decode_kv_tokens,
                                         s.decode_read_bytes, s.released_reqs)
        c = self.calib
        graphed = self.graphed(s)
        tokens = s.decode_reqs + s.prefill_tokens
        lin_tokens = self.padded_batch(s.decode_reqs) if graphed else tokens
        per_layer = self._dense_layer(lin_tokens)
        if s.decode_reqs:
            per_layer += self.decode_attention_time(s.decode_reqs, s.decode_kv_tokens,
                                                    s.decode_read_bytes)
        if s.prefill_tokens:
            per_layer += self.prefill_attention_time(s.prefill_tokens, s.prefill_past_tokens,
                                                     s.prefill_pairs, s.prefill_seqs,
                                                     s.prefill_chunks)
        sampled = (lin_tokens if graphed else s.decode_reqs) + s.prefill_seqs
        t = self.layers * per_layer + self.lm_head_time(sampled)
        if s.prefill_tokens:
            t *= c.prefill_clock_scale(s.prefill_gap_s)   # the grids ran at the power limit
            # per-token work is GPU work: a short prompt's launches hide it with the kernels
            t += c.prefill_token_overhead_s * s.prefill_tokens
        if s.prefill_tokens and self.prefill_launch_s > 0.0:
            # the kernels run under their launches, which began launch_head_start_s ago
            if launch_floor:
                t = max(t, self.launch_floor_s(s))
        else:
            t += self.layers * self.layer_overhead(s)
        if s.prefill_tokens:
            t += c.prefill_step_overhead_s + c.prefill_seq_overhead_s * s.prefill_seqs
        t += (c.step_overhead_s + c.seq_overhead_s * (s.decode_reqs + s.prefill_seqs)
              + c.release_overhead_s * s.released_reqs)
        return max(t, self.host_bound_floor(s))
