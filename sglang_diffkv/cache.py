"""CompressedKVCache: the reference DiffKV cache, gluing policy, store and memory manager.

One object holds the unified pages and the page manager of one device and runs the whole
request lifecycle in plain torch (any device):

    begin_prefill -> prefill_layer (every layer) -> end_prefill
    begin_decode  -> decode_layer  (every layer) ...  -> free

and with chunked prefill (a prompt over several extend steps, ``ExtendRequests``):
``begin_prefill(reserve=whole prompt)`` at the first chunk, then per chunk and layer
``extend_layer_attend`` (the stored chunks) and ``store_chunk`` (a chunk before the last:
stored at the high tier, not scored) or ``store_last_chunk`` (the whole prompt scored and
classified, earlier chunks demoted or pruned in place), ``end_extend`` after each step.

and with shared prefixes: ``export_prefix`` (a DECODING request's rows frozen as a handle),
``attach_prefix`` (a FREE slot starts from a handle, then decodes), ``release_prefix``.

It is the single implementation the quality harness, the SGLang backend's CPU path and the
kernel tests share: kernels replace its steps one by one and are checked against it.
Prefill attention is exact on the fresh K/V (as in DiffKV); compression happens after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from sglang_diffkv import bench_mix
from sglang_diffkv.attention import DecodeAttention, paged_decode_attention
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.extend_attention import (
    ExtendAttention,
    paged_extend_attention,
    paged_extend_probs,
    paged_prefix_probs,
)
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import (
    AllocResult,
    MemorySpec,
    PageCopies,
    PageManager,
    SharedPrefix,
    alloc_page_storage,
    copy_pages,
)
from sglang_diffkv.pages import (
    TokenLocations,
    add_scores,
    read_scores,
    read_token_codes,
    read_tokens,
    token_locations,
    write_token_codes,
    write_tokens,
)
from sglang_diffkv.policy import (
    DecodeAction,
    DecodeDecision,
    PromptClassification,
    Tier,
    classify_prompt,
    decode_step,
    group_max,
    prompt_attention_mass,
    tier_growth,
)

IndexLike = torch.Tensor | Sequence[int]


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


@dataclass(frozen=True)
class ExtendRequests:
    """One extend step's requests as chunked prefill sees them (host lists, one entry per
    request in batch order; what SGLang's ForwardBatch gives: ``extend_prefix_lens_cpu``,
    ``extend_seq_lens_cpu``, plus each prompt's whole length).

    A request's fresh tokens are packed rows ``starts[b] .. starts[b] + fresh[b] - 1``;
    ``prefix[b]`` tokens of its prompt are already stored (earlier chunks) and the prompt
    has ``total[b]`` tokens. Kinds: whole (prefix 0, fresh = total: stage 1's prefill),
    partial (a chunk before the last: prefix + fresh < total), last (prefix > 0 and prefix +
    fresh = total)."""

    req: torch.Tensor  # int64 [B] on the cache's device
    slots: tuple[int, ...]  # the same request slots on the host
    starts: tuple[int, ...]
    fresh: tuple[int, ...]
    prefix: tuple[int, ...]
    total: tuple[int, ...]

    def __post_init__(self) -> None:
        b = len(self.slots)
        if not all(len(x) == b for x in (self.starts, self.fresh, self.prefix, self.total)):
            raise ValueError("ExtendRequests: one start, fresh, prefix and total per request")
        for r, n, p, t in zip(self.slots, self.fresh, self.prefix, self.total, strict=True):
            if n < 1 or p < 0 or p + n > t:
                raise ValueError(f"ExtendRequests: request slot {r}: {n} fresh tokens after "
                                 f"a prefix of {p} overrun its {t}-token prompt")

    @classmethod
    def build(cls, req: torch.Tensor, slots: Sequence[int], fresh: Sequence[int],
              prefix: Sequence[int], total: Sequence[int]) -> ExtendRequests:
        starts, at = [], 0
        for n in fresh:
            starts.append(at)
            at += int(n)
        return cls(req, tuple(int(r) for r in slots), tuple(starts),
                   tuple(int(n) for n in fresh), tuple(int(p) for p in prefix),
                   tuple(int(t) for t in total))

    def _where(self, test: Callable[[int, int, int], bool]) -> list[int]:
        return [b for b, (n, p, t) in enumerate(zip(self.fresh, self.prefix, self.total,
                                                    strict=True)) if test(n, p, t)]

    @property
    def whole(self) -> list[int]:
        return self._where(lambda n, p, t: p == 0 and n == t)

    @property
    def partial(self) -> list[int]:
        return self._where(lambda n, p, t: p + n < t)

    @property
    def last(self) -> list[int]:
        return self._where(lambda n, p, t: p > 0 and p + n == t)

    @property
    def prefixed(self) -> list[int]:
        return self._where(lambda n, p, t: p > 0)

    @property
    def chunked(self) -> bool:
        """Whether any request is not a whole prompt (else stage 1's path applies)."""
        return len(self.whole) < len(self.slots)

    def rows(self, b: int) -> slice:
        return slice(self.starts[b], self.starts[b] + self.fresh[b])


class CompressedKVCache:
    def __init__(
        self,
        config: DiffKVConfig,
        *,
        head_dim: int,
        num_layers: int,
        num_kv_heads: int,
        num_pages: int,
        max_reqs: int,
        max_context: int,
        device: torch.device | str = "cpu",
        validate: bool = True,
    ) -> None:
        config.check_head_dim(head_dim)
        self.config = config
        self.device = torch.device(device)
        self.geometry = PageGeometry.for_config(config, head_dim)
        spec = MemorySpec.from_geometry(
            self.geometry,
            num_pages=num_pages,
            max_reqs=max_reqs,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            max_context=max_context,
        )
        self.manager = PageManager(spec, self.device, validate=validate)
        self.pages = alloc_page_storage(num_pages, self.geometry.page_bytes, self.device)
        # Per-request thresholds (alpha_h, alpha_l); the config's unless overridden.
        self.alpha = torch.zeros(max_reqs, 2, device=self.device)
        # Decode-step page allocation: the manager's torch ops; the kernels path swaps in the
        # one-launch CUDA compaction (kernels.decode_compaction), same state changes.
        self.decode_room: Callable[[torch.Tensor, torch.Tensor], AllocResult] = (
            self.manager.ensure_decode_room
        )
        # Prompt tokens kept per (request, layer, head, tier) between prefill and reclaim.
        self._prompt_kept = torch.zeros(
            max_reqs, num_layers, num_kv_heads, 2, dtype=torch.int64, device=self.device
        )
        # Benchmark mode (config.bench_mix): each prefill gets the next seed of a counter, so
        # a run's draws are reproducible and a reused slot does not replay its predecessor.
        self.bench_seed = torch.zeros(max_reqs, dtype=torch.int64, device=self.device)
        self._bench_serial = 0
        # Chunked prefill: per request slot between chunks, the prompt's last score_queries
        # queries so far, per layer ([layers, Q, Hq, D], q's dtype) and how many are held.
        # The last chunk scores with them when it holds fewer than score_queries queries.
        self._score_queries: dict[int, torch.Tensor] = {}
        self._score_queries_held: dict[int, int] = {}
        # Radix prefix sharing (``prompt_sharing.PromptSharing``), when the SGLang tree cache
        # turns it on: prompts exported with their cut counts, suffixes over attached ones.
        self.radix = None

    def _request_thresholds(
        self,
        b: int,
        alpha_h: Sequence[float] | torch.Tensor | None,
        alpha_l: Sequence[float] | torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-request (alpha_h, alpha_l) for ``b`` requests, the config's where not given;
        alpha_l never exceeds alpha_h (the policy's tiers would cross)."""
        ah = torch.full((b,), self.config.alpha_h) if alpha_h is None else torch.as_tensor(alpha_h)
        al = torch.full((b,), self.config.alpha_l) if alpha_l is None else torch.as_tensor(alpha_l)
        if bool((al > ah).any()):
            raise ValueError(f"per-request alpha_l {al.tolist()} exceeds alpha_h {ah.tolist()}")
        return ah, al

    @property
    def spec(self) -> MemorySpec:
        return self.manager.spec

    @property
    def counts(self) -> torch.Tensor:
        return self.manager.counts

    def _index(self, req_idx: IndexLike) -> torch.Tensor:
        t = torch.as_tensor(req_idx)  # (a device tensor stays as it is)
        if t.device != self.device and t.device.type == "cpu" and self.device.type == "cuda":
            # a pageable host-to-device copy synchronises the stream, and under SGLang's
            # overlap scheduler that stream waits for the forward in flight: every request
            # free blocked the host (up to 7.4 ms in an H100 profile). From pinned memory the
            # copy is queued like a kernel.
            t = t.to(torch.int64).pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device).long().reshape(-1)

    # ---- prefill -------------------------------------------------------------------------

    def begin_prefill(
        self,
        req_idx: IndexLike,
        lengths: IndexLike,
        alpha_h: Sequence[float] | torch.Tensor | None = None,
        alpha_l: Sequence[float] | torch.Tensor | None = None,
        reserve: IndexLike | None = None,
    ) -> AllocResult:
        """All-high page allocation for whole prompts; the result's ``ok`` is False (and
        nothing changed) if the pool is too small. ``reserve[b]``: the whole prompt when
        ``lengths[b]`` is its first chunk (``PageManager.allocate_prefill``)."""
        req = self._index(req_idx)
        b = req.shape[0]
        ah, al = self._request_thresholds(b, alpha_h, alpha_l)
        result = self.manager.allocate_prefill(req, lengths, reserve)
        ok = result.ok.to(self.device)
        alphas = torch.stack([ah, al], -1).float().to(self.device)
        self.alpha[req] = torch.where(ok, alphas, self.alpha[req])
        self._prompt_kept[req] = 0
        if self.config.bench_mix is not None:
            seeds = torch.arange(b, device=self.device) + self._bench_serial
            self.bench_seed[req] = torch.where(ok, seeds, self.bench_seed[req])
            self._bench_serial += b
        return result

    def bench_significance(
        self, layer: int, req_idx: IndexLike, lengths: torch.Tensor, max_len: int
    ) -> torch.Tensor:
        """Benchmark mode: the significance sums [B, Hkv, max_len] that make the classifier
        follow ``config.bench_mix`` (see ``bench_mix.synthetic_significance``)."""
        cfg = self.config
        if cfg.bench_mix is None:
            raise ValueError("bench_significance needs a config with bench_mix set")
        req = self._index(req_idx)
        a = self.alpha[req]
        return bench_mix.synthetic_significance(
            self.bench_seed[req], layer, self.spec.num_kv_heads, lengths.to(self.device),
            max_len, a[:, 0], a[:, 1], cfg.bench_mix, cfg.window, cfg.score_queries,
        )

    def bench_actions(
        self, layer: int, req_idx: IndexLike, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """Benchmark mode: the forced decode actions [B, Hkv]; None outside it."""
        if self.config.bench_mix is None:
            return None
        req = self._index(req_idx)
        return bench_mix.forced_actions(
            self.bench_seed[req], layer, self.spec.num_kv_heads, positions.to(self.device),
            self.config.bench_mix,
        )

    def classify(
        self, req_idx: IndexLike, lengths: torch.Tensor, significance_sum: torch.Tensor
    ) -> PromptClassification:
        """significance_sum: [B, Hkv, Lmax] (already maxed over each GQA group)."""
        req = self._index(req_idx)
        a = self.alpha[req]
        return classify_prompt(
            significance_sum,
            lengths.to(self.device),
            a[:, 0],
            a[:, 1],
            self.config.window,
            self.config.score_queries,
        )

    def store_prefill(
        self,
        layer: int,
        req_idx: IndexLike,
        key: torch.Tensor,
        value: torch.Tensor,
        cls: PromptClassification,
    ) -> None:
        """Quantise and write a layer's prompt K/V ([B, Hkv, Lmax, D]) by tier: high tokens
        into row pages [0, hp), low tokens into the pages right after them (the layout
        ``reclaim_prefill`` expects), both in position order. Pruned tokens are dropped."""
        req = self._index(req_idx)
        rows = self.manager.table[req, layer]  # [B, H, row_len]
        n_high = cls.n_high.long()
        hp = _ceil_div(n_high, self.geometry.high.tokens_per_page)
        for tier, layout in zip((Tier.HIGH, Tier.LOW), self.geometry.tiers, strict=True):
            member = cls.tier == tier  # [B, H, L]
            rank = member.long().cumsum(-1) - 1  # stable compaction: no sort
            page_index = rank // layout.tokens_per_page
            if tier == Tier.LOW:
                page_index = page_index + hp[..., None]
            page_ids = torch.gather(rows, -1, page_index.clamp(min=0).long())
            slots = rank % layout.tokens_per_page
            b, h, length = member.nonzero(as_tuple=True)
            write_tokens(
                self.pages,
                layout,
                page_ids[b, h, length],
                slots[b, h, length].int(),
                key[b, h, length],
                value[b, h, length],
                cls.score[b, h, length],
                cls.pos[b, length],
            )
        self._prompt_kept[req, layer, :, 0] = n_high
        self._prompt_kept[req, layer, :, 1] = cls.n_low.long()
        if self.radix is not None:
            self.radix.record(layer, req, cls.tier)

    def prefill_layer(
        self,
        layer: int,
        req_idx: IndexLike,
        lengths: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sm_scale: float,
    ) -> PromptClassification:
        """Score (dense oracle), classify and store one layer of whole prompts.
        query: [B, Hq, Lmax, D]; key/value: [B, Hkv, Lmax, D]."""
        b, hkv, lmax, _ = key.shape
        sig = torch.zeros(b, hkv, lmax, device=self.device)
        for i, n in enumerate(lengths.tolist()):
            mass = prompt_attention_mass(
                query[i, :, :n], key[i, :, :n], sm_scale, self.config.score_queries
            )
            sig[i, :, :n] = group_max(mass, hkv)
        if self.config.bench_mix is not None:
            # the scores above were computed for their cost; the draw decides the tiers
            sig = self.bench_significance(layer, req_idx, lengths, lmax)
        cls = self.classify(req_idx, lengths, sig)
        self.store_prefill(layer, req_idx, key, value, cls)
        return cls

    def end_prefill(self, req_idx: IndexLike) -> None:
        """Return the pages compression freed and move low pages to the right of each row."""
        req = self._index(req_idx)
        kept = self._prompt_kept[req]
        self.manager.reclaim_prefill(req, kept[..., 0], kept[..., 1])

    # ---- chunked prefill (a prompt over several extend steps) -------------------------------
    #
    # Until its last chunk a prompt's tokens sit at the high tier of the all-high pages
    # reserved for the whole prompt at the first chunk, in position order (slot s of the high
    # tier = position s), unscored; nothing is demoted or pruned. The last chunk scores the
    # whole prompt with its last score_queries queries (the same queries over the same keys
    # as the whole-prompt path, earlier chunks' keys K8-quantised), classifies every token
    # with the prefill policy and rewrites the row in the compressed layout: a token that
    # stays high keeps its stored bytes, one that goes low is re-quantised from them (as a
    # decode demotion does), a pruned one is dropped; ``end_extend`` then reclaims the pages.

    def store_chunk(self, layer: int, ext: ExtendRequests, query: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor) -> None:
        """One layer of the chunks before a prompt's last (``ext.partial``): their fresh
        key / value (packed [T, Hkv, D]) stored at the high tier after the row's stored
        tokens, and their last queries kept for the scoring (``query`` [T, Hq, D])."""
        high = self.geometry.high
        per_page = high.tokens_per_page
        for b in ext.partial:
            rows = ext.rows(b)
            n, p = ext.fresh[b], ext.prefix[b]
            table = self.manager.table[ext.req[b], layer]  # [Hkv, row_len]
            hkv = table.shape[0]
            pos = torch.arange(p, p + n, device=self.device)
            page_ids = table[:, pos // per_page]  # [Hkv, n]
            slots = (pos % per_page).int().expand(hkv, n)
            k = key[rows].transpose(0, 1).reshape(hkv * n, -1)
            v = value[rows].transpose(0, 1).reshape(hkv * n, -1)
            write_tokens(self.pages, high, page_ids.reshape(-1), slots.reshape(-1), k, v,
                         torch.zeros(hkv * n, device=self.device),
                         pos.int().expand(hkv, n).reshape(-1))
            self._keep_score_queries(layer, ext.slots[b], query[rows])

    def _keep_score_queries(self, layer: int, slot: int, q: torch.Tensor) -> None:
        """Keep the prompt's last score_queries queries so far (this layer); how many are
        held advances in ``end_extend``, once every layer has kept its own."""
        nq = self.config.score_queries
        buf = self._score_queries.get(slot)
        if buf is None:
            buf = q.new_zeros(self.spec.num_layers, nq, *q.shape[1:])
            self._score_queries[slot] = buf
            self._score_queries_held[slot] = 0
        held = self._score_queries_held[slot]
        kept = torch.cat([buf[layer, :held], q.to(buf.dtype)])[-nq:]
        buf[layer, :kept.shape[0]] = kept

    def last_chunk_significance(self, layer: int, ext: ExtendRequests, b: int,
                                query: torch.Tensor, key: torch.Tensor,
                                sm_scale: float) -> torch.Tensor:
        """fp32 [1, Hkv, total]: the attention mass each prompt token of request ``b`` (a
        last chunk) receives from the prompt's last min(score_queries, total) queries,
        summed per query head and maxed over the GQA group, as ``prompt_attention_mass`` and
        ``group_max`` give the whole-prompt path. The chunk's own queries see the stored
        prefix and the chunk causally (``paged_extend_probs``); when the chunk is shorter
        than score_queries the rest are the previous chunks' last queries, kept by
        ``store_chunk``, which see the prefix up to their own position
        (``paged_prefix_probs``). Read before the chunk is stored."""
        rows = ext.rows(b)
        n, p, total = ext.fresh[b], ext.prefix[b], ext.total[b]
        nq_all = min(self.config.score_queries, total)
        nq = min(nq_all, n)
        req = ext.req[b:b + 1]
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        pr = paged_extend_probs(
            query[rows], key[rows], zero, torch.full_like(zero, n), self.pages, self.geometry,
            self.manager.table, self.manager.counts, req, layer, sm_scale, nq)
        mass = torch.cat([pr.prob_high[0, :, :nq, :p], pr.prob_fresh[0, :, :nq, :n]],
                         dim=-1).sum(1)  # [Hq, total]
        need = nq_all - nq
        if need > 0:
            held = self._score_queries_held.get(ext.slots[b], 0)
            if held < need:
                raise RuntimeError(
                    f"diffkv chunked prefill: request slot {ext.slots[b]} needs {need} "
                    f"queries of its earlier chunks to score its {total}-token prompt, but "
                    f"{held} were kept")
            q_old = self._score_queries[ext.slots[b]][layer, held - need:held]
            q_pos = torch.arange(p - need, p, device=self.device)
            old = paged_prefix_probs(q_old, q_pos, self.pages, self.geometry,
                                     self.manager.table, self.manager.counts, req, layer,
                                     sm_scale)  # [Hq, need, p]
            mass[:, :p] += old[..., :p].sum(1)
        return group_max(mass, self.spec.num_kv_heads)[None]

    def store_last_chunk(self, layer: int, ext: ExtendRequests, query: torch.Tensor,
                         key: torch.Tensor, value: torch.Tensor, sm_scale: float) -> None:
        """One layer of the last chunks (``ext.last``): score the whole prompt
        (``last_chunk_significance``; benchmark mode draws instead), classify every token
        with the prefill policy and store the prompt in the compressed layout
        (``store_prefill``'s), from the stored prefix and the fresh key / value."""
        for b in ext.last:
            total = ext.total[b]
            req = ext.req[b:b + 1]
            lengths = torch.tensor([total], device=self.device)
            sig = self.last_chunk_significance(layer, ext, b, query, key, sm_scale)
            if self.config.bench_mix is not None:
                sig = self.bench_significance(layer, req, lengths, total)
            cls = self.classify(req, lengths, sig)
            rows = ext.rows(b)
            self._store_prompt(layer, req, ext.prefix[b], key[rows], value[rows], cls)

    def _store_prompt(self, layer: int, req: torch.Tensor, prefix: int, key: torch.Tensor,
                      value: torch.Tensor, cls: PromptClassification) -> None:
        """Rewrite one request's row (PREFILLED: ``prefix`` tokens at the high tier in
        position order) as ``store_prefill`` lays out a whole prompt classified by ``cls``,
        the last tokens from key / value [n, Hkv, D]. Everything is read before anything is
        written; prefix tokens that stay high keep their stored bytes."""
        high = self.geometry.high
        per_page = high.tokens_per_page
        table = self.manager.table[req[0], layer]  # [Hkv, row_len]
        hkv = table.shape[0]
        pos = torch.arange(prefix, device=self.device)
        src_pages = table[:, pos // per_page].reshape(-1)
        src_slots = (pos % per_page).int().expand(hkv, prefix).reshape(-1)
        old = read_tokens(self.pages, high, src_pages, src_slots)
        codes = read_token_codes(self.pages, high, src_pages, src_slots)
        d = key.shape[-1]
        full_k = torch.cat([old.key.view(hkv, prefix, d), key.transpose(0, 1).float()], 1)
        full_v = torch.cat([old.value.view(hkv, prefix, d), value.transpose(0, 1).float()], 1)
        self.store_prefill(layer, req, full_k[None], full_v[None], cls)
        # store_prefill re-quantised the prefix from its dequantised values; a token that
        # stays high gets its stored bytes back: re-quantising is the identity for most
        # groups, but not for one far from zero relative to its spread (zero + 255 * scale
        # is inexact in fp32, and the fp16 scale then rounds up a step)
        is_high = cls.tier[0] == Tier.HIGH  # [Hkv, total]
        rank = is_high.long().cumsum(-1) - 1
        keep = is_high[:, :prefix]  # [Hkv, prefix]
        dst = rank[:, :prefix][keep]
        head = torch.arange(hkv, device=self.device)[:, None].expand(hkv, prefix)[keep]
        write_token_codes(self.pages, high, table[head, dst // per_page],
                          (dst % per_page).int(),
                          [c.view(hkv, prefix, -1)[keep] for c in codes])

    def end_extend(self, ext: ExtendRequests) -> None:
        """After the last layer of an extend step with chunks: rows of continued prompts
        count their chunk's tokens (``PageManager.advance_prefill``), whole prompts and
        last chunks are reclaimed (``end_prefill``: pages compression freed go back), and
        the kept scoring queries advance or are dropped."""
        cont = ext.prefixed
        if cont:
            self.manager.advance_prefill(ext.req[cont], [ext.fresh[b] for b in cont])
        nq = self.config.score_queries
        for b in ext.partial:
            slot = ext.slots[b]
            if slot in self._score_queries:
                self._score_queries_held[slot] = min(
                    nq, self._score_queries_held[slot] + ext.fresh[b])
        done = ext.whole + ext.last
        if done:
            self.end_prefill(ext.req[sorted(done)])
        self._drop_score_queries(ext.slots[b] for b in ext.last)

    def _drop_score_queries(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._score_queries.pop(slot, None)
            self._score_queries_held.pop(slot, None)

    # ---- decode --------------------------------------------------------------------------

    def begin_decode(self, req_idx: IndexLike) -> AllocResult:
        """Room for one more token in every tier a step may grow (the low tier only when the
        request's thresholds allow demotion, or benchmark mode draws demotions)."""
        req = self._index(req_idx)
        a = self.alpha[req]
        low = a[:, 0] > a[:, 1]
        mix = self.config.bench_mix
        if mix is not None and mix[1] > 0:
            low = torch.ones_like(low)
        tiers = torch.stack([torch.ones_like(low), low], -1)
        return self.decode_room(req, tiers)

    def decode_layer_store(
        self,
        layer: int,
        req_idx: IndexLike,
        positions: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> DecodeDecision:
        """Policy step for one layer, then write the new token (key/value [B, Hkv, D]) at
        position ``positions[b]``: evict / demote per the decision, then store."""
        req = self._index(req_idx)
        d, growth = apply_decode_step(
            self.pages,
            self.geometry,
            self.manager.table[req, layer],
            self.manager.counts[req, layer],
            positions.to(self.device),
            self.alpha[req],
            self.config.window,
            key,
            value,
            forced=self.bench_actions(layer, req, positions),
            shared_tokens=self.shared_tokens(layer, req),
        )
        deltas = torch.zeros(
            *self.manager.counts[req].shape[:-1], 2, dtype=torch.int64, device=self.device
        )
        deltas[:, layer] = growth
        self.manager.add_tokens(req, deltas)
        return d

    def decode_layer_attend(
        self, layer: int, req_idx: IndexLike, query: torch.Tensor, sm_scale: float
    ) -> DecodeAttention:
        """Attention of query [B, Hq, D] over the cache, then score accumulation."""
        req = self._index(req_idx)
        res = paged_decode_attention(
            query,
            self.pages,
            self.geometry,
            self.manager.table,
            self.manager.counts,
            req,
            layer,
            sm_scale,
        )
        rows = self.manager.table[req, layer]
        cnt = self.manager.counts[req, layer].long()
        shared = self.shared_tokens(layer, req)
        for t, prob in enumerate((res.prob_high, res.prob_low)):
            layout = self.geometry.tiers[t]
            loc = token_locations(
                rows, cnt[..., t], layout.tokens_per_page, low=t == 1, capacity=prob.shape[-1]
            )
            # a shared prefix's tokens are read-only: their scores stay as exported (the
            # policy never picks them, so it never reads them)
            slot = torch.arange(prob.shape[-1], device=self.device)
            m = loc.mask & (slot >= shared[..., t, None])
            add_scores(self.pages, layout, loc.page_ids[m], loc.slots[m], prob[m])
        return res

    # ---- lifecycle -----------------------------------------------------------------------

    def copy_state_from(self, other: CompressedKVCache) -> None:
        """Make this cache's state equal to ``other``'s (pages, page table, counters, phases,
        free list, thresholds, prompt tier counts, benchmark seeds); shapes must match. Lets
        a test or the GPU check run two paths from one state."""
        self.pages.copy_(other.pages)
        for name in ("table", "counts", "phase"):
            getattr(self.manager, name).copy_(getattr(other.manager, name))
        for name in ("_buf", "head", "tail"):
            getattr(self.manager.free_list, name).copy_(getattr(other.manager.free_list, name))
        for name in ("alpha", "_prompt_kept", "bench_seed"):
            getattr(self, name).copy_(getattr(other, name))
        m, o = self.manager, other.manager
        m.shared.copy_(o.shared)
        m._refs_buf.copy_(o._refs_buf)
        if m.decode_hints is not None:
            # the fused argmin's records follow the state they describe (or none is valid)
            if o.decode_hints is not None:
                m.decode_hints.copy_(o.decode_hints)
            else:
                m.decode_hints.fill_(-1)
        m.handles = {k: replace(h, pages=h.pages.to(self.device),
                                n_tokens=h.n_tokens.to(self.device))
                     for k, h in o.handles.items()}
        m._next_handle, m._sharing = o._next_handle, o._sharing
        self._score_queries = {k: v.to(self.device).clone()
                               for k, v in other._score_queries.items()}
        self._score_queries_held = dict(other._score_queries_held)

    def free(self, req_idx: IndexLike) -> None:
        req = self._index(req_idx)
        if self._score_queries:  # (a chunked prompt in flight: rare, so the sync is too)
            self._drop_score_queries(req.tolist())
        self.manager.free_requests(req)

    # ---- shared prefixes (memory.sharing; admission time) ----------------------------------

    def shared_tokens(self, layer: int, req_idx: IndexLike) -> torch.Tensor:
        """int64 [B, Hkv, 2]: each tier's leading slots that belong to a shared prefix."""
        per_page = torch.tensor(self.spec.tokens_per_page, device=self.device)
        return self.manager.shared[self._index(req_idx), layer].long() * per_page

    def _copy_pages(self, copies: PageCopies) -> None:
        copy_pages(self.pages, copies)  # (no host sync)

    def export_prefix(
        self, req_idx: IndexLike, num_tokens: Sequence[int]
    ) -> tuple[list[SharedPrefix], AllocResult]:
        """Freeze the compressed state of DECODING requests (``num_tokens[b]`` positions
        each) as shared prefixes (``PageManager.export_prefix``), copying each row's partial
        pages into the handles' own. From now on the exporting requests' policy leaves the
        shared tokens alone. ``ok`` False: nothing changed and the handles are empty."""
        handles, result, copies = self.manager.export_prefix(self._index(req_idx), num_tokens)
        self._copy_pages(copies)
        return handles, result

    def attach_prefix(
        self,
        req_idx: IndexLike,
        handles: Sequence[SharedPrefix],
        alpha_h: Sequence[float] | torch.Tensor | None = None,
        alpha_l: Sequence[float] | torch.Tensor | None = None,
        n_tokens: torch.Tensor | None = None,
        copy: bool = False,
    ) -> AllocResult:
        """Start FREE request slots from shared prefixes, ready to decode at position
        ``handles[b].num_tokens``: they read the prefix's tokens (the full pages shared, the
        partial ones copied) and the policy never changes them. A prefix must be reused under
        the thresholds it was compressed with (the caller's cache key). ``n_tokens`` / ``copy``
        as ``PageManager.attach_prefix`` takes them (a cut of the handle; nothing shared)."""
        req = self._index(req_idx)
        b = req.shape[0]
        ah, al = self._request_thresholds(b, alpha_h, alpha_l)
        result, copies = self.manager.attach_prefix(req, handles, n_tokens, copy=copy)
        self._copy_pages(copies)
        ok = result.ok.to(self.device)
        alphas = torch.stack([ah, al], -1).float().to(self.device)
        self.alpha[req] = torch.where(ok, alphas, self.alpha[req])
        if self.config.bench_mix is not None:
            seeds = torch.arange(b, device=self.device) + self._bench_serial
            self.bench_seed[req] = torch.where(ok, seeds, self.bench_seed[req])
            self._bench_serial += b
        return result

    def release_prefix(self, handles: Sequence[SharedPrefix]) -> None:
        """Drop shared prefixes (tree eviction); pages nobody holds any more go back."""
        self.manager.release_prefix(handles)

    def tier_fractions(self, req_idx: IndexLike, seq_lens: torch.Tensor) -> torch.Tensor:
        """[B, layers, heads, 3]: fraction of the sequence kept high, low, and pruned."""
        cnt = self.manager.counts[self._index(req_idx)].double()
        total = seq_lens.to(self.device).double().view(-1, 1, 1)
        hi, lo = cnt[..., 0] / total, cnt[..., 1] / total
        return torch.stack([hi, lo, 1 - hi - lo], -1)

    def extend_layer_attend(
        self,
        layer: int,
        req_idx: IndexLike,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        extend_start_loc: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        sm_scale: float,
        out: torch.Tensor | None = None,
    ) -> ExtendAttention:
        """Extend attention of one layer (chunked prefill, prefix hit): the fresh packed
        query [T, Hq, D] / key, value [T, Hkv, D] (request b's at rows extend_start_loc[b] +
        [0, extend_seq_lens[b])) over each request's stored tokens and, causally, the fresh
        ones (``extend_attention.paged_extend_attention``). Reads pages only: the fresh
        tokens are stored (and the prompt scored) by the caller afterwards."""
        req = self._index(req_idx)
        return paged_extend_attention(
            query, key, value, extend_start_loc.to(self.device),
            extend_seq_lens.to(self.device), self.pages, self.geometry, self.manager.table,
            self.manager.counts, req, layer, sm_scale, out=out,
        )


def _tier_scores(
    pages: torch.Tensor, geometry: PageGeometry, rows: torch.Tensor, n: torch.Tensor, tier: int
) -> tuple[TokenLocations, torch.Tensor, torch.Tensor]:
    """Locations, scores and virtual positions of one tier's tokens ([B, H, C], C >= 1)."""
    layout = geometry.tiers[tier]
    cap = max(int(n.max()) if n.numel() else 0, 1)
    loc = token_locations(rows, n, layout.tokens_per_page, low=tier == 1, capacity=cap)
    score, pos = read_scores(pages, layout, loc.page_ids.reshape(-1), loc.slots.reshape(-1))
    return loc, score.view(loc.mask.shape), pos.view(loc.mask.shape)


def apply_decode_step(
    pages: torch.Tensor,
    geometry: PageGeometry,
    rows: torch.Tensor,
    counts: torch.Tensor,
    positions: torch.Tensor,
    alpha: torch.Tensor,
    window: int,
    key: torch.Tensor,
    value: torch.Tensor,
    forced: torch.Tensor | None = None,
    shared_tokens: torch.Tensor | None = None,
) -> tuple[DecodeDecision, torch.Tensor]:
    """One layer's decode policy step over raw tensors: decide, demote / evict in ``pages``,
    store the new token. rows: [B, H, row_len] table rows; counts: [B, H, >=2] with
    (n_high, n_low) first; positions: [B]; alpha: [B, 2] = (alpha_h, alpha_l); key/value:
    [B, H, D]. Counters are left to the caller: returns the decision and the tokens each
    tier gained, int64 [B, H, 2]. The rows must already have room (``ensure_decode_room``).
    ``forced``: benchmark-mode actions [B, H]; ``shared_tokens`` [B, H, 2]: each tier's
    leading slots of a shared prefix, never victims (both ``policy.decode_step``)."""
    cnt = counts.long()
    p = positions.long()
    hi_loc, hi_score, hi_pos = _tier_scores(pages, geometry, rows, cnt[..., 0], 0)
    _, lo_score, lo_pos = _tier_scores(pages, geometry, rows, cnt[..., 1], 1)
    d = decode_step(
        hi_score,
        hi_pos,
        cnt[..., 0],
        lo_score,
        lo_pos,
        cnt[..., 1],
        p,
        alpha[:, 0],
        alpha[:, 1],
        window,
        forced=forced,
        shared_tokens=shared_tokens,
    )
    high, low = geometry.tiers
    b_idx, h_idx = torch.meshgrid(
        torch.arange(rows.shape[0], device=rows.device),
        torch.arange(rows.shape[1], device=rows.device),
        indexing="ij",
    )
    act = d.action.long()
    hmin = d.hmin.clamp(min=0)
    lmin = d.lmin.clamp(min=0)

    # Demotion first: it reads hmin's high copy before the new token overwrites it.
    demote = (act == DecodeAction.DEMOTE_APPEND) | (act == DecodeAction.DEMOTE_REPLACE)
    if bool(demote.any()):
        bi, hi = b_idx[demote], h_idx[demote]
        src = read_tokens(
            pages, high, hi_loc.page_ids[bi, hi, hmin[demote]], hi_loc.slots[bi, hi, hmin[demote]]
        )
        append = act[demote] == DecodeAction.DEMOTE_APPEND
        dst_slot_index = torch.where(append, cnt[bi, hi, 1], lmin[demote])
        page_index = rows.shape[-1] - 1 - dst_slot_index // low.tokens_per_page
        write_tokens(
            pages,
            low,
            rows[bi, hi, page_index],
            (dst_slot_index % low.tokens_per_page).int(),
            src.key,
            src.value,
            src.score,
            src.pos,
        )

    new_slot_index = torch.where(act == DecodeAction.APPEND_HIGH, cnt[..., 0], hmin)
    new_pages = torch.gather(rows, -1, (new_slot_index // high.tokens_per_page)[..., None])
    new_slots = (new_slot_index % high.tokens_per_page).int()
    n_new = new_pages.numel()
    write_tokens(
        pages,
        high,
        new_pages.reshape(-1),
        new_slots.reshape(-1),
        key.reshape(n_new, -1),
        value.reshape(n_new, -1),
        torch.zeros(n_new, device=pages.device),
        p[:, None].expand_as(new_slots).reshape(-1).int(),
    )
    growth = torch.stack([g.long() for g in tier_growth(act)], -1)
    return d, growth
