"""``--radix-cache-backend diffkv``: SGLang's radix tree over DiffKV's compressed pages.

Registered through SGLang's tree-cache registry (``mem_cache.registry``; ``plugin.register``)
and selected by the ``ServerArgs`` hook (``args.apply_radix_setting``). ``DiffKVRadixCache``
is SGLang's own ``RadixCache``: its nodes hold logical token slots (handles, as the pool's
slots always are) and, beside them, a ``memory.SharedPrefix`` that holds the compressed pages
of the node's tokens, frozen.

- What enters the tree: prompts only. At the end of a prompt's prefill (its last chunk) the
  backend exports it (``prompt_sharing``: a copy of the row's private pages plus the tokens
  of each tier before every cut of ``cut_len`` tokens); ``cache_unfinished_req`` right after
  the prefill (or ``cache_finished_req`` if the request ended there) inserts its first
  ``floor(L / cut_len) * cut_len`` tokens with that handle. A node split keeps its handle on
  both halves (a handle covers every position of its prompt), so every node's handle covers
  the whole path from the root to it. Decode tokens never enter the tree; chunks before a
  prompt's last are not inserted (``cache_unfinished_req(chunked=True)`` keeps the request's
  own slots, as SGLang's ``ChunkCache`` does).
- ``match_prefix`` returns the longest match rounded down to a multiple of ``cut_len``; the
  pool attaches the matched node's handle at that cut when the request gets its slot, and
  its prompt suffix runs as an extend over the attached prefix.
- Thresholds: a request whose ``diffkv_alpha_h`` / ``diffkv_alpha_l`` differ from the
  config's gets them appended to its ``extra_key`` (SGLang's cache namespace) the first
  time the tree sees it, so it only ever shares with requests compressed under the same
  rules.
- Eviction releases a handle once no node holds it (``PageManager.release_prefix``: pages
  nobody holds go back). ``evict`` evicts until the allocator's ``available_size`` (which
  counts physical pages) has grown by what SGLang asked for; ``evict_pages`` until a number
  of pages is free (exact admission).
- Accounting: the tree's slots are SGLang's usual ``evictable_size`` / ``protected_size``
  (logical tokens); its pages are not free pages. With no request holding pages the
  allocator's ``available_size`` is the logical free count, so SGLang's idle check
  (available + evictable + protected == total) holds exactly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_diffkv.memory import SharedPrefix
from sglang_diffkv.request_params import RequestParamError, thresholds_for_request

logger = logging.getLogger("sglang_diffkv")

BACKEND_NAME = "diffkv"
# the radix key's alignment (tokens): a hit is the longest match rounded down to it
DEFAULT_CUT_LEN = 64
CUT_LEN_ENV = "SGLANG_DIFFKV_RADIX_CUT"


def cut_len_from_env() -> int:
    import os

    raw = os.environ.get(CUT_LEN_ENV, "").strip()
    if not raw:
        return DEFAULT_CUT_LEN
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{CUT_LEN_ENV}={raw!r}: a positive number of tokens")
    return value


def create_tree_cache(ctx: Any) -> Any:
    """SGLang's ``RadixCacheFactory`` for ``--radix-cache-backend diffkv``. With the radix
    cache disabled it builds what SGLang builds without a registered backend (stage 1's
    ChunkCache)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    if ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)
    alloc = ctx.params.token_to_kv_pool_allocator
    pool = getattr(alloc, "diffkv_pool", None)
    if pool is None:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} needs --attention-backend diffkv (its "
            f"pool holds compressed pages); got the {type(alloc).__name__} allocator")
    return DiffKVRadixCache(ctx.params, pool, cut_len_from_env())


