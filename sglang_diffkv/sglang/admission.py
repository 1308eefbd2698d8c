"""Exact physical admission (hook on SGLang's ``PrefillAdder.add_one_req``).

SGLang's prefill budget counts logical slots and cannot see DiffKV's per-request page
rounding. A prompt joins a prefill batch only if its all-high pages, plus the next decode
step's reserve for every request (running and admitted), fit in the free pages; otherwise the
adder answers ``NO_TOKEN`` and the request waits, as it would for a full bf16 cache.

With chunked prefill the hook sees a prompt once, when SGLang admits its first chunk
(``add_one_req``; later chunks come through ``add_chunked_req``, which it never sees), and
reserves the whole prompt: the first chunk's extend takes exactly those all-high pages
(``DiffKVTokenToKVPool.begin_extend``), later chunks take none, so the rule stays exact.

With the DiffKV radix cache a request that hit the tree needs the attach's pages and its
suffix's all-high pages instead (``extend_pages``), and when pages are short the tree's least
recently used nodes are evicted first (``evict_for``): SGLang's own eviction only ever looks
at logical slots.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("sglang_diffkv")


def extend_len(req: Any) -> int:
    """Tokens this request's next extend computes (its prompt, plus its output after a
    retraction, less any cached prefix), as ``PrefillAdder.add_one_req`` counts them.
    ``prefix_indices`` is a tensor (set by ``init_next_round_input``): no truth test on it."""
    return max(len(req.full_untruncated_fill_ids) - len(req.prefix_indices), 0)


def evict_for(tree: Any, kv: Any, req: Any, pages: int, reqs: int) -> None:
    """With the DiffKV radix cache: evict least recently used tree nodes until ``pages``
    plus the decode reserve of the running and ``reqs`` admitted requests are free (the
    tree's pages are not free pages; SGLang only evicts for logical slots). The request's
    own match stays locked meanwhile."""
    evict_pages = getattr(tree, "evict_pages", None)
    if evict_pages is None:
        return
    node = getattr(req, "last_node", None)
    if node is not None:
        tree.inc_lock_ref(node)
    try:
        evict_pages(pages + kv.decode_reserve_pages(len(kv.active) + reqs))
    finally:
        if node is not None:
            tree.dec_lock_ref(node)


def add_one_req_hook(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    kv = getattr(adder.token_to_kv_pool_allocator, "diffkv_pool", None)
    if kv is None:  # another backend's allocator: SGLang's own rule
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    pages, reqs = getattr(adder, "_diffkv_pending", (0, 0))
    prompt = extend_len(req)
    need = kv.extend_pages(req, prompt)
    if not kv.admits(pages + need, reqs + 1):
        evict_for(adder.tree_cache, kv, req, pages + need, reqs + 1)
    if not kv.admits(pages + need, reqs + 1):
        if not kv.fits_empty_pool(prompt):
            logger.error("DiffKV: a %d-token prompt can never fit in %d pages (rid %s)",
                         prompt, kv.num_pages, getattr(req, "rid", "?"))
        return AddReqResult.NO_TOKEN
    before = len(adder.can_run_list)
    result = original(adder, req, *args, **kwargs)
    if len(adder.can_run_list) > before:
        adder._diffkv_pending = (pages + need, reqs + 1)
    return result
