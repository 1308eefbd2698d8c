"""Benchmark mode (config.bench_mix): the draw, the prefill and decode paths that follow it,
and the Triton kernels against their references under it."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_diffkv import bench_mix as bm
from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import ENV_VAR, PRESET_DIR, ConfigError, DiffKVConfig, preset
from sglang_diffkv.kernels.decode_policy import decode_policy_step, decode_policy_step_reference
from sglang_diffkv.kernels.prefill import compress_prefill, compress_prefill_reference
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory import MemorySpec, PageManager
from sglang_diffkv.policy import DecodeAction, Tier, classify_prompt
from sglang_diffkv.sglang.ops import DiffKVOps

MIX = (0.3, 0.5, 0.2)
SMALL = {"preset": "llama-3-8b", "alpha_h": 6.0, "alpha_l": 1.5, "window": 4,
         "score_queries": 8}
CONFIG = DiffKVConfig.from_dict({**SMALL, "bench_mix": list(MIX)})


# ---- config --------------------------------------------------------------------------------


def test_bench_mix_loads_from_json_env_and_presets(tmp_path):
    inline = '{"preset": "llama-3-8b", "bench_mix": [0.3, 0.5, 0.2]}'
    a = DiffKVConfig.from_env({ENV_VAR: inline})
    path = tmp_path / "bench.json"
    path.write_text(inline)
    b = DiffKVConfig.from_env({ENV_VAR: str(path)})
    assert a == b == preset("bench-30-50-20")
    assert a.bench_mix == (0.3, 0.5, 0.2) and a.alpha_l == 0.02 and a.alpha_h == 1.0
    assert DiffKVConfig.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    assert "BENCHMARK MODE: tier decisions follow mix high 0.3 / low 0.5 / pruned 0.2, not " \
           "attention scores" in a.bench_note
    assert preset("llama-3-8b").bench_mix is None and preset("llama-3-8b").bench_note is None


def test_measured_preset_is_the_quality_harness_mix():
    prov = json.loads((PRESET_DIR / "smollm2-135m.provenance.json").read_text())
    cfg = preset("bench-measured")
    measured = prov["eval_split_metrics"]
    assert cfg.bench_mix is not None and sum(cfg.bench_mix) == pytest.approx(1.0, abs=1e-9)
    for got, want in zip(cfg.bench_mix, (measured["high"], measured["low"], 0.0), strict=True):
        assert got == pytest.approx(want, abs=5e-5)
    calibrated = DiffKVConfig.from_json(PRESET_DIR / "smollm2-135m.json")
    assert (cfg.high, cfg.low, cfg.alpha_h, cfg.alpha_l) == (
        calibrated.high, calibrated.low, calibrated.alpha_h, calibrated.alpha_l)


@pytest.mark.parametrize(
    "mix, message",
    [
        ([0.3, 0.5], "bench_mix=[0.3, 0.5] is not allowed"),
        ("0.3,0.5,0.2", "is not allowed; expected three fractions"),
        ([0.3, 0.5, "x"], "'x' is not a number"),
        ([1.2, -0.1, -0.1], "bench_mix high=1.2 is out of range"),
        ([0.3, 0.5, 0.3], "sums to 1.1"),
        ([0.0, 0.5, 0.5], "bench_mix high=0.0: must be > 0"),
        ([0.5, float("nan"), 0.5], "low=nan is out of range"),
    ],
)
def test_bench_mix_validation_names_the_bad_value(mix, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        DiffKVConfig.from_dict({"preset": "llama-3-8b", "bench_mix": mix})


def test_bench_mix_low_needs_a_low_tier():
    with pytest.raises(ConfigError, match="bench_mix low=0.5 needs a low tier"):
        DiffKVConfig.from_dict({"preset": "qwen2.5-7b", "bench_mix": [0.3, 0.5, 0.2]})
    ok = DiffKVConfig.from_dict({"preset": "qwen2.5-7b", "bench_mix": [0.7, 0.0, 0.3]})
    assert ok.bench_mix == (0.7, 0.0, 0.3)


# ---- the draw ------------------------------------------------------------------------------


def _py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * bm.MUL_A) % 2**32
    x ^= x >> 15
    x = (x * bm.MUL_B) % 2**32
    return x ^ (x >> 16)


def _py_hash(seed: int, layer: int, head: int, pos: int) -> int:
    x = _py_mix32((seed % 2**32) ^ bm.SEED_SALT)
    for v in (layer, head, pos):
        x = _py_mix32(x ^ (v % 2**32))
    return x >> (32 - bm.U_BITS)


def test_hash_is_the_32_bit_formula():
    g = torch.Generator().manual_seed(1)
    seed = torch.randint(0, 2**40, (64,), generator=g)
    head = torch.randint(0, 64, (64,), generator=g)
    pos = torch.randint(0, 2**31 - 1, (64,), generator=g)
    for layer in (0, 7, 95):
        got = bm.hash_u24(seed, layer, head, pos).tolist()
        want = [_py_hash(s, layer, h, p) for s, h, p in
                zip(seed.tolist(), head.tolist(), pos.tolist(), strict=True)]
        assert got == want


def test_draws_are_uniform_and_independent_of_neighbours():
    u = bm.hash_u24(torch.tensor(5), 3, torch.arange(8)[:, None], torch.arange(4096)[None, :])
    assert 0 <= int(u.min()) and int(u.max()) < bm.U_RANGE
    for f in (0.05, 0.3, 0.5, 0.8):
        assert float((u < bm.cut(f)).double().mean()) == pytest.approx(f, abs=0.01)
    # consecutive positions and heads are not correlated
    x = u.double() / bm.U_RANGE - 0.5
    assert abs(float((x[:, 1:] * x[:, :-1]).mean())) < 0.005
    assert abs(float((x[1:] * x[:-1]).mean())) < 0.005
    assert bm.cut(0.0) == 0 and bm.cut(1.0) == bm.U_RANGE


# ---- prefill -------------------------------------------------------------------------------


@pytest.mark.parametrize("alphas", [(6.0, 1.5), (1.0, 0.0), (16.0, 0.0), (200.0, 0.02)])
def test_synthetic_significance_classifies_as_drawn(alphas):
    g = torch.Generator().manual_seed(2)
    b, hkv, window, sq = 4, 3, 4, 8
    lengths = torch.tensor([1, 9, 37, 120])
    lmax = int(lengths.max())
    seed = torch.randint(0, 2**32, (b,), generator=g)
    ah = torch.full((b,), alphas[0])
    al = torch.full((b,), alphas[1])
    sig = bm.synthetic_significance(seed, 2, hkv, lengths, lmax, ah, al, MIX, window, sq)
    cls = classify_prompt(sig, lengths, ah, al, window, sq)
    want = bm.drawn_prompt_tiers(seed, 2, hkv, lengths, lmax, MIX, window)
    assert torch.equal(cls.tier, want)
    assert {0, 1, 2} <= set(cls.tier[3].flatten().tolist())


def run_significance_kernel(device: str, lengths: list[int], hkv: int) -> None:
    """kernels.bench_mix.synthetic_significance == the torch function, bit for bit, on a
    poisoned output, for several mixes (incl. no low, no pruned, all high) and thresholds."""
    from sglang_diffkv.kernels import bench_mix as kbm

    g = torch.Generator().manual_seed(6)
    b = len(lengths)
    length = torch.tensor(lengths)
    lmax = max(lengths)
    seed = torch.randint(0, 2**40, (b,), generator=g)
    ah = torch.rand(b, generator=g) * 20 + 0.5
    al = torch.where(torch.rand(b, generator=g) < 0.5, 0.0, ah * torch.rand(b, generator=g))
    for mix in (MIX, (0.0733, 0.9267, 0.0), (1.0, 0.0, 0.0), (0.7, 0.0, 0.3)):
        for layer in (0, 31):
            ref = bm.synthetic_significance(seed, layer, hkv, length, lmax, ah, al, mix, 64, 64)
            poison = torch.full((b, hkv, lmax), float("nan"), device=device)
            got = kbm.synthetic_significance(seed.to(device), layer, hkv, length.to(device),
                                             lmax, ah.to(device), al.to(device), mix, 64, 64,
                                             out=poison)
            assert got is poison
            assert torch.equal(got.cpu(), ref), (mix, layer)


def test_significance_kernel_matches_torch():
    run_significance_kernel("cpu", [1, 9, 64, 65, 300], hkv=3)


@pytest.mark.gpu
def test_significance_kernel_matches_torch_gpu():
    run_significance_kernel("cuda", [1, 63, 64, 65, 1000, 4096, 8191], hkv=8)


def test_whole_prompt_follows_the_mix():
    lengths = torch.tensor([512, 2048, 40])
    seed = torch.tensor([3, 4, 5])
    tier = bm.drawn_prompt_tiers(seed, 0, 8, lengths, 2048, MIX, 64)
    for i, n in enumerate(lengths.tolist()):
        t = tier[i, :, :n]
        frac = [float((t == k).double().mean()) for k in (Tier.HIGH, Tier.LOW, Tier.PRUNED)]
        if n * MIX[0] >= 64:
            assert frac == pytest.approx(list(MIX), abs=0.03), (n, frac)
        else:  # shorter than window / high: the window alone; the rest keeps low : pruned
            assert frac[0] == pytest.approx(min(64, n) / n)
    # all-high stays all-high outside the window (the 40-token prompt has no outside)
    assert torch.equal(bm.prefill_fractions((1.0, 0.0, 0.0), lengths, 64)[:2, 0],
                       torch.ones(2, dtype=torch.float64))


def _prefill_state(device: str = "cpu"):
    geo = PageGeometry.for_config(CONFIG, 64)
    spec = MemorySpec.from_geometry(geo, num_pages=300, max_reqs=4, num_layers=2,
                                    num_kv_heads=2, max_context=160)
    m = PageManager(spec, device)
    return geo, m


def test_compress_prefill_kernel_follows_the_draw():
    """The Triton classifier and store on synthetic significance == the reference, on
    poisoned pages (TRITON_INTERPRET=1 on CPU)."""
    g = torch.Generator().manual_seed(3)
    geo, m = _prefill_state()
    req = torch.tensor([2, 0, 3])
    lengths = torch.tensor([40, 23, 61])
    m.allocate_prefill(req, lengths).raise_if_failed()
    lmax, hkv, d = 61, 2, 64
    k = torch.randn(3, hkv, lmax, d, generator=g).to(torch.bfloat16)
    v = torch.randn(3, hkv, lmax, d, generator=g).to(torch.bfloat16)
    ah, al = torch.tensor([6.0, 1.0, 16.0]), torch.tensor([1.5, 0.0, 0.0])
    seed = torch.tensor([11, 12, 13])
    sig = bm.synthetic_significance(seed, 1, hkv, lengths, lmax, ah, al, MIX, 4, 8)
    poison = torch.randint(0, 256, (300, geo.page_bytes), generator=g, dtype=torch.uint8)
    pa, pb = poison.clone(), poison.clone()
    ref = compress_prefill_reference(pa, geo, m.table, req, 1, k, v, sig, lengths, ah, al, 4, 8)
    got = compress_prefill(pb, geo, m.table, req, 1, k, v, sig, lengths, ah, al, 4, 8)
    assert torch.equal(got.tier, ref.tier)
    assert torch.equal(got.tier, bm.drawn_prompt_tiers(seed, 1, hkv, lengths, lmax, MIX, 4))
    assert torch.equal(got.n_high, ref.n_high) and torch.equal(got.n_low, ref.n_low)
    assert torch.equal(pa, pb)


def run_draw_inside_the_classifier(device: str, lengths: list[int], hkv: int, d: int,
                                   max_context: int) -> None:
    """compress_prefill(bench=...) draws in the classify kernel: the same significance
    (written over a poisoned buffer), tiers, totals and stored pages, bit for bit, as the
    draw's own launch (kernels.bench_mix.synthetic_significance) then compress_prefill, for
    several mixes, layers, seeds and thresholds, with and without the classification's
    score / pos; the significance also equals the torch draw's."""
    from sglang_diffkv.kernels import bench_mix as kbm

    g = torch.Generator().manual_seed(41)
    b, lmax = len(lengths), max(lengths)
    geo = PageGeometry.for_config(CONFIG, d)
    per_page = geo.min_tokens_per_page
    pages_needed = 32 * hkv * sum(-(-n // per_page) + 1 for n in lengths)
    spec = MemorySpec.from_geometry(geo, num_pages=pages_needed, max_reqs=b + 1,
                                    num_layers=32, num_kv_heads=hkv, max_context=max_context)
    m = PageManager(spec, device)
    req = torch.arange(b, 0, -1, device=device)
    length = torch.tensor(lengths)
    m.allocate_prefill(req, length.to(device)).raise_if_failed()
    k = torch.randn(b, hkv, lmax, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(b, hkv, lmax, d, generator=g).to(torch.bfloat16).to(device)
    seed = torch.randint(0, 2**40, (b,), generator=g)
    ah = torch.rand(b, generator=g) * 20 + 0.5
    al = torch.where(torch.rand(b, generator=g) < 0.4, 0.0, ah * torch.rand(b, generator=g))
    poison = torch.randint(0, 256, (pages_needed, geo.page_bytes), generator=g,
                           dtype=torch.uint8).to(device)
    dev = {"seed": seed.to(device), "length": length.to(device), "ah": ah.to(device),
           "al": al.to(device)}
    for mix, layer, scores in ((MIX, 0, True), ((0.0733, 0.9267, 0.0), 31, False),
                               ((0.7, 0.0, 0.3), 1, False)):
        out = []
        for inside in (False, True):
            pages = poison.clone()
            sig = (torch.randn(b, hkv, lmax, generator=g) * 50).to(device)  # stale scores
            if inside:
                bench = (dev["seed"], torch.tensor(mix, dtype=torch.float64, device=device))
            else:
                sig = kbm.synthetic_significance(dev["seed"], layer, hkv, dev["length"], lmax,
                                                 dev["ah"], dev["al"], mix, 4, 8, out=sig)
                bench = None
            cls = compress_prefill(pages, geo, m.table, req, layer, k, v, sig, dev["length"],
                                   dev["ah"], dev["al"], 4, 8, scores=scores, bench=bench)
            out.append((pages, sig, cls))
        (p0, s0, c0), (p1, s1, c1) = out
        ref = bm.synthetic_significance(seed, layer, hkv, length, lmax, ah, al, mix, 4, 8)
        assert torch.equal(s1.cpu(), ref) and torch.equal(s0.cpu(), ref), (mix, layer)
        assert torch.equal(c1.tier, c0.tier), (mix, layer)
        assert torch.equal(c1.tier.cpu(), bm.drawn_prompt_tiers(seed, layer, hkv, length, lmax,
                                                                mix, 4))
        assert torch.equal(c1.n_high, c0.n_high) and torch.equal(c1.n_low, c0.n_low)
        if scores:
            assert torch.equal(c1.score, c0.score) and torch.equal(c1.pos, c0.pos)
        assert torch.equal(p1, p0), (mix, layer)
        assert not torch.equal(p1, poison)


def test_draw_inside_the_classifier_matches_the_two_step_path():
    # odd block count (3), blocks past the short prompts' ends
    run_draw_inside_the_classifier("cpu", [150, 9, 64, 65, 1], hkv=2, d=64, max_context=160)


@pytest.mark.gpu
def test_draw_inside_the_classifier_matches_the_two_step_path_gpu():
    """The compiled classifier (its float64 cuts under the GPU's rounding) too."""
    run_draw_inside_the_classifier("cuda", [1, 63, 64, 65, 1000, 4096, 8191], hkv=8, d=128,
                                   max_context=8192)


def _reference_and_kernel_ops(num_layers: int, num_pages: int, poison: int):
    """Two poisoned caches of one shape, and DiffKVOps on each: the torch reference path
    first, the Triton kernel path second."""
    caches = []
    for _ in range(2):
        c = CompressedKVCache(CONFIG, head_dim=64, num_layers=num_layers, num_kv_heads=2,
                              num_pages=num_pages, max_reqs=4, max_context=160)
        c.pages.fill_(poison)
        caches.append(c)
    return caches, [DiffKVOps(caches[0], use_kernels=False),
                    DiffKVOps(caches[1], use_kernels=True)]


def test_ops_extend_kernel_and_reference_paths_agree_in_bench_mode():
    """The backend's packed prefill step (begin_prefill_step, extend_layer per layer,
    end_prefill_step) through DiffKVOps with the Triton kernels (the draw inside the
    classifier, the step's reused buffers) leaves the reference path's compressed state."""
    from sglang_diffkv.prompt_attention import PackedPrompts

    g = torch.Generator().manual_seed(32)
    caches, ops = _reference_and_kernel_ops(num_layers=3, num_pages=400, poison=0x5A)
    req = torch.tensor([3, 1, 0])
    lens = [37, 130, 5]
    t = sum(lens)
    layers = [tuple(torch.randn(t, h, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
              for _ in range(3)]
    outs = []
    for c, o in zip(caches, ops, strict=True):
        c.begin_prefill(req, lens).raise_if_failed()
        step = o.begin_prefill_step(req, lens)
        assert isinstance(step.prompts, PackedPrompts)
        outs.append([o.extend_layer(layer, step, q, k, v, 0.125)
                     for layer, (q, k, v) in enumerate(layers)])
        o.end_prefill_step(step)
    assert torch.equal(caches[0].counts, caches[1].counts)
    assert torch.equal(caches[0].manager.table, caches[1].manager.table)
    assert torch.equal(caches[0].pages, caches[1].pages)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# ---- decode --------------------------------------------------------------------------------


def _prefilled(config: DiffKVConfig, lengths, hkv: int, d: int, seed: int, layers: int = 2,
               num_pages: int = 400, max_context: int = 160):
    g = torch.Generator().manual_seed(seed)
    cache = CompressedKVCache(config, head_dim=d, num_layers=layers, num_kv_heads=hkv,
                              num_pages=num_pages, max_reqs=4, max_context=max_context)
    cache.pages.copy_(torch.randint(0, 256, cache.pages.shape, generator=g, dtype=torch.uint8))
    req = torch.tensor([2, 0, 3][: len(lengths)])
    lens = torch.tensor(lengths)
    cache.begin_prefill(req, lens).raise_if_failed()
    lmax = max(lengths)
    for layer in range(layers):
        q = torch.randn(len(lengths), 2 * hkv, lmax, d, generator=g)
        k = torch.randn(len(lengths), hkv, lmax, d, generator=g)
        v = torch.randn(len(lengths), hkv, lmax, d, generator=g)
        cache.prefill_layer(layer, req, lens, q, k, v, d**-0.5)
    cache.end_prefill(req)
    return cache, req, lens


def _copy(src: CompressedKVCache, device: str = "cpu") -> CompressedKVCache:
    dst = CompressedKVCache(src.config, head_dim=src.geometry.head_dim,
                            num_layers=src.spec.num_layers, num_kv_heads=src.spec.num_kv_heads,
                            num_pages=src.spec.num_pages, max_reqs=src.spec.max_reqs,
                            max_context=src.spec.max_context, device=device)
    dst.copy_state_from(src)
    return dst


def run_bench_decode(device: str, steps: int, lengths=(40, 23, 61), hkv: int = 2,
                     d: int = 64) -> set[int]:
    """Reference on the CPU, the kernel on ``device`` from the same state; returns the
    actions seen."""
    a, req, lens = _prefilled(CONFIG, list(lengths), hkv=hkv, d=d, seed=21)
    b = _copy(a, device)
    g = torch.Generator().manual_seed(22)
    alpha = a.alpha[req]
    seen: set[int] = set()
    for step in range(steps):
        a.begin_decode(req).raise_if_failed()
        b.begin_decode(req.to(device)).raise_if_failed()
        positions = lens + step
        for layer in range(2):
            key = torch.randn(3, hkv, d, generator=g).to(torch.bfloat16)
            value = torch.randn(3, hkv, d, generator=g).to(torch.bfloat16)
            ref = decode_policy_step_reference(a.pages, a.geometry, a.manager.table,
                                               a.manager.counts, req, layer, positions,
                                               alpha, CONFIG.window, key, value,
                                               bench=(a.bench_seed[req], MIX))
            breq = req.to(device)
            got = decode_policy_step(b.pages, b.geometry, b.manager.table, b.manager.counts,
                                     breq, layer, positions.to(device), alpha.to(device),
                                     CONFIG.window, key.to(device), value.to(device),
                                     bench=(b.bench_seed[breq], MIX))
            assert torch.equal(got.action.cpu(), ref.action.to(torch.int8))
            assert torch.equal(got.hmin.cpu(), ref.hmin) and torch.equal(got.lmin.cpu(), ref.lmin)
            assert torch.equal(a.manager.counts, b.manager.counts.cpu())
            assert torch.equal(a.pages, b.pages.cpu())
            forced = bm.forced_actions(a.bench_seed[req], layer, hkv, positions, MIX)
            usable = ref.hmin >= 0
            assert torch.equal(ref.action[usable], forced[usable])
            assert bool((ref.action[~usable] == DecodeAction.APPEND_HIGH).all())
            seen.update(got.action.flatten().tolist())
    return seen


def test_decode_kernel_matches_reference_in_bench_mode():
    """Triton policy step with BENCH (TRITON_INTERPRET=1) == apply_decode_step with the
    drawn actions: same actions, victims, counters and page bytes, step after step."""
    seen = run_bench_decode("cpu", steps=4)
    assert {0, 1, 2} <= seen, seen


@pytest.mark.gpu
def test_decode_kernel_matches_reference_in_bench_mode_gpu():
    """The compiled kernel's int64 hash gives torch's bits (the interpreter is numpy)."""
    seen = run_bench_decode("cuda", steps=12, lengths=(90, 64, 40), hkv=8, d=128)
    assert {0, 1, 2} <= seen, seen


def test_decode_without_a_victim_appends():
    """Window not full (or nothing old enough): every drawn action falls back to append."""
    cfg = DiffKVConfig.from_dict({**SMALL, "window": 64, "bench_mix": [0.1, 0.5, 0.4]})
    cache, req, lens = _prefilled(cfg, [10, 20], hkv=2, d=64, seed=5, layers=1)
    cache.begin_decode(req).raise_if_failed()
    k = torch.randn(2, 2, 64)
    d = cache.decode_layer_store(0, req, lens, k, k)
    assert bool((d.action == DecodeAction.APPEND_HIGH).all())


def test_generated_tokens_follow_the_mix():
    """Over many steps the generated tokens are high / low / pruned in the mix's
    proportions (each step adds one token: append +1 high, demote +1 low, evict +1 pruned)."""
    mix = (0.25, 0.45, 0.3)
    cfg = DiffKVConfig.from_dict({**SMALL, "bench_mix": list(mix)})
    steps, hkv = 300, 4
    cache, req, lens = _prefilled(cfg, [48, 30, 64], hkv=hkv, d=64, seed=9, layers=1,
                                  num_pages=3000, max_context=400)
    start = cache.counts[req, 0, :, :2].clone().double()
    g = torch.Generator().manual_seed(10)
    actions = []
    for step in range(steps):
        cache.begin_decode(req).raise_if_failed()
        k = torch.randn(3, hkv, 64, generator=g)
        actions.append(cache.decode_layer_store(0, req, lens + step, k, k).action)
    gained = (cache.counts[req, 0, :, :2].double() - start).sum((0, 1)) / (steps * 3 * hkv)
    realised = [float(gained[0]), float(gained[1]), 1 - float(gained.sum())]
    assert realised == pytest.approx(list(mix), abs=0.03)
    fallback = float((torch.stack(actions) == DecodeAction.APPEND_HIGH).double().mean())
    assert fallback == pytest.approx(mix[0], abs=0.03)  # victims were (nearly) always there
    cache.manager.check_invariants()


def test_per_request_thresholds_without_low_tier_still_get_low_room():
    """A request whose own thresholds have no low tier still demotes in benchmark mode:
    begin_decode must reserve low pages for it (the pages' invariants hold)."""
    cache = CompressedKVCache(CONFIG, head_dim=64, num_layers=1, num_kv_heads=2,
                              num_pages=600, max_reqs=2, max_context=300)
    req = torch.tensor([1])
    cache.begin_prefill(req, [20], [2.0], [2.0]).raise_if_failed()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4, 20, 64, generator=g)
    cache.prefill_layer(0, req, torch.tensor([20]), x, x[:, :2], x[:, :2], 0.125)
    cache.end_prefill(req)
    for step in range(60):
        cache.begin_decode(req).raise_if_failed()
        k = torch.randn(1, 2, 64, generator=g)
        cache.decode_layer_store(0, req, torch.tensor([20 + step]), k, k)
    assert int(cache.counts[1, 0, :, 1].sum()) > 0
    cache.manager.check_invariants()


# ---- the backend's compute seam ------------------------------------------------------------


def test_ops_kernel_and_reference_paths_agree_in_bench_mode():
    """DiffKVOps with Triton kernels (interpreter) and with the torch reference leave the
    same compressed state after a bench-mode prefill and decode steps."""
    g = torch.Generator().manual_seed(31)
    caches, ops = _reference_and_kernel_ops(num_layers=2, num_pages=300, poison=0xA5)
    req = torch.tensor([3, 1])
    lengths = torch.tensor([37, 52])
    q = torch.randn(2, 4, 52, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 2, 52, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 52, 64, generator=g).to(torch.bfloat16)
    for c, o in zip(caches, ops, strict=True):
        c.begin_prefill(req, lengths).raise_if_failed()
        for layer in range(2):
            o.prefill_layer(layer, req, lengths, q, k, v, 0.125)
        c.end_prefill(req)
    assert torch.equal(caches[0].counts, caches[1].counts)
    for step in range(3):
        kd = torch.randn(2, 2, 64, generator=g)
        vd = torch.randn(2, 2, 64, generator=g)
        for c, o in zip(caches, ops, strict=True):
            c.begin_decode(req).raise_if_failed()
            for layer in range(2):
                o.decode_store(layer, req, lengths + step, kd, vd)
    assert torch.equal(caches[0].manager.table, caches[1].manager.table)
    assert torch.equal(caches[0].counts, caches[1].counts)
    assert torch.equal(caches[0].pages, caches[1].pages)
