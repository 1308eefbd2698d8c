"""KV bytes on the wire per format, from the layout module by hand, and the link queues:
transfers on one link run one after another, on different links at once."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import simpy
from sim_helpers import scenario

from sglang_diffkv.config import preset
from sglang_diffkv.layout import PageGeometry, fp16_bytes_per_token
from simulator.engine.link import KVLinks
from simulator.errors import SimulatorInputError
from simulator.kv.transfer import KVTransfer
from simulator.specs.link import LinkSpec, link_names, load_link

ONE_GPU_PD_RUN = (Path(__file__).resolve().parents[2] / "docs/data"
                  / "h200-2026-11-28-session44/pd-one-gpu/call-pd")


def _transfer(fmt: str, **settings: object) -> KVTransfer:
    sc = scenario(**settings)
    srv = sc.server(fmt)
    d = srv.deployment
    return KVTransfer.for_format(d.kv_format, srv.pool, d.model, d.settings.tp)


@pytest.mark.parametrize("tokens", [1, 777, 4096])
def test_bf16_and_fp8_bytes_are_the_layouts_bytes_per_token(tokens):
    # Llama-3-8B: 32 layers, 8 KV heads of head_dim 128
    per_token = 32 * 8 * fp16_bytes_per_token(128)
    assert per_token == 131072                      # 128 KiB, SGLang's logged K + V size
    bf16, fp8 = _transfer("bf16"), _transfer("fp8")
    assert bf16.prompt_bytes(tokens) == tokens * per_token
    assert fp8.prompt_bytes(tokens) == tokens * per_token / 2
    assert bf16.prefix_bytes(tokens) == bf16.prompt_bytes(tokens)
    assert bf16.streams_chunks and fp8.streams_chunks


def test_tp_sends_each_ranks_own_heads():
    assert _transfer("bf16", tp=2).prompt_bytes(100) == 100 * 32 * 4 * 512


@pytest.mark.parametrize("tokens", [40, 64, 1000, 5000])
def test_diffkv_bytes_are_its_pages_as_stored_counted_by_hand(tokens):
    cfg = preset("llama-3-8b")
    g = PageGeometry.for_config(cfg, 128)
    window = cfg.window
    recent = min(tokens, window)
    old = tokens - recent
    high = recent + math.floor(0.3 * old)           # the default 30/50/20 mix
    low = math.floor(0.5 * old)
    pages_per_head = math.ceil(high / g.high.tokens_per_page) + math.ceil(
        low / g.low.tokens_per_page)
    want = 32 * 8 * pages_per_head * g.page_bytes   # whole pages: metadata and tails too
    t = _transfer("diffkv")
    assert not t.streams_chunks
    assert t.prompt_bytes(tokens) == want
    # smaller than bf16 by about the physical ratio of the mix
    if tokens >= 1000:
        ratio = _transfer("bf16").prompt_bytes(tokens) / want
        assert 3.5 < ratio < 4.6


def test_wire_time_is_latency_plus_bytes_over_rate_and_scales_with_the_bytes():
    rdma = load_link("rdma-100")
    assert rdma.bandwidth == 12.5e9 and rdma.efficiency == 1.0
    assert rdma.transfer_s(25e9) == pytest.approx(rdma.latency_s + 2.0)
    derated = LinkSpec("x", "x", 10e9, 0.8, 0.0, "test")
    assert derated.transfer_s(8e9) == pytest.approx(1.0)
    assert set(link_names()) == {"nvlink4", "pcie5", "rdma-100", "rdma-200", "rdma-400",
                                 "tcp-loopback"}


def test_the_tcp_loopback_link_is_the_committed_probe_measurement():
    # the bundled entry must stay what the committed one-GPU run measured, not a guess
    from simulator.validation.disagg_real import load_pd_results, measured_link

    tcp = load_link("tcp-loopback")
    fit = measured_link(load_pd_results([ONE_GPU_PD_RUN]))
    assert tcp.bandwidth * tcp.efficiency == pytest.approx(fit.bandwidth * fit.efficiency,
                                                           rel=0.01)
    assert tcp.latency_s == pytest.approx(fit.latency_s, abs=1e-4)
    assert "PLACEHOLDER" not in tcp.describe() and "measured" in tcp.name


@pytest.mark.parametrize("bad, needle", [
    ({"efficiency": 1.5}, "efficiency=1.5 must be in (0, 1]"),
    ({"bandwidth": 0}, "bandwidth=0.0 must be a number > 0"),
    ({"latency_s": -1}, "latency_s=-1.0 must be a number >= 0"),
])
def test_a_bad_link_spec_is_one_clear_error(tmp_path, bad, needle):
    f = tmp_path / "mylink.json"
    spec = {"name": "n", "bandwidth": 1e9, "efficiency": 1, "latency_s": 0,
            "provenance": "test", **bad}
    import json
    f.write_text(json.dumps(spec))
    with pytest.raises(SimulatorInputError, match=f"link 'mylink': {needle}".replace(
            "(", r"\(").replace(")", r"\)")):
        load_link(str(f))
    with pytest.raises(SimulatorInputError, match="unknown link 'tcp'"):
        load_link("tcp")


def _run_transfers(scope: str, routes: list[tuple[int, int]], nbytes: float) -> list[float]:
    env = simpy.Environment()
    spec = LinkSpec("t", "test", 1e9, 1.0, 1e-3, "test")
    links = KVLinks(env, spec, 2, 2, scope)
    done: list[float] = [math.nan] * len(routes)
    for i, (p, d) in enumerate(routes):
        links.send(p, d, nbytes, lambda _s, _w, i=i: done.__setitem__(i, env.now))
    env.run()
    return done


def test_two_transfers_on_one_link_serialise_and_on_different_links_do_not():
    one = 1e-3 + 0.5                                # latency + 0.5 GB at 1 GB/s
    assert _run_transfers("pair", [(0, 0), (0, 0)], 5e8) == pytest.approx([one, 2 * one])
    assert _run_transfers("pair", [(0, 0), (1, 1)], 5e8) == pytest.approx([one, one])
    assert _run_transfers("pair", [(0, 0), (0, 1)], 5e8) == pytest.approx([one, one])
    # one port per GPU: a prefill replica's sends share its port, a decode replica's
    # receives share its port
    assert _run_transfers("gpu", [(0, 0), (0, 1)], 5e8) == pytest.approx([one, 2 * one])
    assert _run_transfers("gpu", [(0, 0), (1, 0)], 5e8) == pytest.approx([one, 2 * one])
    assert _run_transfers("gpu", [(0, 0), (1, 1)], 5e8) == pytest.approx([one, one])
    # head-of-line: the second holds its send port while it waits for the receive port,
    # so the third, whose receive port is free, waits for that send port
    assert _run_transfers("gpu", [(0, 0), (1, 0), (1, 1)], 5e8) == pytest.approx(
        [one, 2 * one, 3 * one])
    assert _run_transfers("gpu", [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0)], 5e8) == (
        pytest.approx([one, 2 * one, 2 * one, 3 * one, 3 * one]))


def test_a_link_is_fifo_and_counts_what_it_carried():
    env = simpy.Environment()
    links = KVLinks(env, LinkSpec("t", "t", 1e9, 1.0, 0.0, "t"), 1, 1)
    order: list[int] = []
    for i, b in enumerate([3e8, 1e8, 2e8]):
        links.send(0, 0, b, lambda _s, _w, i=i: order.append(i))
    env.run()
    assert order == [0, 1, 2] and env.now == pytest.approx(0.6)
    (port,) = links.ports
    assert port.transfers == 3 and port.bytes == 6e8 and port.busy_s == pytest.approx(0.6)
    with pytest.raises(SimulatorInputError, match="link scope 'rack'"):
        KVLinks(env, LinkSpec("t", "t", 1e9, 1.0, 0.0, "t"), 1, 1, "rack")


def test_compressed_kv_cuts_the_wire_time_by_its_byte_ratio():
    # one prompt alone on a link with no latency: wire time = bytes / rate exactly
    from sglang_diffkv.serving_io.trace import Trace, TraceRequest
    from simulator.engine.disagg import simulate_disagg

    sc = scenario()
    link = LinkSpec("slow", "slow", 1e9, 1.0, 0.0, "test")
    trace = Trace((TraceRequest(0.0, 3000, 4),))
    wire = {}
    for fmt in ("bf16", "diffkv"):
        res = simulate_disagg(trace, sc.server(fmt), 1, 1, link)
        rec = res.meta["kv"][0]
        wire[fmt] = (rec.wire_s, rec.bytes)
        assert rec.bytes == _transfer(fmt).prompt_bytes(3000)
    ratio = wire["bf16"][1] / wire["diffkv"][1]
    assert ratio > 3.5
    assert wire["bf16"][0] / wire["diffkv"][0] == pytest.approx(ratio, rel=1e-12)
    assert np.isclose(wire["bf16"][0], wire["bf16"][1] / 1e9)
