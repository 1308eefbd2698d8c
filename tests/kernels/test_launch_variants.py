"""Compiled variants of the prefill / extend step's Triton kernels stay few, whatever the batch.

Triton compiles a kernel once per distinct specialisation key: the constexpr values, and for
the other arguments their type, whether an int is 1 or a multiple of 16 and whether a
pointer is 16-byte aligned (unless the kernel opts out). A key first seen while serving
stalls that prefill step for the compile (seconds on an H200), so a constexpr that follows
the batch (a request count, a max length) must be bucketed into a small fixed set.

The test replaces every Triton kernel of ``sglang_diffkv.kernels`` with a recorder (nothing
runs) and drives the serving path itself (``DiffKVOps.begin_prefill_step`` then
``extend_layer`` on two layers, the chunked and the whole-prompt paths) over hundreds of
random steps up to serving sizes; each launch's key is what Triton's own specialisation
computes from the arguments the launch sites pass. A launch site that picks a constexpr
from the batch, or passes a batch-dependent int or misaligned pointer Triton specialises,
shows up as more keys than the bound.

``variants.extend_launch`` (the one place a constexpr is picked from the batch) is checked
alone over thousands of random shapes, and ``sglang.ops.upload`` (the step's index tensors)
for 16-byte aligned columns.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import sglang_diffkv.kernels as kernels_pkg
from sglang_diffkv.cache import CompressedKVCache, ExtendRequests
from sglang_diffkv.config import DiffKVConfig
from sglang_diffkv.kernels import variants
from sglang_diffkv.prompt_attention import PromptAttention
from sglang_diffkv.sglang.ops import DiffKVOps, upload

# serving sizes: SGLang's chunked-prefill budget per step and its running-request cap
MAX_STEP_TOKENS = 8192
MAX_REQS = 512
MAX_CONTEXT = 32768
STEPS = 200
SMS = 132  # an H100's / H200's: the split count's range at serving sizes
# distinct compile keys per kernel over every step of one server (one model shape, one
# dtype, one config): what the bucketing promises
MAX_VARIANTS = 8
# extend attention's: (3 tile shapes at the default 64-row tile) x (split or not); its merge
# pass runs split launches only
EXTEND_VARIANTS, MERGE_VARIANTS = 6, 3

# a Llama-3-8B-shaped GQA group (4) and head_dim at two KV heads (the head count is not a
# specialisation, only a grid size)
HKV, GROUP, D, LAYERS = 2, 4, 128, 2


def _specialise(value: Any, specialize: bool, align: bool) -> Any:
    """Triton's specialisation of one non-constexpr argument (its type, and whether an int
    is 1 / a multiple of 16 or a pointer 16-byte aligned)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    return native_specialize_impl(BaseBackend, value, False, specialize, align)


class Recorder:
    """Stands in for one Triton kernel: ``kernel[grid](*args, **kwargs)`` records the
    specialisation key Triton would compile for (launch options included), and each
    runtime int argument's values, and runs nothing."""

    def __init__(self, kernel: Any, keys: dict[str, set],
                 ints: dict[str, dict[str, set]]) -> None:
        self.fn = kernel.fn
        self.name = f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"
        self.sig = inspect.signature(self.fn)
        self.constexpr = {n for n, p in self.sig.parameters.items()
                          if "constexpr" in str(p.annotation)}
        names = list(self.sig.parameters)
        if hasattr(kernel, "params"):  # a JITFunction
            self.dns = {p.name for p in kernel.params if p.do_not_specialize}
            self.dnsoa = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        else:  # the interpreter's stand-in keeps the decorator's arguments
            opts = kernel.kwargs
            self.dns = {names[x] if isinstance(x, int) else x
                        for x in opts.get("do_not_specialize") or ()}
            self.dnsoa = {names[x] if isinstance(x, int) else x
                          for x in opts.get("do_not_specialize_on_alignment") or ()}
        self.keys = keys
        self.ints = ints

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self._launch

    def _launch(self, *args: Any, **kwargs: Any) -> None:
        params = self.sig.parameters
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
        bound = self.sig.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        key = tuple(
            (n, v) if n in self.constexpr else
            (n, _specialise(v, n not in self.dns, n not in self.dnsoa))
            for n, v in bound.arguments.items())
        self.keys[self.name].add(key + options)
        for n, v in bound.arguments.items():
            if n not in self.constexpr and type(v) is int:
                self.ints[self.name][n].add(v)

    def __call__(self, *args: Any, **kwargs: Any) -> None:  # (a device function: unused)
        raise AssertionError(f"{self.name} called outside a kernel")


