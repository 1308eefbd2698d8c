import pytest
import torch

from sglang_diffkv.policy import (
    DecodeAction,
    Tier,
    classify_prompt,
    contributing_queries,
    decode_step,
    group_max,
    prompt_attention_mass,
    thresholds,
    virtual_positions,
)

W = 4


def _decide(high, low, p=100, alpha_h=5.0, alpha_l=1.0, window=W):
    """high/low: lists of (score, pos). T_l = alpha_l/p, T_h = alpha_h/p."""

    def tier(tokens):
        cap = max(len(tokens), 1)
        score = torch.zeros(1, 1, cap)
        pos = torch.zeros(1, 1, cap, dtype=torch.int32)
        for i, (s, q) in enumerate(tokens):
            score[0, 0, i], pos[0, 0, i] = s, q
        return score, pos, torch.tensor([[len(tokens)]])

    sh, ph, nh = tier(high)
    sl, pl, nl = tier(low)
    d = decode_step(
        sh,
        ph,
        nh,
        sl,
        pl,
        nl,
        torch.tensor([p]),
        torch.tensor([alpha_h]),
        torch.tensor([alpha_l]),
        window,
    )
    return DecodeAction(int(d.action[0, 0])), int(d.hmin[0, 0]), int(d.lmin[0, 0])


# avg = score / (100 - pos); with pos = 0 the avg is score / 100. T_l = 0.01, T_h = 0.05.
def test_window_not_full_appends_regardless_of_scores():
    assert _decide([(0.0, 0), (0.0, 0)], [(0.0, 0)])[0] == DecodeAction.APPEND_HIGH


def test_evict_high_when_below_prune_threshold_and_below_low_min():
    high = [(3.0, 0), (0.5, 0), (4.0, 0), (2.0, 0)]  # hmin = slot 1, avg 0.005 < T_l
    low = [(0.9, 0), (3.0, 0)]  # lmin avg 0.009 > 0.005
    assert _decide(high, low) == (DecodeAction.EVICT_HIGH, 1, 0)


def test_evict_with_empty_low_tier():
    assert _decide([(6.0, 0), (0.2, 0), (6.0, 0), (6.0, 0), (6.0, 0)], []) == (
        DecodeAction.EVICT_HIGH,
        1,
        -1,
    )


def test_demote_into_pruned_low_slot():
    high = [(6.0, 0), (0.5, 0), (6.0, 0), (6.0, 0)]  # hmin avg 0.005 < T_l ...
    low = [(2.0, 0), (0.1, 0)]  # ... but lmin avg 0.001 is lower: demote hmin over lmin
    assert _decide(high, low) == (DecodeAction.DEMOTE_REPLACE, 1, 1)


def test_demote_and_append_low():
    high = [(6.0, 0), (6.0, 0), (3.0, 0), (6.0, 0)]  # hmin avg 0.03 in [T_l, T_h)
    low = [(2.0, 0)]  # lmin avg 0.02 >= T_l: nothing to prune in low
    assert _decide(high, low) == (DecodeAction.DEMOTE_APPEND, 2, 0)


def test_append_high_when_everything_is_significant():
    high = [(6.0, 0), (7.0, 0), (5.5, 0), (9.0, 0)]  # hmin avg 0.055 >= T_h
    assert _decide(high, [(0.1, 0)])[0] == DecodeAction.APPEND_HIGH


def test_tokens_inside_the_window_are_not_victims():
    # slot 0 is tiny but only 2 steps old (p - pos = 2 < W); slot 1 is the eligible min
    high = [(0.0, 98), (4.0, 0), (6.0, 0), (6.0, 0)]
    action, hmin, _ = _decide(high, [])
    assert (action, hmin) == (DecodeAction.DEMOTE_APPEND, 1)
    # nothing eligible at all: append
    assert _decide([(0.0, 99)] * 5, [(0.0, 99)])[0] == DecodeAction.APPEND_HIGH


def test_avg_divides_by_the_queries_that_scored():
    # same score, but the younger token was scored by fewer queries: higher avg
    high = [(1.0, 50), (1.0, 0), (9.0, 0), (9.0, 0)]  # avgs 0.02 and 0.01
    assert _decide(high, [], alpha_l=0.0)[1] == 1


