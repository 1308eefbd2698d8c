"""The reference cache (policy + store + memory manager) against a plain per-head emulation
written straight from DESIGN §2 with Python lists."""

import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig, preset
from sglang_diffkv.memory import OutOfPages
from sglang_diffkv.policy import DecodeAction, Tier
from sglang_diffkv.quant import fake_quantize

D, HKV, GROUP, LAYERS = 64, 2, 3, 2
SCALE = D**-0.5


class ListHead:
    """One (request, layer, KV head): tokens as dicts, high and low lists in slot order."""

    def __init__(self, cfg):
        self.cfg, self.high, self.low = cfg, [], []

    def fq(self, x, tier):
        t = self.cfg.high if tier == 0 else self.cfg.low
        return (
            fake_quantize(x[0][None], t.key_bits, t.key_groups)[0],
            fake_quantize(x[1][None], t.value_bits, t.value_groups)[0],
        )

    def step(self, p, k, v, alpha_h, alpha_l):
        w = self.cfg.window

        def argmin(tokens):
            best, idx = float("inf"), -1
            for i, t in enumerate(tokens):
                if p - t["pos"] >= w:
                    avg = t["score"] / (p - t["pos"])
                    if avg < best:
                        best, idx = avg, i
            return best, idx

        h_avg, hmin = argmin(self.high)
        l_avg, lmin = argmin(self.low)
        t_h, t_l = min(alpha_h / p, 1.0), min(alpha_l / p, 1.0)
        kq, vq = self.fq((k, v), 0)
        new = {"k": kq, "v": vq, "score": 0.0, "pos": p}
        if len(self.high) + len(self.low) + 1 <= w:
            action = DecodeAction.APPEND_HIGH
        elif h_avg < t_l and h_avg < l_avg:
            action = DecodeAction.EVICT_HIGH
        elif h_avg < t_h:
            action = DecodeAction.DEMOTE_REPLACE if l_avg < t_l else DecodeAction.DEMOTE_APPEND
        else:
            action = DecodeAction.APPEND_HIGH
        if action == DecodeAction.APPEND_HIGH:
            self.high.append(new)
        elif action == DecodeAction.EVICT_HIGH:
            self.high[hmin] = new
        else:
            old = self.high[hmin]
            kq, vq = self.fq((old["k"], old["v"]), 1)
            demoted = {"k": kq, "v": vq, "score": old["score"], "pos": old["pos"]}
            if action == DecodeAction.DEMOTE_REPLACE:
                self.low[lmin] = demoted
            else:
                self.low.append(demoted)
            self.high[hmin] = new
        return action

    def attend(self, q):
        tokens = self.high + self.low
        k = torch.stack([t["k"] for t in tokens])
        v = torch.stack([t["v"] for t in tokens])
        p = torch.softmax(q.float() @ k.T * SCALE, dim=-1)
        for t, pm in zip(tokens, p.amax(0).tolist(), strict=True):
            t["score"] += pm
        return p @ v


def _make(cfg, num_pages=400, max_reqs=4):
    return CompressedKVCache(
        cfg,
        head_dim=D,
        num_layers=LAYERS,
        num_kv_heads=HKV,
        num_pages=num_pages,
        max_reqs=max_reqs,
        max_context=512,
    )


