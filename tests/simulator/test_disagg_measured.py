"""The bytes a disaggregated deployment sends, against what was measured: SGLang's own
start-up lines on the H100 runs of docs/data (the K and V buffers it allocated per token for
bf16 and fp8, the DiffKV backend's page geometry), and the pages the DiffKV backend's page
manager keeps for a compressed prompt, run on the CPU."""

from __future__ import annotations

import re
import tarfile

import numpy as np
import pytest
import torch
from sim_helpers import ROOT, scenario

from sglang_diffkv.config import preset
from sglang_diffkv.layout import PageGeometry
from sglang_diffkv.memory.manager import P_HIGH, P_LOW, PageManager
from sglang_diffkv.memory.spec import MemorySpec
from simulator.kv.mix import TierMix
from simulator.kv.transfer import KVTransfer
from simulator.studies.scenario import Scenario

LONGGEN = ROOT / "docs" / "data" / "h100-2026-11-22" / "e2e-s10-longgen"
GIB = 2**30


def _log(archive: str, member: str) -> str:
    with tarfile.open(LONGGEN / archive / "logs.tar.gz") as tf:
        f = tf.extractfile(member)
        assert f is not None
        return f.read().decode()


def _transfer(sc: Scenario, fmt: str) -> KVTransfer:
    srv = sc.server(fmt)
    d = srv.deployment
    return KVTransfer.for_format(d.kv_format, srv.pool, d.model, d.settings.tp)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_bytes_per_token_match_the_kv_buffers_sglang_allocated(fmt):
    text = _log("bf16-fp8", f"logs/server__{fmt}.log")
    m = re.search(r"KV Cache is allocated\. #tokens: (\d+), K size: ([\d.]+) GB, "
                  r"V size: ([\d.]+) GB", text)
    assert m, "start-up line missing"
    tokens, k_gib, v_gib = int(m[1]), float(m[2]), float(m[3])
    measured = (k_gib + v_gib) * GIB / tokens
    # SGLang prints GiB to two decimals: the measurement is good to 0.01 GiB over the pool
    tolerance = 0.01 * GIB / tokens
    model = _transfer(scenario(), fmt).prompt_bytes(1)
    assert abs(model - measured) <= tolerance
    assert model == {"bf16": 131072, "fp8": 65536}[fmt]


def test_diffkv_page_geometry_matches_the_backends_start_up_line():
    text = _log("diffkv", "logs/server__diffkv-mix.log")
    m = re.search(r"page (\d+) B; tokens per page: high (\d+), low (\d+); (\d+) \(layer, KV "
                  r"head\) rows per request", text)
    assert m
    g = scenario().server("diffkv").deployment.kv_format.geometry
    assert (g.page_bytes, g.high.tokens_per_page, g.low.tokens_per_page) == tuple(
        int(x) for x in m.groups()[:3])
    assert int(m[4]) == 32 * 8
    assert _transfer(scenario(), "diffkv").unit_bytes == int(m[1])


@pytest.mark.parametrize("tokens", [50, 700, 3000])
@pytest.mark.parametrize("per_head", [False, True])
def test_diffkv_bytes_are_the_pages_the_backends_page_manager_keeps(tokens, per_head):
    cfg = preset("llama-3-8b")
    g = PageGeometry.for_config(cfg, 128)
    layers, heads = 32, 8
    rng = np.random.default_rng(tokens)
    if per_head:   # every (layer, head) its own kept fractions, as a measured mix file gives
        hi = rng.uniform(0.05, 0.6, layers * heads)
        fr = np.stack([hi, rng.uniform(0.0, 1.0, layers * heads) * (1 - hi)], 1)
        mix = TierMix.from_heads([(float(a), float(b)) for a, b in fr])
    else:
        mix = TierMix(0.3, 0.5)
        fr = np.tile([[0.3, 0.5]], (layers * heads, 1))
    base = scenario()
    sc = Scenario(base.model, base.gpu, base.calibration, base.settings, cfg, mix)
    want = _transfer(sc, "diffkv").prompt_bytes(tokens)
    # the backend's own page manager: the prompt all-high, then compressed per row
    spec = MemorySpec.from_geometry(g, num_pages=200_000, max_reqs=1, num_layers=layers,
                                    num_kv_heads=heads, max_context=8192)
    pm = PageManager(spec)
    assert bool(pm.allocate_prefill([0], [tokens]).ok.all())
    recent = min(tokens, cfg.window)
    old = tokens - recent
    n_high = torch.as_tensor(recent + np.floor(fr[:, 0] * old)).view(1, layers, heads)
    n_low = torch.as_tensor(np.floor(fr[:, 1] * old)).view(1, layers, heads)
    pm.reclaim_prefill([0], n_high, n_low)
    pm.check_invariants()
    pages = int((pm.counts[0, ..., P_HIGH] + pm.counts[0, ..., P_LOW]).sum())
    assert want == pages * g.page_bytes


def test_the_prefill_and_decode_replicas_beside_the_measured_azure_code_runs():
    """docs/disaggregation.md's validation table: the held-out H200 runs on Azure-code
    lengths (long prompts, short outputs), where a colocated server mostly prefills."""
    from simulator.validation.disagg_pieces import DATA, compare

    rows = {r["rate"]: r for r in compare(DATA)}
    assert set(rows) == {4, 8, 12}
    for rate in (4, 8):          # below saturation: the colocated replay is within 5%
        r = rows[rate]
        assert abs(r["ttft_colocated"] / r["ttft_measured"] - 1) < 0.05
        # the prefill replica skips the decode steps a colocated prompt waits behind
        assert r["ttft_prefill_replica"] < r["ttft_colocated"]
        assert abs(r["ttft_prefill_replica"] / r["ttft_measured"] - 1) < 0.10
        # the decode replica never shares a step with a prefill
        assert r["tpot_decode_replica"] < 0.7 * r["tpot_measured"]
