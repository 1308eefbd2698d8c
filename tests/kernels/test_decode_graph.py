"""CUDA-graph decode (``sglang.graphs.DecodeGraphState``) on a real ``torch.cuda.CUDAGraph``.

Three copies of one prefilled cache run the same decode steps:
- ``graph``: the policy step and attention of every layer captured once (every row padding
  at capture), then replayed from the static buffers;
- ``static``: the same static-buffer path run eagerly: the replay must match it bit for bit;
- ``eager``: the backend's eager kernel path (its own plans): same counters, outputs within
  bf16 rounding of the split-K partitioning.
Padding rows (stale q/k/v, pointing at the pad request) must leave the pad request empty.
"""

from __future__ import annotations

import pytest
import torch

from sglang_diffkv.cache import CompressedKVCache
from sglang_diffkv.config import DiffKVConfig

CONFIG = DiffKVConfig.from_dict({"preset": "llama-3-8b", "alpha_h": 2.0, "alpha_l": 0.5,
                                 "window": 8, "score_queries": 8})
LAYERS, HKV, HQ, D, MAX_REQS = 2, 4, 16, 128, 6
PAD = MAX_REQS - 1


def prefilled(device: str, seed: int) -> tuple[CompressedKVCache, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    cache = CompressedKVCache(CONFIG, head_dim=D, num_layers=LAYERS, num_kv_heads=HKV,
                              num_pages=3000, max_reqs=MAX_REQS, max_context=600,
                              device=device)
    req = torch.tensor([3, 0, 1], device=device)
    lens = torch.tensor([170, 97, 233])
    cache.begin_prefill(req, lens).raise_if_failed()
    lmax = int(lens.max())
    for layer in range(LAYERS):
        q, k, v = (torch.randn(3, h, lmax, D, generator=g).to(device, torch.bfloat16)
                   for h in (HQ, HKV, HKV))
        cache.prefill_layer(layer, req, lens.to(device), q, k, v, D**-0.5)
    cache.end_prefill(req)
    return cache, req, lens.to(device)


@pytest.mark.gpu
def test_replayed_graph_matches_the_static_and_eager_paths():
    from sglang_diffkv.sglang.graphs import DecodeGraphState
    from sglang_diffkv.sglang.ops import DiffKVOps

    base, req, lens = prefilled("cuda", seed=5)
    caches = {}
    for name in ("graph", "static", "eager"):
        caches[name] = CompressedKVCache(CONFIG, head_dim=D, num_layers=LAYERS,
                                         num_kv_heads=HKV, num_pages=3000, max_reqs=MAX_REQS,
                                         max_context=600, device="cuda")
        caches[name].copy_state_from(base)
    ops = {n: DiffKVOps(c, use_kernels=True) for n, c in caches.items()}
    bs, scale = 4, D**-0.5
    states = {n: DecodeGraphState(ops[n], PAD, max_bs=8, num_q_heads=HQ)
              for n in ("graph", "static")}
    q_buf = torch.empty(bs, HQ, D, dtype=torch.bfloat16, device="cuda")
    kv_buf = torch.empty(2, bs, HKV, D, dtype=torch.bfloat16, device="cuda")

    def static_forward(name: str) -> list[torch.Tensor]:
        st, o = states[name], ops[name]
        step = st.step(bs)
        outs = []
        for layer in range(LAYERS):
            o.decode_store(layer, st.req[:bs], st.positions[:bs], kv_buf[0], kv_buf[1],
                           step=step)
            outs.append(o.decode_attend(layer, st.req[:bs], q_buf, scale, step=step))
        return outs

    st = states["graph"]
    st.load(bs, req[:0], st.positions[:0])  # capture with every row padding
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_forward("graph")  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = static_forward("graph")
    assert not bool(caches["graph"].counts[PAD].any())

    g = torch.Generator(device="cpu").manual_seed(6)
    for t in range(12):
        positions = lens + t
        q_buf.copy_(torch.randn(bs, HQ, D, generator=g))  # row 3: padding with live data
        kv_buf.copy_(torch.randn(2, bs, HKV, D, generator=g))
        for name in ("graph", "static"):
            caches[name].begin_decode(req).raise_if_failed()
            states[name].load(bs, req, positions)
        caches["eager"].begin_decode(req).raise_if_failed()
        graph.replay()
        static_out = static_forward("static")
        e = ops["eager"]
        step = e.begin_decode_step(req, positions, int(positions.max()) + 1)
        for layer in range(LAYERS):
            e.decode_store(layer, req, positions, kv_buf[0, :3], kv_buf[1, :3], step=step)
            eager = e.decode_attend(layer, req, q_buf[:3], scale, step=step)
            assert torch.equal(graph_out[layer], static_out[layer]), (t, layer)
            err = (graph_out[layer][:3].float() - eager.float()).norm() / eager.float().norm()
            assert err < 1e-2, (t, layer, float(err))
        assert torch.equal(caches["graph"].pages, caches["static"].pages), t
        assert torch.equal(caches["graph"].counts, caches["static"].counts), t
        assert torch.equal(caches["graph"].counts, caches["eager"].counts), t
        assert not bool(caches["graph"].counts[PAD].any())
    assert not torch.equal(caches["graph"].counts, base.counts)  # the steps did store