class DiffKVRadixCache(RadixCache):
    def __init__(self, params: Any, pool: Any, cut_len: int) -> None:
        self.pool = None  # (RadixCache.__init__ calls reset())
        self.handle_nodes: dict[int, set[TreeNode]] = {}  # handle key -> nodes holding it
        self._shrink: set[int] = set()  # handles that lost a node but not their last
        self._released: list[SharedPrefix] = []
        # prompts inserted; their handles released (evicted, or the tree flushed) or
        # truncated (their deeper nodes evicted)
        self.stats = {"inserted": 0, "released": 0, "truncated": 0}
        super().__init__(params)
        self.pool = pool
        self.cut_len = cut_len
        self.sharing = pool.enable_radix(cut_len)
        self.config = pool.cache.config
        logger.info(
            "DiffKV radix cache: prompts shared as compressed pages, cut every %d tokens "
            "(%s=%s); %s", cut_len, CUT_LEN_ENV, cut_len,
            "attached prefixes are copied into each request's pages (the Triton decode "
            "kernels do not yet skip shared tokens)" if self.sharing.copy_attach else
            "attached prefixes' full pages are shared read-only")

    # ---- handles on nodes ------------------------------------------------------------------

    @staticmethod
    def handle_of(node: TreeNode) -> SharedPrefix | None:
        return getattr(node, "diffkv_handle", None)

    def _hold(self, node: TreeNode, handle: SharedPrefix) -> None:
        node.diffkv_handle = handle
        self.handle_nodes.setdefault(handle.key, set()).add(node)

    def _let_go(self, node: TreeNode) -> None:
        handle = self.handle_of(node)
        if handle is None:
            return
        node.diffkv_handle = None
        held = self.handle_nodes[handle.key]
        held.discard(node)
        if held:
            self._shrink.add(handle.key)
        else:
            del self.handle_nodes[handle.key]
            self._shrink.discard(handle.key)
            self._released.append(handle)
            self.stats["released"] += 1

    @staticmethod
    def _end(node: TreeNode) -> int:
        """The prompt position a node's tokens end at."""
        end = 0
        while node.parent is not None:
            end += len(node.key)
            node = node.parent
        return end

    def _shrink_handles(self) -> None:
        """Handles whose deeper nodes were evicted: truncated to the first cut at or after
        the end of the deepest node still holding them (``PageManager.truncate_prefix``), so
        the evicted part's pages go back."""
        for key in sorted(self._shrink):
            nodes = self.handle_nodes.get(key)
            if not nodes:
                continue
            handle = self.handle_of(next(iter(nodes)))
            keep = max(self._end(n) for n in nodes)
            keep = -(-keep // self.cut_len) * self.cut_len
            if keep >= handle.num_tokens // self.cut_len * self.cut_len:
                continue
            self.pool.after_forward()
            short = self.pool.cache.manager.truncate_prefix(handle, keep)
            for n in nodes:
                n.diffkv_handle = short
            self.stats["truncated"] += 1
        self._shrink.clear()

    def _flush_released(self) -> None:
        if self._shrink and self.pool is not None:
            self._shrink_handles()
        if self._released and self.pool is not None:
            gone, self._released = self._released, []
            self.pool.after_forward()  # (ordered after the forward in flight, as frees are)
            self.pool.cache.release_prefix(gone)

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(key, child, split_len)
        handle = self.handle_of(child)
        if handle is not None:  # the handle covers both halves
            self._hold(new_node, handle)
        return new_node

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        self._let_go(node)

    def reset(self) -> None:
        stack = [getattr(self, "root_node", None)]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            self._let_go(node)
            stack.extend(node.children.values())
        super().reset()
        self._flush_released()

    # ---- match -----------------------------------------------------------------------------

    def _namespace(self, req: Any) -> None:
        """Append the request's own thresholds to its ``extra_key`` (once)."""
        if getattr(req, "_diffkv_namespaced", False):
            return
        req._diffkv_namespaced = True
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        try:
            alpha = thresholds_for_request(params, self.config)
        except RequestParamError:
            return  # (the pool aborts it when it takes a slot)
        if alpha != (self.config.alpha_h, self.config.alpha_l):
            tag = f"diffkv_alpha={alpha[0]!r},{alpha[1]!r}"
            req.extra_key = tag if not req.extra_key else f"{req.extra_key}|{tag}"

    def _match_len(self, key: RadixKey) -> int:
        """The matched length of ``key``, without splitting any node."""
        node, total = self.root_node, 0
        while len(key) > 0:
            child = node.children.get(key.child_key(1))
            if child is None:
                break
            n = child.key.match(key)
            total += n
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return total

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        key = params.key
        if req is not None:
            self._namespace(req)
            if key.extra_key != req.extra_key:
                key = RadixKey(key.token_ids, req.extra_key, key.is_bigram, key.limit)
        if self.disable or len(key) < self.cut_len:
            return self._empty_match_result
        aligned = len(key) // self.cut_len * self.cut_len
        m = self._match_len(key[:aligned]) // self.cut_len * self.cut_len
        if m == 0:
            return self._empty_match_result
        value, node = self._match_prefix_helper(self.root_node, key[:m])
        return MatchResult(device_indices=torch.cat(value), last_device_node=node,
                           last_host_node=node, best_match_node=node)

    # ---- insert ----------------------------------------------------------------------------

    def _insert_prompt(self, req: Any) -> None:
        """Insert the request's exported prompt (if the export exists and fit): its first
        floor(L / cut_len) * cut_len tokens, the nodes it creates holding the handle. The
        request's slots the tree now has are freed and it points at the tree's; it keeps a
        lock on its last node (SGLang's cache_unfinished_req)."""
        handle = self.sharing.take_export(req.req_pool_idx)
        if handle is None:
            return
        aligned = handle.num_tokens // self.cut_len * self.cut_len
        if self.disable or aligned <= req.cache_protected_len:
            self._released.append(handle)  # (nothing new to share)
            self._flush_released()
            return
        token_ids = (req.origin_input_ids + req.output_ids)[:aligned]
        key = RadixKey(token_ids, req.extra_key)
        rows = self.req_to_token_pool.req_to_token
        kv = rows[req.req_pool_idx, :aligned].to(dtype=torch.int64, copy=True)
        result = self.insert(InsertParams(key=key, value=kv,
                                          priority=getattr(req, "priority", 0) or 0))
        node = result.last_device_node
        held = False
        while node is not self.root_node and self.handle_of(node) is None:
            self._hold(node, handle)
            held = True
            node = node.parent
        if not held:  # (every position was in the tree already)
            self._released.append(handle)
            self._flush_released()
        else:
            self.stats["inserted"] += 1
        # the request's own slots for tokens the tree already had are duplicates
        protected = req.cache_protected_len
        self.token_to_kv_pool_allocator.free(kv[protected:result.prefix_len])
        value, last = self._match_prefix_helper(self.root_node, key)
        tree_kv = torch.cat(value)
        self.req_to_token_pool.write((req.req_pool_idx, slice(protected, aligned)),
                                     tree_kv[protected:].to(rows.dtype))
        req.cache_protected_len = aligned
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(last)
        req.last_node = last
        rest = rows[req.req_pool_idx, aligned:handle.num_tokens].to(torch.int64)
        req.prefix_indices = torch.cat([tree_kv, rest])

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """Between chunks: the request keeps its own slots (nothing enters the tree before
        the prompt is whole). Right after its prefill: its prompt enters the tree."""
        if chunked:
            kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :req.extend_range.end]
            req.prefix_indices = kv.to(dtype=torch.int64, copy=True)
            return
        self._insert_prompt(req)

    def cache_finished_req(self, req: Any, is_insert: bool = True, *,
                           kv_len_to_handle: int) -> None:
        """The prompt enters the tree if it has not yet (a request that ended at its
        prefill); every slot the tree does not hold is freed; the lock is released."""
        if self.disable_finished_insert:
            is_insert = False
        if is_insert:
            self._insert_prompt(req)
        # (an export never inserted is released with the request's pages: pool.release)
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len_to_handle]
        self.token_to_kv_pool_allocator.free(kv[req.cache_protected_len:])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    # ---- eviction ---------------------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """Evict least recently used leaves until the allocator's ``available_size`` (its
        physical term included) has grown by ``params.num_tokens``, or nothing is left."""
        if self.disable:
            return EvictResult()
        start = time.perf_counter()
        target = self._available_exact() + params.num_tokens
        evicted = 0
        while self.evictable_leaves and self._available_exact() < target:
            evicted += self._evict_one()
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def evict_pages(self, pages: int) -> int:
        """Evict least recently used leaves until ``pages`` pages are free (exact) or
        nothing is evictable; returns the logical tokens evicted."""
        evicted = 0
        while self.evictable_leaves and self.pool.exact_free_pages() < pages:
            evicted += self._evict_one()
        return evicted

    def _evict_one(self) -> int:
        """The least recently used evictable leaf: its slots freed, its handle released if
        no other node holds it."""
        leaf = min(self.evictable_leaves,
                   key=lambda n: self.eviction_strategy.get_priority(n))
        self.token_to_kv_pool_allocator.free_segment(leaf.value, start_pos=0)
        n = len(leaf.value)
        self._delete_leaf(leaf)
        self._record_remove_event(leaf)
        self._flush_released()
        return n

    def _available_exact(self) -> int:
        self.pool.exact_free_pages()  # (after releases the bound would not see them yet)
        return self.token_to_kv_pool_allocator.available_size()
