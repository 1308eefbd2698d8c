"""KV pool accounting: how many units a request holds and how many a step may need.

This is the one place where DiffKV's page accounting lives. Units are tokens for the token
pool (bf16, fp8, uniform tiers) and pages for the DiffKV pool. The scheduler only ever asks:

  prompt_units(stored, extend)   units a prefill chunk of ``extend`` tokens adds to a request
                                 that already stored ``stored`` prompt tokens
  decode_units(kv, prof)         units held after prefill with ``kv`` tokens (vectorised)
  future_units(tokens)           the admission reservation for ``tokens`` future decode tokens
  decode_step_need(kv)           worst-case units the next decode step may allocate, for
                                 requests holding ``kv`` tokens before the step
  read_bytes_per_layer(kv, prof) attention bytes a decode step reads per layer (cost model)

DiffKV rules (invariants):
  * a unified page holds N_high high-tier or N_low low-tier tokens of one (layer, KV head);
    each (request, layer, head, tier) rounds up to whole pages;
  * during prefill every prompt token is stored high (worst case ceil(L / N_high) pages per
    head); when the prompt completes the request is compressed and pages are reclaimed;
  * the ``window`` most recent tokens stay high; the rest follow the request's tier mix;
  * one decode step adds at most one token to each tier of each head, so it needs at most one
    new page per (layer, head, tier): the decode reserve is that worst case.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from sglang_diffkv.layout import PageGeometry
from simulator.errors import SimulatorInputError
from simulator.kv.mix import TierMix

# numpy sums a row of up to its buffer size (8,192 elements) in one pairwise pass, as it
# sums a 1-D array; ``DiffKVPool.decode_sums`` sums rows only that long
ROW_SUM_MAX = 8192


class KVPool(ABC):
    capacity: int            # units
    unit: str                # "tokens" or "pages"

    @property
    @abstractmethod
    def token_capacity(self) -> int:
        """Tokens the pool holds (for DiffKV at the mean mix, long contexts): what SGLang
        would log as max_total_num_tokens."""

    @abstractmethod
    def request_profile(self, rng: np.random.Generator) -> np.ndarray | None: ...

    @abstractmethod
    def prompt_units(self, stored: int, extend: int) -> int: ...

    @abstractmethod
    def decode_units(self, kv: np.ndarray, prof: np.ndarray | None) -> np.ndarray: ...

    @abstractmethod
    def future_units(self, tokens: float) -> float: ...

    @abstractmethod
    def decode_step_need(self, kv: np.ndarray) -> int: ...

    @abstractmethod
    def read_bytes_per_layer(self, kv: np.ndarray, prof: np.ndarray | None) -> float: ...

    def decode_state(self, kv: np.ndarray, prof: np.ndarray | None) -> tuple[np.ndarray, float]:
        """(decode_units(kv, prof), read_bytes_per_layer(kv, prof)) in one pass."""
        return self.decode_units(kv, prof), self.read_bytes_per_layer(kv, prof)

    @property
    @abstractmethod
    def write_bytes_per_token_layer(self) -> float: ...

    def decode_step_need_of(self, reqs: int) -> int | None:
        """``decode_step_need`` of any ``reqs`` requests where it depends on their number
        alone, else None (it depends on their lengths)."""
        return None

    def decode_sums(self, kv: np.ndarray, offsets: Iterable[int],
                    prof: np.ndarray | None) -> list[tuple[int, float]]:
        """For each offset o: (units held in all, attention bytes per layer) of requests
        holding ``kv + o`` tokens, each exactly as ``decode_state(kv + o, prof)`` sums them
        (the engine plans runs of decode steps with them)."""
        out = []
        for o in offsets:
            held, read = self.decode_state(kv + o, prof)
            out.append((int(held.sum()), read))
        return out

    def compression_pairs(self, prompt_tokens: int) -> float:
        """Extra query-key pairs (per query head and layer) a finished prompt costs before
        decoding: 0, except for DiffKV's significance scoring."""
        return 0.0

    def logged_tokens(self, kv: np.ndarray) -> float:
        """What SGLang's Decode line logs as ``#token`` while requests hold ``kv`` tokens:
        the units they hold (a token pool: its slots)."""
        return float(self.decode_units(kv, None).sum())

    def context_from_logged(self, reqs: int, logged: float) -> int:
        """The KV tokens per request, alike, of ``reqs`` requests for which SGLang logs
        ``logged`` as ``#token`` (``logged_tokens``' inverse; at least 1)."""
        if reqs < 1:
            raise SimulatorInputError(f"reqs={reqs}: a Decode line's batch holds >= 1 request")
        lo, hi = 1, max(1, int(logged // reqs))   # logged_tokens never undercounts the tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.logged_tokens(np.full(reqs, mid, dtype=np.int64)) <= logged:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass
class TokenPool(KVPool):
    """SGLang's token pool: ``capacity`` token slots in pages of ``page_size`` tokens."""

    capacity: int
    page_size: int
    read_bytes_per_token_layer: float
    unit: str = field(default="tokens")

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise SimulatorInputError(
                f"the KV pool has {self.capacity} tokens: the model does not leave room for a "
                "KV cache on this GPU; use a bigger GPU, more tensor parallelism or another format"
            )

    @property
    def token_capacity(self) -> int:
        return self.capacity

    def request_profile(self, rng: np.random.Generator) -> None:
        return None

    def _paged(self, tokens: int) -> int:
        p = self.page_size
        return -(-tokens // p) * p

    def prompt_units(self, stored: int, extend: int) -> int:
        return self._paged(stored + extend) - self._paged(stored)

    def decode_units(self, kv: np.ndarray, prof: np.ndarray | None) -> np.ndarray:
        p = self.page_size
        return kv if p == 1 else -(-kv // p) * p

    def future_units(self, tokens: float) -> float:
        return tokens

    def decode_step_need(self, kv: np.ndarray) -> int:
        if self.page_size == 1:
            return int(kv.size)
        return int(np.count_nonzero(kv % self.page_size == 0)) * self.page_size

    def decode_step_need_of(self, reqs: int) -> int | None:
        return reqs if self.page_size == 1 else None

    def read_bytes_per_layer(self, kv: np.ndarray, prof: np.ndarray | None) -> float:
        return float(kv.sum()) * self.read_bytes_per_token_layer

    def read_bytes_for_tokens(self, total_kv: int) -> float:
        """The same for a known token total (token pools are linear in tokens)."""
        return total_kv * self.read_bytes_per_token_layer

    @property
    def write_bytes_per_token_layer(self) -> float:
        return self.read_bytes_per_token_layer


@dataclass
class DiffKVPool(KVPool):
    """A pool of unified pages shared by all layers and heads of this rank."""

    capacity: int                   # pages
    geometry: PageGeometry
    window: int
    mix: TierMix
    layers: int
    heads_per_rank: int
    score_queries: int = 0          # prompt queries that score every prompt token
    unit: str = field(default="pages")

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise SimulatorInputError(
                "the DiffKV pool has no pages: the model does not leave room for a KV cache"
            )
        self.n_high = self.geometry.high.tokens_per_page
        self.n_low = self.geometry.low.tokens_per_page
        self.head_count = self.layers * self.heads_per_rank      # (layer, head) pairs
        base = self.mix.class_fractions()
        self.classes = base.shape[1]
        # (layer, head) pairs per class: equal shares, fractional when the classes do not
        # divide the heads (e.g. measured heads of all ranks against one rank's heads);
        # page totals are rounded to whole pages
        self.class_counts = np.full(self.classes, self.head_count / self.classes)
        self._mean_prof = base
        # the decode reserve: one page per (layer, head) for the high tier, and one for the
        # low tier when the mix stores anything low
        self._tiers_growing = 1 + int(self.mix.low > 0)
        self._high_bpt = self.geometry.high.bytes_per_token
        self._low_bpt = self.geometry.low.bytes_per_token
        h, low = self._mean_prof
        self._pages_per_token = float((self.class_counts * (h / self.n_high
                                                            + low / self.n_low)).sum())
        # shared-mix lookup tables indexed by KV length: pages held and bytes read per layer;
        # grown lazily, a pure cache (results never depend on how far it has grown)
        self._pages_tab = np.zeros(0, dtype=np.int64)
        self._read_tab = np.zeros(0, dtype=np.float64)

    def compression_pairs(self, prompt_tokens: int) -> float:
        """DiffKV scores each prompt token with the last ``score_queries`` queries (an extra
        attention of score_queries x prompt pairs) before classifying it."""
        return float(min(self.score_queries, prompt_tokens) * prompt_tokens)

    @property
    def pages_per_token(self) -> float:
        """Mean pages one long-context token costs at the mean mix, over all heads."""
        return self._pages_per_token

    @property
    def token_capacity(self) -> int:
        return int(self.capacity / self.pages_per_token)

    def request_profile(self, rng: np.random.Generator) -> np.ndarray | None:
        """None when every request shares the mean mix (the fast path below)."""
        if self.mix.request_spread == 0:
            return None
        return self.mix.request_fractions(rng)

    def prompt_units(self, stored: int, extend: int) -> int:
        # all-high worst case while the prompt is being prefilled
        n = self.n_high
        return int(self.head_count * (-(-(stored + extend) // n) - (-(-stored // n))))

    def _tier_tokens(self, kv: np.ndarray, prof: np.ndarray | None) -> tuple[np.ndarray,
                                                                             np.ndarray]:
        """High and low tokens per (request, class): shapes (B, K)."""
        p = self._mean_prof[None] if prof is None else prof
        kv = np.asarray(kv)[:, None]
        recent = np.minimum(kv, self.window)
        old = kv - recent
        high = recent + np.floor(p[:, 0] * old)
        low = np.floor(p[:, 1] * old)
        return high, low

    def decode_units(self, kv: np.ndarray, prof: np.ndarray | None) -> np.ndarray:
        if prof is None:              # the shared mix's table, without decode_state's bytes
            try:
                return self._pages_tab[kv]
            except IndexError:
                self._grow_tables(int(kv.max()))
                return self._pages_tab[kv]
        return self.decode_state(kv, prof)[0]

    def _grow_tables(self, max_kv: int) -> None:
        """Tabulate the shared-mix page count and bytes read for every KV length <= max_kv
        (doubling, so a run builds them O(log context) times)."""
        n = max(2 * len(self._pages_tab), max_kv + 1, 4096)
        kv = np.arange(n)[:, None]
        high, low = self._tier_tokens(kv[:, 0], None)
        pages = np.ceil(high / self.n_high) + np.ceil(low / self.n_low)
        self._pages_tab = np.rint(pages @ self.class_counts).astype(np.int64)
        self._read_tab = ((high * self._high_bpt + low * self._low_bpt) @ self.class_counts
                          / self.layers)

    def decode_state(self, kv: np.ndarray, prof: np.ndarray | None) -> tuple[np.ndarray, float]:
        if prof is None:
            try:      # a length past the tables is rare: look up first, grow on a miss
                pages = self._pages_tab[kv]
            except IndexError:
                self._grow_tables(int(kv.max()))
                pages = self._pages_tab[kv]
            return pages, float(self._read_tab[kv].sum())
        high, low = self._tier_tokens(kv, prof)
        pages = np.ceil(high / self.n_high) + np.ceil(low / self.n_low)
        per_class = high * self._high_bpt + low * self._low_bpt
        read = float((per_class @ self.class_counts).sum()) / self.layers
        return np.rint(pages @ self.class_counts).astype(np.int64), read

    def future_units(self, tokens: float) -> float:
        return tokens * self.pages_per_token

    def decode_step_need(self, kv: np.ndarray) -> int:
        return int(kv.size) * self.head_count * self._tiers_growing

    def decode_step_need_of(self, reqs: int) -> int | None:
        return reqs * self.head_count * self._tiers_growing

    def decode_sums(self, kv: np.ndarray, offsets: Iterable[int],
                    prof: np.ndarray | None) -> list[tuple[int, float]]:
        offsets = list(offsets)
        if prof is not None or not kv.size or kv.size > ROW_SUM_MAX:
            return super().decode_sums(kv, offsets, prof)
        # the shared mix: one lookup of every (offset, request), summed along each row; a
        # row's sum along the contiguous axis is the same pairwise sum as the 1-D one that
        # decode_state takes, to the last bit
        lengths = kv[None, :] + np.asarray(offsets, dtype=np.int64)[:, None]
        try:
            pages = self._pages_tab[lengths]
        except IndexError:
            self._grow_tables(int(lengths.max()))
            pages = self._pages_tab[lengths]
        held = pages.sum(axis=1).tolist()
        read = self._read_tab[lengths].sum(axis=1).tolist()
        return list(zip(held, read, strict=True))

    def logged_tokens(self, kv: np.ndarray) -> float:
        """sglang_diffkv's SGLang pool counts as used the pages held plus the next decode
        step's reserve, at the planning density (``physical_available_tokens``): a short
        request's page rounding and reserve make ``#token`` overstate its context (H200
        ladder at 23 req/s: about 850 logged per request, 560 tokens of context)."""
        return (float(self.decode_units(kv, None).sum()) + self.decode_step_need(kv)) \
            / self.pages_per_token

    def read_bytes_per_layer(self, kv: np.ndarray, prof: np.ndarray | None) -> float:
        return self.decode_state(kv, prof)[1]

    @property
    def write_bytes_per_token_layer(self) -> float:
        return self.heads_per_rank * self._high_bpt