def test_reference_cache_matches_list_emulation_through_every_branch():
    cfg = DiffKVConfig.from_dict(
        {"preset": "qwq-32b", "alpha_h": 2.0, "alpha_l": 0.6, "window": 4, "score_queries": 4}
    )
    cache = _make(cfg)
    g = torch.Generator().manual_seed(5)
    req = torch.tensor([2, 0])
    lengths = torch.tensor([40, 23])
    b, lmax = 2, 40
    alpha_h, alpha_l = [2.0, 1.5], [0.6, 0.3]
    assert bool(cache.begin_prefill(req, lengths, alpha_h, alpha_l).ok)
    heads = {}
    for layer in range(LAYERS):
        q = torch.randn(b, HKV * GROUP, lmax, D, generator=g)
        k = torch.randn(b, HKV, lmax, D, generator=g)
        v = torch.randn(b, HKV, lmax, D, generator=g)
        cls = cache.prefill_layer(layer, req, lengths, q, k, v, SCALE)
        for i in range(b):
            for h in range(HKV):
                head = heads[i, layer, h] = ListHead(cfg)
                for j in range(int(lengths[i])):
                    t = int(cls.tier[i, h, j])
                    if t == Tier.PRUNED:
                        continue
                    kq, vq = head.fq((k[i, h, j], v[i, h, j]), t)
                    tok = {
                        "k": kq,
                        "v": vq,
                        "score": float(cls.score[i, h, j]),
                        "pos": int(cls.pos[i, j]),
                    }
                    (head.high if t == Tier.HIGH else head.low).append(tok)
    cache.end_prefill(req)
    cache.manager.check_invariants()
    seen = set()
    for step in range(40):
        assert bool(cache.begin_decode(req).ok)
        positions = lengths + step
        for layer in range(LAYERS):
            k = torch.randn(b, HKV, D, generator=g) * (1 + 3 * (step % 3 == 0))
            v = torch.randn(b, HKV, D, generator=g)
            q = torch.randn(b, HKV * GROUP, D, generator=g)
            d = cache.decode_layer_store(layer, req, positions, k, v)
            res = cache.decode_layer_attend(layer, req, q, SCALE)
            for i in range(b):
                for h in range(HKV):
                    head = heads[i, layer, h]
                    action = head.step(int(positions[i]), k[i, h], v[i, h], alpha_h[i], alpha_l[i])
                    assert int(d.action[i, h]) == action, (step, layer, i, h)
                    seen.add(action)
                    ref = head.attend(q[i, h * GROUP : (h + 1) * GROUP])
                    got = res.out[i, h * GROUP : (h + 1) * GROUP]
                    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 1e-5
                    cnt = cache.counts[req[i], layer, h]
                    assert (int(cnt[0]), int(cnt[1])) == (len(head.high), len(head.low))
        cache.manager.check_invariants()
    assert seen == set(DecodeAction), f"branches exercised: {seen}"
    cache.free(req)
    cache.manager.check_invariants()
    assert cache.manager.num_free_pages_host() == cache.spec.num_pages


def test_no_compression_keeps_every_token_high():
    cache = _make(preset("no-compression"))
    g = torch.Generator().manual_seed(1)
    req, lengths = torch.tensor([1]), torch.tensor([150])
    cache.begin_prefill(req, lengths).raise_if_failed()
    for layer in range(LAYERS):
        x = [torch.randn(1, n, 150, D, generator=g) for n in (HKV * GROUP, HKV, HKV)]
        cls = cache.prefill_layer(layer, req, lengths, *x, SCALE)
        assert torch.all(cls.tier == Tier.HIGH)
    cache.end_prefill(req)
    for _ in range(3):
        cache.begin_decode(req).raise_if_failed()
        for layer in range(LAYERS):
            d = cache.decode_layer_store(
                layer, req, lengths, torch.randn(1, HKV, D), torch.randn(1, HKV, D)
            )
            assert torch.all(d.action == DecodeAction.APPEND_HIGH)
            # every row's low tier is empty: attention runs over the high tier alone
            res = cache.decode_layer_attend(layer, req, torch.randn(1, HKV * GROUP, D), SCALE)
            assert res.prob_low.shape[-1] == 0 and torch.all(torch.isfinite(res.out))
            # max over the group of distributions that each sum to 1: in [1, GROUP]
            total = res.prob_high.sum(-1)
            assert torch.all(total >= 1 - 1e-5) and torch.all(total <= GROUP + 1e-5)
        lengths = lengths + 1
    assert torch.all(cache.counts[1, :, :, 0] == 153) and torch.all(cache.counts[1, :, :, 1] == 0)
    # the low tier is never grown without demotion thresholds: no page wasted on it
    assert torch.all(cache.counts[1, :, :, 3] == 0)


def test_exhaustion_is_reported_and_changes_nothing():
    cache = _make(preset("default"), num_pages=30)
    before = cache.manager.snapshot()
    res = cache.begin_prefill([0], [500])
    assert not bool(res.ok)
    with pytest.raises(OutOfPages, match="needed 68 pages but only 30 are free"):
        res.raise_if_failed()
    for name, t in cache.manager.snapshot().items():
        assert torch.equal(t, before[name]), name
