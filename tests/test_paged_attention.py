import pytest
import torch

from sglang_diffkv.attention import paged_decode_attention
from sglang_diffkv.config import preset
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.pages import add_scores, read_scores, read_tokens, token_locations, write_tokens
from sglang_diffkv.quant import fake_quantize


def _random_cache(geometry, b, hkv, max_tokens, seed):
    """Random page table rows (distinct pages), random counts, pages filled with random tokens.
    Returns pages, table, counts and the original fp32 K/V per (b, h, tier)."""
    g = torch.Generator().manual_seed(seed)
    d = geometry.head_dim
    row_len = geometry.row_len(max_tokens)
    n = torch.randint(0, max_tokens // 2 + 1, (b, hkv, 2), generator=g)
    n[0, 0] = torch.tensor([0, 5])  # a head with no high tokens
    n[-1, -1] = torch.tensor([7, 0])  # and one with no low tokens
    pages_per = [
        [
            [geometry.pages_for(int(n[i, h, 0]), 0), geometry.pages_for(0, int(n[i, h, 1]))]
            for h in range(hkv)
        ]
        for i in range(b)
    ]
    total = sum(sum(sum(x) for x in row) for row in pages_per)
    num_pages = total + 5
    pages = torch.randint(0, 256, (num_pages, geometry.page_bytes), generator=g, dtype=torch.uint8)
    perm = torch.randperm(num_pages, generator=g).int()
    table = torch.full((b, 1, hkv, row_len), -1, dtype=torch.int32)
    counts = torch.zeros(b, 1, hkv, 4, dtype=torch.int32)
    originals = {}
    cursor = 0
    for i in range(b):
        for h in range(hkv):
            hp, lp = pages_per[i][h]
            table[i, 0, h, :hp] = perm[cursor : cursor + hp]
            cursor += hp
            for j in range(lp):
                table[i, 0, h, row_len - 1 - j] = perm[cursor]
                cursor += 1
            counts[i, 0, h] = torch.tensor([n[i, h, 0], n[i, h, 1], hp, lp])
    for t, layout in enumerate(geometry.tiers):
        cap = int(n[..., t].max())
        loc = token_locations(
            table[:, 0], n[..., t], layout.tokens_per_page, low=t == 1, capacity=cap
        )
        for i in range(b):
            for h in range(hkv):
                m = loc.mask[i, h]
                k = torch.randn(int(m.sum()), d, generator=g) * 2
                v = torch.randn(int(m.sum()), d, generator=g)
                score = torch.rand(int(m.sum()), generator=g)
                pos = torch.randint(0, 1000, (int(m.sum()),), generator=g, dtype=torch.int32)
                write_tokens(
                    pages, layout, loc.page_ids[i, h][m], loc.slots[i, h][m], k, v, score, pos
                )
                originals[i, h, t] = (k, v, score, pos)
    return pages, table, counts, originals


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_paged_attention_equals_dense_attention_on_kept_tokens(head_dim, group):
    cfg = preset("qwq-32b")
    geometry = PageGeometry.for_config(cfg, head_dim)
    b, hkv = 3, 2
    pages, table, counts, orig = _random_cache(geometry, b, hkv, 150, seed=head_dim + group)
    q = torch.randn(b, hkv * group, head_dim, generator=torch.Generator().manual_seed(7))
    scale = head_dim**-0.5
    res = paged_decode_attention(q, pages, geometry, table, counts, torch.arange(b), 0, scale)
    for i in range(b):
        for h in range(hkv):
            ks, vs = [], []
            for t, tier in enumerate((cfg.high, cfg.low)):
                k, v, _, _ = orig[i, h, t]
                ks.append(fake_quantize(k, tier.key_bits, tier.key_groups))
                vs.append(fake_quantize(v, tier.value_bits, tier.value_groups))
            k, v = torch.cat(ks), torch.cat(vs)
            qh = q[i, h * group : (h + 1) * group]
            if k.shape[0] == 0:
                continue
            p = torch.softmax(qh @ k.T * scale, dim=-1)
            ref = p @ v
            got = res.out[i, h * group : (h + 1) * group]
            assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 1e-5
            nh = int(counts[i, 0, h, 0])
            pmax = p.amax(0)
            assert torch.allclose(res.prob_high[i, h, :nh], pmax[:nh], atol=1e-6)
            nl = int(counts[i, 0, h, 1])
            assert torch.allclose(res.prob_low[i, h, :nl], pmax[nh : nh + nl], atol=1e-6)
            assert torch.all(res.prob_high[i, h, nh:] == 0) and torch.all(
                res.prob_low[i, h, nl:] == 0
            )


def test_store_round_trip_and_score_accumulation():
    geometry = PageGeometry.for_config(preset("llama-3-8b"), 128)
    g = torch.Generator().manual_seed(11)
    for layout in geometry.tiers:
        pages = torch.randint(0, 256, (4, geometry.page_bytes), generator=g, dtype=torch.uint8)
        n = layout.tokens_per_page
        page_ids = torch.tensor([2] * n + [0] * 3, dtype=torch.int32)
        slots = torch.cat([torch.arange(n), torch.tensor([0, n - 1, 5])]).int()
        k = torch.randn(n + 3, 128, generator=g).to(torch.bfloat16)
        v = torch.randn(n + 3, 128, generator=g).to(torch.float16)
        score = torch.rand(n + 3, generator=g)
        pos = torch.arange(n + 3, dtype=torch.int32) * 7
        before = pages.clone()
        write_tokens(pages, layout, page_ids, slots, k, v, score, pos)
        assert torch.equal(pages[1], before[1]) and torch.equal(pages[3], before[3])
        data = read_tokens(pages, layout, page_ids, slots)
        t = layout.tier
        assert torch.equal(data.key, fake_quantize(k, t.key_bits, t.key_groups))
        assert torch.equal(data.value, fake_quantize(v, t.value_bits, t.value_groups))
        assert torch.equal(data.score, score) and torch.equal(data.pos, pos)
        add_scores(pages, layout, page_ids[:4], slots[:4], torch.tensor([1.0, 2.0, 3.0, 4.0]))
        s, p = read_scores(pages, layout, page_ids, slots)
        assert torch.allclose(s[:4], score[:4] + torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert torch.equal(s[4:], score[4:]) and torch.equal(p, pos)
        # bytes past the tier's used region are never touched
        assert torch.equal(pages[:, layout.used_bytes :], before[:, layout.used_bytes :])
