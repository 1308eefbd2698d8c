"""CompressedKVCache: the reference DiffKV cache, gluing policy, store and memory manager.

One object holds the unified pages and the page manager of one device and runs the whole
request lifecycle in plain torch (any device):

    begin_prefill -> prefill_layer (every layer) -> end_prefill
    begin_decode  -> decode_layer  (every layer) ...  -> free

and with shared prefixes: ``export_prefix`` (a DECODING request's rows frozen as a handle),
``attach_prefix`` (a FREE slot starts from a handle, then decodes), ``release_prefix``.

It is the single implementation the quality harness, the SGLang backend's CPU path and the
kernel tests share: kernels replace its steps one by one and are checked against it.
Prefill attention is exact on the fresh K/V (as in DiffKV); compression happens after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from sglang_diffkv import bench_mix
from sglang_diffkv.attention import DecodeAttention, paged_decode_attention
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.extend_attention import ExtendAttention, paged_extend_attention
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import (
    AllocResult,
    MemorySpec,
    PageCopies,
    PageManager,
    SharedPrefix,
    alloc_page_storage,
)
from sglang_diffkv.pages import (
    TokenLocations,
    add_scores,
    read_scores,
    read_tokens,
    token_locations,
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
    ) -> AllocResult:
        """All-high page allocation for whole prompts; the result's ``ok`` is False (and
        nothing changed) if the pool is too small."""
        req = self._index(req_idx)
        b = req.shape[0]
        ah = torch.full((b,), self.config.alpha_h) if alpha_h is None else torch.as_tensor(alpha_h)
        al = torch.full((b,), self.config.alpha_l) if alpha_l is None else torch.as_tensor(alpha_l)
        if bool((al > ah).any()):
            raise ValueError(f"per-request alpha_l {al.tolist()} exceeds alpha_h {ah.tolist()}")
        result = self.manager.allocate_prefill(req, lengths)
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

    def free(self, req_idx: IndexLike) -> None:
        self.manager.free_requests(self._index(req_idx))

    # ---- shared prefixes (memory.sharing; admission time) ----------------------------------

    def shared_tokens(self, layer: int, req_idx: IndexLike) -> torch.Tensor:
        """int64 [B, Hkv, 2]: each tier's leading slots that belong to a shared prefix."""
        per_page = torch.tensor(self.spec.tokens_per_page, device=self.device)
        return self.manager.shared[self._index(req_idx), layer].long() * per_page

    def _copy_pages(self, copies: PageCopies) -> None:
        # (boolean indexing syncs; the reference path tolerates it, a kernel would not)
        m = copies.mask
        self.pages[copies.dst[m]] = self.pages[copies.src[m]]

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
    ) -> AllocResult:
        """Start FREE request slots from shared prefixes, ready to decode at position
        ``handles[b].num_tokens``: they read the prefix's tokens (the full pages shared, the
        partial ones copied) and the policy never changes them. A prefix must be reused under
        the thresholds it was compressed with (the caller's cache key)."""
        req = self._index(req_idx)
        b = req.shape[0]
        ah = torch.full((b,), self.config.alpha_h) if alpha_h is None else torch.as_tensor(alpha_h)
        al = torch.full((b,), self.config.alpha_l) if alpha_l is None else torch.as_tensor(alpha_l)
        if bool((al > ah).any()):
            raise ValueError(f"per-request alpha_l {al.tolist()} exceeds alpha_h {ah.tolist()}")
        result, copies = self.manager.attach_prefix(req, handles)
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
            self.manager.counts, req, layer, sm_scale,
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
