"""Host work of chunked + radix prefill steps on the kernel path (``host_profile``'s
scenario under SGLang's own scheduler classes, TRITON_INTERPRET=1): no host sync and no
host-to-device upload in any per-layer component, so a step's syncs do not depend on the
number of layers (the same steps with 2 and 4 layers count the same), a constant number of
Triton launches per layer, and the outputs equal the reference path's within bf16 rounding.
"""

from __future__ import annotations

import os

import pytest
from host_profile import PER_LAYER, run_scenario
from test_chunked_prefill import assert_kernel_run_matches_reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")

# per layer and step, at most (the scenario's measured counts, docs/backend.md stage 2,
# with room for a request more or less per step: a regression to per-request torch work
# costs hundreds)
MAX_OPS_PER_LAYER = 200


def test_kernel_path_syncs_do_not_grow_with_layers(monkeypatch):
    runs = {}
    for layers in (2, 4):
        with monkeypatch.context() as mp:
            runs[layers] = run_scenario(mp, kernels=True, num_layers=layers)[1]
    two, four = runs[2], runs[4]
    assert [s.chunks for s in two] == [s.chunks for s in four]
    assert len(two) == 4
    for a, b in zip(two, four, strict=True):
        for cat in ("syncs", "uploads"):
            assert a.count(cat, per_layer=True) == b.count(cat, per_layer=True) == 0, (
                a.chunks, cat, {n: dict(s.detail) for n, s in b.audit.sections.items()
                                if n in PER_LAYER})
            assert a.count(cat) == b.count(cat), (a.chunks, cat)
        # the same launches in every layer
        assert 2 * a.count("triton", per_layer=True) == b.count("triton", per_layer=True)
        assert b.count("ops", per_layer=True) <= 4 * MAX_OPS_PER_LAYER, a.chunks


def test_kernel_path_scenario_matches_the_reference_path(monkeypatch):
    """The scenario's outputs on both paths (radix hits with suffixes in one and two
    chunks, a prompt whose last chunk is shorter than score_queries, whole prompts, all
    sharing steps) and the counters after every step."""
    runs = []
    for kernels in (True, False):
        with monkeypatch.context() as mp:
            s, _ = run_scenario(mp, kernels=kernels)
        assert s.runner.attn_backend.ops.use_kernels == kernels
        runs.append(s)
    assert_kernel_run_matches_reference(*runs)