def test_decisions_are_independent_per_request_and_head():
    g = torch.Generator().manual_seed(0)
    b, h, c = 3, 4, 20
    score = torch.rand(b, h, c, generator=g) * 5
    pos = torch.randint(0, 60, (b, h, c), generator=g, dtype=torch.int32)
    nh = torch.randint(0, c + 1, (b, h), generator=g)
    nl = torch.randint(0, c + 1, (b, h), generator=g)
    p = torch.tensor([100, 120, 140])
    ah, al = torch.tensor([5.0, 3.0, 1.0]), torch.tensor([1.0, 0.5, 0.0])
    d = decode_step(score, pos, nh, score.flip(-1), pos.flip(-1), nl, p, ah, al, W)
    for i in range(b):
        for j in range(h):
            one = decode_step(
                score[i : i + 1, j : j + 1],
                pos[i : i + 1, j : j + 1],
                nh[i : i + 1, j : j + 1],
                score.flip(-1)[i : i + 1, j : j + 1],
                pos.flip(-1)[i : i + 1, j : j + 1],
                nl[i : i + 1, j : j + 1],
                p[i : i + 1],
                ah[i : i + 1],
                al[i : i + 1],
                W,
            )
            assert int(one.action) == int(d.action[i, j])
            assert int(one.hmin) == int(d.hmin[i, j]) and int(one.lmin) == int(d.lmin[i, j])


# ---- prompt phase ------------------------------------------------------------------------------


def test_thresholds_are_clamped_not_asserted():
    t = thresholds(torch.tensor([3.0, 0.02]), torch.tensor([2, 100]))
    assert t.tolist() == pytest.approx([1.0, 0.0002])


def test_attention_mass_sums_to_the_number_of_scoring_queries():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    mass = prompt_attention_mass(q, k, 0.25, score_queries=8)
    assert mass.shape == (6, 40)
    assert torch.allclose(mass.sum(-1), torch.full((6,), 8.0), atol=1e-4)
    assert torch.all(mass[:, :32] >= 0)
    # causal: key 39 is seen only by the last query
    assert torch.all(mass[:, 39] <= 1.0)
    gm = group_max(mass, 2)
    assert torch.equal(gm[1], mass[3:].amax(0))
    # short prompt: Q = L
    assert torch.allclose(
        prompt_attention_mass(q[:, :5], k[:, :5], 0.25, 8).sum(-1), torch.full((6,), 5.0), atol=1e-4
    )


def test_virtual_position_counts_scoring_queries():
    length = torch.tensor([200, 30])
    count = contributing_queries(length, 200, 64)
    pos = virtual_positions(length, 200, 64)
    assert count[0, 0] == 64 and count[0, 199] == 1 and count[0, 136] == 64 and count[0, 137] == 63
    assert count[1, 0] == 30 and count[1, 29] == 1
    # at the first decode position p = L, p - pos = queries that scored the token
    assert torch.equal(length[:, None] - pos, count)


def _classify(sig, length, alpha_h, alpha_l, window=W, q=8):
    return classify_prompt(
        sig, torch.tensor(length), torch.tensor(alpha_h), torch.tensor(alpha_l), window, q
    )


def test_classification_against_alpha_over_length():
    length = 20
    count = contributing_queries(torch.tensor([length]), length, 8)[0].float()
    mean = torch.full((length,), 0.2)  # T_h = 2/20 = 0.1, T_l = 1/20 = 0.05
    mean[2], mean[5], mean[7] = 0.07, 0.01, 0.05  # low, pruned, low (boundary is inclusive)
    mean[17] = 0.0  # inside the recent window: stays high
    c = _classify((mean * count)[None, None], [length], [2.0], [1.0])
    tiers = c.tier[0, 0].tolist()
    assert tiers[2] == Tier.LOW and tiers[5] == Tier.PRUNED and tiers[7] == Tier.LOW
    assert tiers[17] == Tier.HIGH
    assert tiers.count(Tier.HIGH) == 17 and int(c.n_high) == 17 and int(c.n_low) == 2
    assert torch.allclose(c.score[0, 0], mean * count)


def test_prompt_shorter_than_window_stays_high():
    c = _classify(torch.zeros(1, 2, 3), [3], [3.0], [3.0])
    assert torch.all(c.tier == Tier.HIGH)


def test_thresholds_above_one_demote_or_prune_everything_outside_window():
    # alpha_h = 30 on L = 10: alpha / L = 3, clamped to 1; nothing reaches it
    sig = torch.full((1, 1, 10), 0.5) * contributing_queries(torch.tensor([10]), 10, 8)[:, None]
    c = _classify(sig, [10], [30.0], [0.1])
    assert c.tier[0, 0, :6].tolist() == [Tier.LOW] * 6
    assert c.tier[0, 0, 6:].tolist() == [Tier.HIGH] * 4


def test_padding_is_pruned_and_requests_use_their_own_thresholds():
    sig = torch.rand(2, 3, 30, generator=torch.Generator().manual_seed(3))
    c = _classify(sig, [30, 12], [0.0, 100.0], [0.0, 0.0])
    assert torch.all(c.tier[0] == Tier.HIGH)
    assert torch.all(c.tier[1, :, 12:] == Tier.PRUNED)
    assert torch.all(c.tier[1, :, :8] == Tier.LOW) and torch.all(c.tier[1, :, 8:12] == Tier.HIGH)
    assert c.n_high[1].tolist() == [4, 4, 4]
