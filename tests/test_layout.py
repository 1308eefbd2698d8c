import pytest

from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED, ConfigError, preset
from sglang_diffkv.layout import (
    DIFFKV_TIER_FAMILY,
    PageGeometry,
    TierLayout,
    fp16_bytes_per_token,
    geometry_table,
    ideal_bit_ratio,
    search_page_bytes,
)


def test_diffkv_head_dim_128_test_vector():
    assert search_page_bytes(128, DIFFKV_TIER_FAMILY) == 6784
    tokens = {t.name: TierLayout.build(t, 128, 6784).tokens_per_page for t in DIFFKV_TIER_FAMILY}
    assert tokens == {"K8V4g12": 32, "K8V4": 32, "K4V2g24": 52, "K4V2": 60}


@pytest.mark.parametrize(
    "tier, offsets, end",
    [
        (K8V4_GROUPED, (0, 4096, 4224, 6272, 6528, 6656), 6784),
        (K8V4, (0, 4096, 4224, 6272, 6400, 6528), 6656),
        (K4V2_GROUPED, (0, 3328, 3840, 5504, 6336, 6544), 6752),
        (K4V2, (0, 3840, 4096, 6016, 6272, 6512), 6752),
    ],
)
def test_segment_offsets_match_diffkv(tier, offsets, end):
    t = TierLayout.build(tier, 128, 6784)
    assert tuple(t.offsets().values()) == offsets
    assert t.used_bytes == end
    assert t.value_offset % 128 == 0 and t.score_offset % 32 == 0 and t.pos_offset % 4 == 0


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", ["default", "llama-3-8b", "qwq-32b"])
def test_every_head_dim_gets_a_tight_page(head_dim, name):
    g = PageGeometry.for_config(preset(name), head_dim)
    assert g.page_bytes % 32 == 0
    assert g.high.tokens_per_page >= 32
    for t in g.tiers:
        assert t.used_bytes <= g.page_bytes
        assert t.waste_fraction <= 0.02
        # one more token would not fit
        from sglang_diffkv.layout import segment_offsets

        assert segment_offsets(t.tier, head_dim, t.tokens_per_page + 1)[1] > g.page_bytes
        assert t.physical_ratio > t.ideal_bit_ratio
    assert g.low.tokens_per_page > g.high.tokens_per_page


def test_bytes_per_token_and_ratios():
    t = TierLayout.build(K8V4, 128, 6784)
    assert t.bytes_per_token == 6784 / 32
    assert fp16_bytes_per_token(128) == 512
    assert ideal_bit_ratio(K8V4) == 0.375 and ideal_bit_ratio(K4V2) == 0.1875
    g = PageGeometry.build(128, K8V4_GROUPED, K4V2_GROUPED)
    assert g.page_bytes == 6784
    assert g.bytes_per_token(0.3, 0.5) == pytest.approx(0.3 * 212 + 0.5 * 6784 / 52)
    assert g.row_len(8192) == -(-8192 // 32) + 2
    assert g.pages_for(33, 53) == 4


def test_unsupported_head_dim_and_groups_are_refused():
    with pytest.raises(ConfigError, match="head_dim=96 is not supported"):
        PageGeometry.for_config(preset("default"), 96)


def test_geometry_table_rows():
    rows = geometry_table((64, 128))
    assert len(rows) == 8
    row = next(r for r in rows if r["head_dim"] == 128 and r["tier"] == "K4V2")
    assert row["tokens_per_page"] == 60 and row["page_bytes"] == 6784
