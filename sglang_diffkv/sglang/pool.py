"""The DiffKV memory pool behind SGLang's logical token slots (stage 1).

SGLang keeps allocating one *logical* slot per token (page_size 1); slots are only handles
(``req_to_token`` rows still hold them, and nothing is stored per slot). The K/V live in the
reference ``CompressedKVCache``: per-(request, layer, KV head) unified pages, page tables
and counters keyed by ``req_pool_idx``.

Three SGLang objects are replaced:

- ``DiffKVReqToTokenPool`` (``ReqToTokenPool``): the request lifecycle. ``alloc`` records
  per-request thresholds, ``free`` / ``clear`` return the request's pages.
- ``DiffKVTokenToKVPool`` (``KVCache``): owns the ``CompressedKVCache`` and the physical
  accounting. Its ``dtype`` is uint8 so models never take SGLang's fused RoPE+set-KV path,
  and ``get_key_buffer`` & co. raise so an unexpected consumer fails loudly.
- ``DiffKVTokenToKVPoolAllocator`` (``TokenToKVPoolAllocator``): exact logical accounting;
  ``available_size()`` is ``min(logical free slots, physical free pages minus a one-step
  decode reserve, in planning tokens)``, so admission, ``check_decode_mem`` and retraction
  react to real memory. Exact at idle: with no request holding pages it equals ``size``, so
  SGLang's strict idle leak check holds whenever every page came back.

Under SGLang's overlap scheduler the forward runs on its own stream while the scheduler
(on another) already prepares the next batch and releases finished requests. Every device
read or write the scheduler side makes here first orders its stream after the last forward's
(``after_forward``: a GPU-side wait, no host sync). So the free-page count the scheduler
reads (a sync) includes the forward in flight, and a released request's pages go back only
after the forward that may still read them; the next forward waits on the scheduler's stream
(SGLang's ``forward_stream.wait_stream``), so it sees the frees.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.capacity import CapacityPlan
from sglang_diffkv.env_settings import log_interval
from sglang_diffkv.layout import fp16_bytes_per_token
from sglang_diffkv.memory import AllocResult
from sglang_diffkv.memory.free_bound import FreePagesBound
from sglang_diffkv.sglang.request_check import thresholds_or_abort
from sglang_diffkv.sglang.step_profile import StepProfiler, span
from sglang_diffkv.sglang.tp_agreement import FreePagesAgreement

logger = logging.getLogger("sglang_diffkv")



# SGLang's ReqToTokenPool never allocates request slot 0 (its CUDA-graph padding row)
PAD_REQ = 0


class DiffKVPoolError(RuntimeError):
    """The DiffKV pool cannot be built or used as asked."""


# ---- the three pool objects -------------------------------------------------------------


class DiffKVTokenToKVPool(KVCache):
    """Compressed pages behind logical slots. ``size`` is the logical slot count."""

    def __init__(
        self,
        cache: CompressedKVCache,
        plan: CapacityPlan,
        size: int,
        layer_num: int,
        device: str,
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> None:
        super().__init__(
            size, 1, torch.uint8, layer_num, device, False, start_layer, end_layer
        )
        self.cache = cache
        self.plan = plan
        self.num_pages = cache.spec.num_pages
        # Requests whose pages are allocated (begin_prefill happened, free not yet).
        self.active: set[int] = set()
        # Released requests whose pages go back at the next flush_frees (batched frees).
        self._pending_free: list[int] = []
        # Per-request thresholds set at ReqToTokenPool.alloc, consumed at begin_prefill.
        self.req_alpha: dict[int, tuple[float, float]] = {}
        # Chunked prefill: each slot's whole prompt (the tokens its prefill computes, as
        # admission counts them), set at ReqToTokenPool.alloc; and the tokens stored so far
        # of each prompt whose prefill is still in chunks.
        self.prompt_len: dict[int, int] = {}
        self.chunked: dict[int, int] = {}
        # Radix prefix sharing (``enable_radix``, by the DiffKV radix cache): the cache's
        # ``PromptSharing``, and each slot's tree hit (handle, cut), recorded when the slot
        # is allocated and attached at its first extend.
        self.radix = None
        self.hits: dict[int, tuple[Any, int]] = {}
        self.radix_counts = {"attached": 0, "attached_tokens": 0}
        # Tokens each request slot holds (prompt + decoded), for the metrics; on the device
        # so that decode steps set it without a sync.
        self.seq_lens_dev = torch.zeros(cache.spec.max_reqs, dtype=torch.int64,
                                        device=cache.device)
        self.stats = PoolStats(device)
        # the stream the backend's last forward ran on (CUDA only; see the module docstring)
        self._forward_stream: torch.cuda.Stream | None = None
        # Free pages as the scheduler sees them: a sync-free lower bound, exact near a full
        # pool (below 1/16 of the pages).
        self.free_bound = FreePagesBound(cache.manager.num_free_pages, cache.device,
                                         exact_below=self.num_pages // 16)
        # the last decode allocation's success flag, read one step later (no sync)
        self._decode_ok: tuple[torch.Tensor, torch.cuda.Event | None, AllocResult,
                               int] | None = None
        # TP > 1: the free-page count every rank's scheduler agrees on (tp_agreement);
        # None at TP 1, where free_pages() is this rank's own count
        self.agreement: FreePagesAgreement | None = None
        self._finalize_allocation_log(size)

    @property
    def pad_req(self) -> int:
        """The cache row CUDA-graph padding rows use: row 0, which SGLang's ReqToTokenPool
        keeps for padding and never allocates (its request slots are 1..size, ``cache_rows``),
        so its counters stay zero: attention over it reads nothing and the policy step skips
        it (its position is -1)."""
        return PAD_REQ

    # -- streams: the scheduler's work is ordered after the forward in flight ---------------

    def mark_forward_stream(self) -> None:
        """Called by the backend as a forward begins (on the forward's stream)."""
        if self.cache.device.type == "cuda":
            self._forward_stream = torch.cuda.current_stream(self.cache.device)

    def after_forward(self) -> None:
        """Order the current stream's next work after the last forward's (GPU-side)."""
        fs = self._forward_stream
        if fs is not None:
            cur = torch.cuda.current_stream(self.cache.device)
            if cur != fs:
                cur.wait_stream(fs)

    # -- physical accounting (host) --------------------------------------------------------

    def agree_across_ranks(self, group: Any) -> None:
        """TP > 1: from now on ``free_pages`` is the count every rank in ``group`` (the TP
        CPU group) agrees on (``tp_agreement``). Called once, while the pool is idle."""
        self.agreement = FreePagesAgreement(group, self.local_free_pages)
        self.agreement.check_same_pool(self.num_pages, self.size)

    def free_pages(self) -> int:
        """The free pages SGLang's scheduler decides with. Invariant: the same on every TP
        rank within a scheduler step, and at most this rank's own free pages. At TP 1 (and
        whenever no request holds pages, when every rank's pages are all free) it is
        ``local_free_pages``; otherwise the MIN over ranks (``tp_agreement``)."""
        if self.agreement is None or not self.active:
            return self.local_free_pages()
        return self.agreement.read()

    def local_free_pages(self) -> int:
        """This rank's free pages: a lower bound, exact when idle or near full
        (``FreePagesBound``): reading the exact count on the GPU would wait for the forward
        in flight every scheduler step."""
        self.flush_frees()
        self.after_forward()
        # idle: exact (one sync costs nothing then, and SGLang's idle leak check compares it
        # with the slot count)
        if not self.active:
            return self.free_bound.exact()
        # exact too when the bound leaves less than two decode steps of headroom: a stale
        # bound there would make SGLang retract (or abort) requests that fit
        return self.free_bound.read(2 * self.decode_reserve_pages(len(self.active)))

    def begin_decode(self, req: torch.Tensor, seq: torch.Tensor) -> None:
        """This step's decode room for ``req`` (one launch, no sync), whose sequences hold
        ``seq`` tokens after the step. Its success flag is checked at the next call
        (``check_last_decode``), by then long complete."""
        self.check_last_decode()
        self.seq_lens_dev[req] = seq
        res = self.cache.begin_decode(req)
        self.free_bound.taken(self.decode_reserve_pages(req.numel()))
        if self.cache.device.type != "cuda":
            self._decode_ok = (res.ok.view(1), None, res, req.numel())
            self.check_last_decode()  # (exact and free off the GPU: fail at once)
            return
        flag = torch.empty(1, dtype=torch.bool, pin_memory=True)
        flag.copy_(res.ok.view(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.cache.device))
        self._decode_ok = (flag, event, res, req.numel())

    def check_last_decode(self) -> None:
        """Raise if the previous decode allocation did not fit. The scheduler's memory check
        (``available_size``, a lower bound) guarantees it does, so this is a bug, not a
        load condition: say exactly what did not fit."""
        pending, self._decode_ok = self._decode_ok, None
        if pending is None:
            return
        flag, event, res, n = pending
        if event is not None:
            event.synchronize()
        if not bool(flag[0]):
            raise DiffKVPoolError(
                f"DiffKV decode step for {n} requests needed {int(res.needed)} pages but only "
                f"{int(res.free)} were free; check_decode_mem should have retracted"
            )

    def decode_reserve_pages(self, num_reqs: int) -> int:
        return self.cache.spec.pages_needed_for_decode(num_reqs)

    def physical_available_tokens(self) -> int:
        """Free pages minus the next decode step's worst case for the requests holding
        pages, in logical tokens at the planning density (``size`` when idle)."""
        spare = self.free_pages() - self.decode_reserve_pages(len(self.active))
        return max(0, spare) * self.size // self.num_pages

    def prefill_pages(self, prompt_len: int) -> int:
        return self.cache.spec.pages_needed_for_prefill([max(1, prompt_len)])

    def admits(self, pending_pages: int, pending_reqs: int) -> bool:
        """Whether a prefill taking ``pending_pages`` for ``pending_reqs`` new requests fits,
        leaving the next decode step's reserve for all of them and the running ones."""
        reserve = self.decode_reserve_pages(len(self.active) + pending_reqs)
        return self.free_pages() >= pending_pages + reserve

    def fits_empty_pool(self, prompt_len: int) -> bool:
        return self.prefill_pages(prompt_len) + self.decode_reserve_pages(1) <= self.num_pages

    # -- request lifecycle -----------------------------------------------------------------

    def set_request_thresholds(self, req_idx: int, alpha: tuple[float, float]) -> None:
        """The thresholds (alpha_h, alpha_l) of the request in slot ``req_idx``, validated
        by the caller (``request_check``)."""
        self.req_alpha[req_idx] = alpha

    def set_prompt_length(self, req_idx: int, length: int) -> None:
        """The whole prompt of the request in slot ``req_idx`` (``ReqToTokenPool.alloc``)."""
        self.prompt_len[req_idx] = length

    def enable_radix(self, cut_len: int) -> Any:
        """Radix prefix sharing on (the DiffKV radix cache's constructor): completed prompts
        are exported with their cuts, tree hits attached. On the Triton path an attached
        prefix is copied into the request's own pages (its decode kernels do not yet skip
        shared tokens); on the reference path its full pages are shared."""
        from sglang_diffkv.prompt_sharing import PromptSharing
        from sglang_diffkv.sglang.ops import want_kernels

        self.radix = PromptSharing(self.cache, cut_len,
                                   copy_attach=want_kernels(self.cache.device))
        self.cache.radix = self.radix
        return self.radix

    def set_prefix_hit(self, req_idx: int, handle: Any, cut: int) -> None:
        """The slot's request matched ``cut`` tokens of ``handle`` in the tree (locked there
        until the request is cached): its first extend attaches them."""
        self.hits[req_idx] = (handle, cut)

    def extend_pages(self, req: Any, extend: int) -> int:
        """Pages a new request's first extend takes (admission): its prompt's all-high pages,
        or with a tree hit the attach and its suffix's."""
        handle = getattr(getattr(req, "last_node", None), "diffkv_handle", None)
        cut = len(req.prefix_indices)
        if self.radix is not None and handle is not None and cut > 0:
            return self.radix.attach_pages(cut, max(extend, 1))
        return self.prefill_pages(extend)

    def exact_free_pages(self) -> int:
        """Free pages, read exactly (a sync on CUDA): after a tree eviction."""
        self.flush_frees()
        self.after_forward()
        return self.free_bound.exact()

    def _attach_hits(self, req_idx: list[int], prefix: list[int], totals: list[int]
                     ) -> set[int]:
        """Slots whose first extend continues a tree hit: attach it (and reserve the
        suffix); returns them."""
        done = set()
        # each attach's success flags, read once for the step (a read is a device sync)
        checks: list[tuple[int, int, int, torch.Tensor]] = []
        for r, p, total in zip(req_idx, prefix, totals, strict=True):
            hit = self.hits.pop(r, None)
            if hit is None or p == 0:
                continue
            handle, cut = hit
            if cut != p:
                raise DiffKVPoolError(f"DiffKV: request slot {r} matched {cut} tokens in the "
                                      f"radix tree but its extend starts at {p}")
            self.flush_frees()
            c = self.cache.config
            alpha = self.req_alpha.get(r, (c.alpha_h, c.alpha_l))
            res, room = self.radix.attach(r, handle, cut, total - cut, alpha)
            self.free_bound.taken(self.radix.attach_pages(cut, total - cut))
            checks.append((r, cut, total, res.ok.all() & room.ok.all()))
            self.active.add(r)
            self.radix_counts["attached"] += 1
            self.radix_counts["attached_tokens"] += cut
            done.add(r)
        if checks and not bool(torch.stack([ok for *_, ok in checks]).all()):
            r, cut, total, _ = next(x for x in checks if not bool(x[3]))
            raise DiffKVPoolError(
                f"DiffKV: attaching {cut} cached tokens and a {total - cut}-token suffix "
                f"to request slot {r} did not fit (admission counted them)")
        return done

    def _begin_exports(self, req_idx: list[int], prefix: list[int], lengths: list[int],
                       totals: list[int]) -> None:
        """The prompts this step completes are exported at its end (``PromptSharing``)."""
        done = [(r, t) for r, p, n, t in zip(req_idx, prefix, lengths, totals, strict=True)
                if p + n == t]
        keep = self.decode_reserve_pages(len(self.active))
        self.radix.begin_prompts([r for r, _ in done], [t for _, t in done], keep)
        self.free_bound.taken(self.cache.spec.pages_needed_for_prefill([t for _, t in done]))

    def begin_extend(self, req_idx: list[int], prefix: list[int], lengths: list[int]
                     ) -> list[int]:
        """An extend step's page work; returns each request's whole prompt length. A request
        with no stored prefix starts its prefill (``begin_prefill``): a whole prompt, or the
        first chunk of a longer one, which takes the all-high pages of the whole prompt now
        (exactly what admission reserved for it). A request with a prefix continues its
        chunks: it must hold exactly that many stored tokens and takes no pages."""
        totals = [max(self.prompt_len.get(r, p + n), p + n)
                  for r, p, n in zip(req_idx, prefix, lengths, strict=True)]
        attached = self._attach_hits(req_idx, prefix, totals) if self.hits else set()
        for r, p in zip(req_idx, prefix, strict=True):
            if p > 0 and self.chunked.get(r) != p and r not in attached:
                raise DiffKVPoolError(
                    f"DiffKV: an extend of request slot {r} continues a {p}-token prefix, but "
                    f"the slot holds {self.chunked.get(r, 0)} tokens of a chunked prompt: "
                    "diffkv has no prefix cache (--attention-backend diffkv keeps the radix "
                    "cache off), only chunked prefill continues a prompt")
        new = [b for b, p in enumerate(prefix) if p == 0]
        if new:
            self.begin_prefill([req_idx[b] for b in new], [lengths[b] for b in new],
                               [totals[b] for b in new])
        for r, p, n, total in zip(req_idx, prefix, lengths, totals, strict=True):
            if p + n < total:
                self.chunked[r] = p + n
            else:
                self.chunked.pop(r, None)
        self.seq_lens_dev[torch.as_tensor(req_idx, device=self.cache.device)] = torch.as_tensor(
            [p + n for p, n in zip(prefix, lengths, strict=True)], dtype=torch.int64,
            device=self.cache.device)
        if self.radix is not None:
            self._begin_exports(req_idx, prefix, lengths, totals)
        return totals

    def begin_prefill(self, req_idx: list[int], lengths: list[int],
                      reserve: list[int] | None = None) -> None:
        """``reserve[b]``: the whole prompt when ``lengths[b]`` is its first chunk."""
        self.flush_frees()  # a released slot may come back in this very batch
        c = self.cache.config
        alphas = [self.req_alpha.get(r, (c.alpha_h, c.alpha_l)) for r in req_idx]
        reserve = list(lengths) if reserve is None else reserve
        res = self.cache.begin_prefill(
            req_idx, lengths, [a[0] for a in alphas], [a[1] for a in alphas], reserve
        )
        self.free_bound.taken(self.cache.spec.pages_needed_for_prefill(reserve))
        if not bool(res.ok):
            # Admission (PrefillAdder hook) guarantees room, so this is a bug, not a load
            # condition: say exactly what did not fit.
            raise DiffKVPoolError(
                f"DiffKV prefill of {len(req_idx)} request(s), lengths {lengths} (whole "
                f"prompts {reserve}): needed {int(res.needed)} pages but only "
                f"{int(res.free)} are free (active requests {len(self.active)})"
            )
        self.active.update(req_idx)
        self.seq_lens_dev[torch.as_tensor(req_idx, device=self.cache.device)] = torch.as_tensor(
            lengths, dtype=torch.int64, device=self.cache.device)

    def release(self, req_idx: int) -> None:
        self.req_alpha.pop(req_idx, None)
        self.hits.pop(req_idx, None)
        self.prompt_len.pop(req_idx, None)
        self.chunked.pop(req_idx, None)  # (aborted or retracted between chunks)
        if req_idx not in self.active:
            return  # freed before its prefill ran (e.g. aborted while waiting)
        self.after_forward()  # its counters as the last forward left them
        if self.radix is not None:  # (an export the tree did not take goes back now)
            self.radix.release(req_idx)
        self.stats.record_finished(self.cache, req_idx, self.seq_lens_dev[req_idx])
        self.active.discard(req_idx)
        if self.agreement is not None:
            self.agreement.released()
        # SGLang frees finished requests one by one; one batched free_requests per step
        # costs the same ~10 launches for any count (sharegpt: 1.7-3.5 ms/step of single
        # frees on the H100). Pending pages go back before anything reads or takes pages.
        self._pending_free.append(req_idx)

    def flush_frees(self) -> None:
        """Return the pages of every request released since the last flush (one call)."""
        if self._pending_free:
            pending, self._pending_free = self._pending_free, []
            self._free(pending)

    def _free(self, req_idx: list[int]) -> None:
        self.after_forward()  # the forward in flight may still read these pages
        with span(self.stats.profiler, "free"):
            self.cache.free(req_idx)

    def release_all(self) -> None:
        self.flush_frees()
        if self.active:
            self._free(sorted(self.active))  # one batched free, as flush_frees does
        self.active.clear()
        self.req_alpha.clear()
        self.hits.clear()
        if self.radix is not None:
            for r in list(self.radix.exports) + list(self.radix.attached):
                self.radix.release(r)
        self.prompt_len.clear()
        self.chunked.clear()

    # -- KVCache interface -----------------------------------------------------------------

    def _no_dense_buffer(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"DiffKVTokenToKVPool.{what}: the diffkv pool stores compressed per-head pages, "
            "not a dense K/V buffer; only the diffkv attention backend can read or write it"
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise self._no_dense_buffer("get_key_buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise self._no_dense_buffer("get_value_buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_dense_buffer("get_kv_buffer")

    def set_kv_buffer(self, layer: Any, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        raise self._no_dense_buffer("set_kv_buffer")

    def get_kv_size_bytes(self) -> int:
        m = self.cache.manager
        state = [self.cache.pages, m.table, m.counts, m.free_pages, self.cache._prompt_kept]
        return sum(t.numel() * t.element_size() for t in state)


class DiffKVReqToTokenPool(ReqToTokenPool):
    """``ReqToTokenPool`` that tells the DiffKV pool when request slots come and go."""

    def __init__(self, kv_pool: DiffKVTokenToKVPool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kv_pool = kv_pool

    def alloc(self, reqs: list[Any]) -> list[int] | None:
        # thresholds first: an invalid request is aborted (never raised: the batch and the
        # scheduler carry on), before any slot is taken
        config = self.kv_pool.cache.config
        alphas = [thresholds_or_abort(r, config) for r in reqs]
        new = [r.req_pool_idx is None for r in reqs]
        out = super().alloc(reqs)
        if out is not None:
            for r, alpha in zip(reqs, alphas, strict=True):
                self.kv_pool.set_request_thresholds(r.req_pool_idx, alpha)
                # the whole prompt its prefill computes, however SGLang chunks it (a chunked
                # request keeps its slot and comes back here for every chunk)
                self.kv_pool.set_prompt_length(
                    r.req_pool_idx, len(getattr(r, "full_untruncated_fill_ids", ())))
            for r, fresh in zip(reqs, new, strict=True):
                handle = getattr(getattr(r, "last_node", None), "diffkv_handle", None)
                if fresh and handle is not None and len(r.prefix_indices) > 0:
                    self.kv_pool.set_prefix_hit(r.req_pool_idx, handle, len(r.prefix_indices))
        return out

    def free(self, req: Any) -> None:
        idx = req.req_pool_idx
        super().free(req)
        self.kv_pool.release(idx)

    def clear(self) -> None:
        super().clear()
        self.kv_pool.release_all()


class DiffKVTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """Exact logical slots (page_size 1) capped by the physical page term."""

    def __init__(self, size: int, dtype: torch.dtype, device: str,
                 kvcache: DiffKVTokenToKVPool) -> None:
        super().__init__(size, dtype, device, kvcache, need_sort=False)

    @property
    def diffkv_pool(self) -> DiffKVTokenToKVPool:
        return self._kvcache

    def logical_available_size(self) -> int:
        return super().available_size()

    def available_size(self) -> int:
        """``min(logical, physical)``; with no request holding pages, the logical count: the
        radix tree's pages are then the only ones held, and SGLang counts its slots as
        evictable (available + evictable == size at idle; admission evicts by pages)."""
        if not self._kvcache.active:
            self._kvcache.flush_frees()  # (the released requests' pages go back now)
            return self.logical_available_size()
        return min(self.logical_available_size(), self._kvcache.physical_available_tokens())

    def clear(self) -> None:
        super().clear()
        # __init__ calls clear() before anything was allocated; flush_cache calls it later.
        kv = getattr(self, "_kvcache", None)
        if isinstance(kv, DiffKVTokenToKVPool):
            kv.release_all()


# ---- metrics ------------------------------------------------------------------------------


class PoolStats:
    """Tier fractions over finished requests, per-step logging and, with
    ``SGLANG_DIFFKV_PROFILE=1``, the memory-management timing (``step_profile``)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.finished_count = torch.zeros((), dtype=torch.float64)  # on the cache's device
        self.finished_tokens = torch.zeros(3, dtype=torch.float64)  # high, low, pruned
        self.steps = 0
        self.log_interval = log_interval()
        self.profiler = StepProfiler.from_env(device)

    def record_finished(self, cache: CompressedKVCache, req_idx: int,
                        seq_len: torch.Tensor) -> None:
        """Adds a finished request's tier fractions (``seq_len``: 0-dim device tensor) on the
        device: a finishing request costs no host sync (the log line reads the sums)."""
        cnt = cache.counts[req_idx].to(torch.float64)  # [L, H, 4]
        n = seq_len.to(torch.float64)
        hi, lo = cnt[..., 0].mean() / n.clamp_min(1), cnt[..., 1].mean() / n.clamp_min(1)
        live = (n > 0).to(torch.float64)  # (a request released before any token: skipped)
        if self.finished_tokens.device != cnt.device:
            self.finished_tokens = self.finished_tokens.to(cnt.device)
            self.finished_count = self.finished_count.to(cnt.device)
        self.finished_tokens += torch.stack([hi, lo, 1.0 - hi - lo]) * live
        self.finished_count += live
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("DiffKV request slot %d finished at %d tokens: high %.1f%% / low "
                         "%.1f%%", req_idx, int(n), 100 * float(hi), 100 * float(lo))

    @property
    def finished_reqs(self) -> int:
        return int(self.finished_count)

    def finished_line(self) -> str:
        n = max(self.finished_reqs, 1)
        hi, lo, pr = (float(x) / n for x in self.finished_tokens)
        return (
            f"DiffKV finished requests: {self.finished_reqs}, mean tokens high {hi:.1%} / "
            f"low {lo:.1%} / pruned {pr:.1%}"
        )

    def step_line(self, pool: DiffKVTokenToKVPool, req_idx: torch.Tensor,
                  seq_lens: torch.Tensor, mode: str) -> str | None:
        """One log line every ``log_interval`` forward steps (0 turns it off), followed by
        the profile lines (one per forward mode) when profiling is on."""
        self.steps += 1
        if self.log_interval <= 0 or self.steps % self.log_interval:
            return None
        lines = [step_summary(pool, req_idx, seq_lens, mode)]
        if self.profiler is not None:
            lines += self.profiler.lines()
        return "\n".join(lines)


def step_summary(pool: DiffKVTokenToKVPool, req_idx: torch.Tensor, seq_lens: torch.Tensor,
                 mode: str) -> str:
    """Fractions of the batch's tokens kept high / low / pruned and pages in use."""
    frac = batch_tier_fractions(pool.cache, req_idx, seq_lens)
    used = pool.num_pages - pool.local_free_pages()  # this rank's own pages
    # what the active requests' tokens would take in a bf16 cache, in pages of this pool
    g = pool.plan.geometry
    held = torch.as_tensor(sorted(pool.active), dtype=torch.int64, device=pool.cache.device)
    tokens = int(pool.seq_lens_dev[held].sum())
    bf16_bytes = tokens * pool.plan.rows_per_request * fp16_bytes_per_token(g.head_dim)
    bf16_pages = bf16_bytes / g.page_bytes
    radix = ""
    if pool.radix is not None:
        n = pool.radix_counts
        radix = (f"; radix: {n['attached']} hits ({n['attached_tokens']} prompt tokens not "
                 f"recomputed), {len(pool.cache.manager.handles)} prompts held")
    return (
        f"DiffKV {mode}: batch {int(req_idx.numel())}, tokens high {frac[0]:.1%} / "
        f"low {frac[1]:.1%} / pruned {frac[2]:.1%}; pages in use {used}/{pool.num_pages} "
        f"({used / pool.num_pages:.1%}; a bf16 cache would need {bf16_pages:.0f}), "
        f"active requests {len(pool.active)} holding {tokens} tokens{radix}"
    )


def batch_tier_fractions(cache: CompressedKVCache, req_idx: torch.Tensor,
                         seq_lens: torch.Tensor) -> tuple[float, float, float]:
    """Token-weighted (high, low, pruned) fractions over every (request, layer, head) row."""
    if req_idx.numel() == 0:
        return (0.0, 0.0, 0.0)
    frac = cache.tier_fractions(req_idx, seq_lens)  # [B, L, H, 3]
    weight = seq_lens.to(frac.device, torch.float64).view(-1, 1, 1, 1)
    total = (frac * weight).sum(dim=(0, 1, 2)) / (weight.sum() * frac.shape[1] * frac.shape[2])
    hi, lo, pr = (float(x) for x in total)
    return hi, lo, pr
