"""The device traffic of one layer's prompt-end store (``tests/extend_end_cost.py``,
``sglang_diffkv.traffic_audit``) at a small shape under TRITON_INTERPRET=1: the gather
writes fp32 keys only (one row per position) and the stored tokens' kept bytes; the column
sums run over each prompt's span, not its attached prefix; the LSE pass over every key;
and the audit's own counts are what the kernels' arguments say."""

from __future__ import annotations

import os

import pytest
from extend_case import CFG, HKV, D, G
from extend_end_cost import Case, served_case
from test_extend_stores import Shape

from sglang_diffkv.kernels.extend_store import raw_bytes

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels run on the CPU under the interpreter")


def test_prompt_end_traffic_per_layer():
    case = Case(prefix=128, stored=192, fresh=64, whole=128, exporter_extra=64)
    res = served_case(case, Shape(), CFG)
    a = res.audit
    # ends: the radix suffix (A = 128, S = 0, F = 64) and the last chunk (A = 0, S = 192)
    totals, attached, stored = [case.prefix + case.fresh, case.stored + case.fresh], \
        [case.prefix, 0], [0, case.stored]
    gather = a.launches["end: gather"]["_gather_kernel"]
    high = raw_bytes(res.cache.geometry.high)
    assert gather.unique_stored == (sum(totals) * HKV * D * 4 + sum(stored) * HKV * high
                                    + 2 * HKV * 4)  # (and key_first)
    scores = a.launches["end: scores"]
    qb, bk = 16, 64  # (score_queries 8 rounded up to the scoring's 16-row tile)
    spans = [t - att for t, att in zip(totals, attached, strict=True)]
    colsum = sum(HKV * -(-s // bk) for s in spans) * G * qb * D * bk
    assert sum(scores["_colsum_kernel"].dot_fma.values()) == colsum
    lse = sum(HKV * G * -(-t // bk) for t in totals) * qb * D * bk
    assert sum(scores["_lse_kernel"].dot_fma.values()) == lse
    assert scores["_colsum_kernel"].grids == [(2, HKV, -(-max(spans) // bk))]
    assert scores["_lse_kernel"].grids == [(2, HKV * G)]