def _kernel_modules() -> Iterator[Any]:
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        yield importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")


def record_launches(monkeypatch: pytest.MonkeyPatch
                    ) -> tuple[dict[str, set], dict[str, dict[str, set]]]:
    """Every Triton kernel of ``sglang_diffkv.kernels``, wherever a module holds it,
    replaced by its recorder; returns (kernel name -> the set of keys launched, kernel
    name -> runtime int argument -> its values)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    keys: dict[str, set] = defaultdict(set)
    ints: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    recorders: dict[int, Recorder] = {}
    for mod in _kernel_modules():
        for name, obj in list(vars(mod).items()):
            # kernels only (every launched one is named ``*_kernel``): a device function
            # replaced here would stay replaced in the interpreter's rewritten kernels,
            # which keep the module globals they first saw, and break later tests
            if isinstance(obj, (JITFunction, InterpretedFunction)) and name.endswith("_kernel"):
                rec = recorders.setdefault(id(obj), Recorder(obj, keys, ints))
                monkeypatch.setattr(mod, name, rec)
    return keys, ints


def _stub_attention(with_lse: bool) -> PromptAttention:
    """The prompt attention (flash varlen or padded SDPA: torch's, no Triton) without the
    compute; varlen's LSE is [T, Hq] as a transposed [Hq, T]."""

    def run(q, k, v, prompts, scale):
        n = prompts.num_tokens
        lse = torch.empty(q.shape[1], n).transpose(0, 1) if with_lse else None
        return q.new_empty(n, *q.shape[1:]), lse

    return PromptAttention("varlen" if with_lse else "padded", run, "stub")


def _serving_ops(config: DiffKVConfig, with_lse: bool) -> DiffKVOps:
    c = CompressedKVCache(config, head_dim=D, num_layers=LAYERS, num_kv_heads=HKV,
                          num_pages=64, max_reqs=MAX_REQS, max_context=MAX_CONTEXT,
                          validate=False)
    ops = DiffKVOps(c, use_kernels=True, fused_argmin=False)
    ops.prompt_attention = _stub_attention(with_lse)
    return ops


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` positive ints, at random."""
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def random_step(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """(fresh, prefix, total) per request of one SGLang extend step: 1 to 512 requests
    (log-uniform) sharing at most 8192 fresh tokens; each a whole prompt or the last chunk
    over stored tokens (a radix suffix or a chunked prompt's end, in a random share of the
    requests), and at most one a chunk before its prompt's last (SGLang chunks one request
    at a time). A quarter of the steps hold whole prompts only (stage 1's path)."""
    b = min(MAX_REQS, int(2 ** rng.uniform(0, 9)))
    tokens = rng.randint(b, max(b, int(2 ** rng.uniform(0, 13))))
    fresh = _split(rng, min(tokens, MAX_STEP_TOKENS), b)
    whole_only = rng.random() < 0.25
    over_stored = rng.random()
    chunked = rng.randrange(b) if rng.random() < 0.5 else -1
    prefix, total = [], []
    for i, n in enumerate(fresh):
        p = rest = 0
        if not whole_only and (i == chunked or rng.random() < over_stored):
            p = rng.randint(0 if i == chunked else 1, MAX_CONTEXT // 2 - n)
            rest = rng.randint(1, MAX_CONTEXT // 2) if i == chunked else 0
        prefix.append(p)
        total.append(p + n + rest)
    return fresh, prefix, total


def run_step(ops: DiffKVOps, fresh: list[int], prefix: list[int], total: list[int]) -> None:
    """One extend step's launches on every layer (``DiffKVBackend._extend_metadata`` then
    ``forward_extend``), the pages never allocated: the recorders run nothing."""
    c = ops.cache
    b, t = len(fresh), sum(fresh)
    slots = list(range(b))
    req = torch.tensor(slots)
    nq = c.config.score_queries
    # earlier chunks' kept scoring queries (read when a last chunk is shorter than nq)
    kept = torch.zeros(LAYERS, nq, HKV * GROUP, D, dtype=torch.bfloat16)
    for s, p in zip(slots, prefix, strict=True):
        if p:
            c._score_queries[s] = kept
            c._score_queries_held[s] = nq
    ext = ExtendRequests.build(req, slots, fresh, prefix, total)
    step = ops.begin_prefill_step(req, fresh, torch.tensor(fresh, dtype=torch.int32), ext)
    q = torch.empty(t, HKV * GROUP, D, dtype=torch.bfloat16)
    k = torch.empty(t, HKV, D, dtype=torch.bfloat16)
    for layer in range(LAYERS):
        ops.extend_layer(layer, step, q, k, torch.empty_like(k), D**-0.5)
    c._score_queries.clear()
    c._score_queries_held.clear()


CFG = DiffKVConfig.from_dict({"preset": "llama-3-8b"})
BENCH = DiffKVConfig.from_dict({"preset": "bench-30-50-20"})


PATH_KERNELS = {
    "extend_attention._extend_kernel", "extend_attention._merge_kernel",
    "prefill._lse_kernel", "prefill._colsum_kernel", "prefill._classify_kernel",
    "prefill._store_prefill_kernel", "extend_store._gather_kernel",
    "extend_store._classify_span_kernel", "extend_store._store_span_kernel",
    "store._store_tokens_kernel",
}


def constexprs(key: tuple, names: tuple[str, ...]) -> tuple:
    return tuple(kv for kv in key if kv[0] in names)


@pytest.mark.parametrize("config,with_lse", [(CFG, True), (BENCH, False)],
                         ids=["scores-varlen", "bench-mix-padded"])
def test_prefill_step_kernels_compile_few_variants(monkeypatch, config, with_lse):
    """200 random extend steps (1-512 requests, up to 8192 tokens, whole prompts, chunks
    and prompt ends over stored tokens) through the serving path, on an H200's SM count:
    every kernel the step launches compiles at most MAX_VARIANTS variants."""
    monkeypatch.setattr(variants, "sm_count", lambda device: SMS)
    keys, ints = record_launches(monkeypatch)
    ops = _serving_ops(config, with_lse)
    rng = random.Random(0)
    for _ in range(STEPS):
        run_step(ops, *random_step(rng))
    counts = {name: len(k) for name, k in sorted(keys.items())}
    assert keys.keys() == PATH_KERNELS  # (a kernel dropped from the path would hide here)
    assert all(n <= MAX_VARIANTS for n in counts.values()), counts
    # the batch moved what used to be constexprs (splits, tiles): now runtime ints
    assert len(ints["extend_attention._extend_kernel"]["splits"]) >= 16
    assert len(ints["extend_attention._extend_kernel"]["TILES"]) >= 16
    ext = keys["extend_attention._extend_kernel"]
    assert len(ext) == EXTEND_VARIANTS, counts
    assert len({constexprs(k, ("BLOCK_M", "QT", "SPLIT")) for k in ext}) == EXTEND_VARIANTS
    assert len(keys["extend_attention._merge_kernel"]) == MERGE_VARIANTS, counts


MODEL_SHAPES = [(1, 8), (4, 8), (4, 2), (5, 8), (7, 4), (8, 1), (32, 1), (128, 1)]


@pytest.mark.parametrize("group,num_kv_heads", MODEL_SHAPES)
def test_extend_launch_constexprs_are_bounded(group, num_kv_heads):
    """``variants.extend_launch`` (what ``extend_attention`` launches with) over 3000
    random batches: at most 2 x (the tile shapes' count) constexpr tuples, <= 6, while
    the tiles and splits it returns still cover every request's fresh tokens."""
    rng = random.Random(group * 1000 + num_kv_heads)
    seen, splits = set(), set()
    for _ in range(3000):
        batch = min(MAX_REQS, int(2 ** rng.uniform(0, 9)))
        max_new = rng.randint(1, max(1, MAX_STEP_TOKENS - batch + 1))
        launch = variants.extend_launch(group, batch, num_kv_heads, max_new, SMS)
        seen.add(tuple(sorted(launch.constexprs().items())))
        splits.add(launch.splits)
        assert launch.qt * group <= launch.block_m or launch.qt == 1
        assert launch.tiles * launch.qt >= max_new > (launch.tiles - 1) * launch.qt
        assert 1 <= launch.splits <= variants.MAX_SPLITS
    shapes = {variants.tile_shape(group, n) for n in range(1, 257)}
    assert len(seen) <= 2 * len(shapes) <= EXTEND_VARIANTS, sorted(seen)
    assert len(splits) > 2  # (the splits did follow the batch)


def test_upload_columns_are_16_byte_aligned():
    """Every column of ``upload`` starts 16-byte aligned whatever the lengths before it
    (Triton specialises on a pointer's alignment), and holds exactly its values."""
    rng = random.Random(3)
    for _ in range(50):
        cols = [[rng.randint(-9, 9) for _ in range(rng.randint(0, 7))]
                for _ in range(rng.randint(1, 9))]
        out = upload(cols, torch.device("cpu"))
        assert [x.tolist() for x in out] == cols
        assert all(x.data_ptr() % 16 == 0 for x in out if x.numel())
        assert all(x.dtype == torch.int64 for x in out)
