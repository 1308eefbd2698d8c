"""``host_audit.HostAudit`` counts what its docstring says, per section, on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_diffkv.host_audit import HostAudit


def test_syncs_uploads_and_launches_are_told_apart():
    x = torch.arange(6)
    mask = x > 2
    with HostAudit() as audit:
        with audit.section("syncs"):
            x.tolist()
            int(x[0])
            bool(mask.any())
            x[mask]
            y = x.clone()
            y[mask] = 0
            mask.nonzero()
            x.repeat_interleave(x)
        with audit.section("uploads"):
            torch.tensor([1, 2])
            x[[0, 1]]
        with audit.section("free"):
            x.view(2, 3).transpose(0, 1)
            torch.empty(3)
            x.repeat_interleave(x, output_size=15)
            x + 1
        x.tolist()  # (outside every section: not counted)
    s = audit.sections
    # tolist, int, bool, masked index, masked put, nonzero, repeat_interleave
    assert s["syncs"]["syncs"] == 7
    assert "syncs:Tensor.tolist" in s["syncs"].detail
    assert s["uploads"]["uploads"] == 2 and s["uploads"]["syncs"] == 0
    assert s["free"]["syncs"] == s["free"]["uploads"] == 0
    # repeat_interleave(output_size) (its index op and the gather) and the add
    assert s["free"]["launches"] == 3
    assert "tolist" not in torch.Tensor.__dict__  # (patches undone)


def test_watch_wraps_and_restores():
    class Thing:
        def work(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2

    before = Thing.__dict__["work"]
    ones = torch.ones(2)
    with HostAudit() as audit:
        audit.watch(Thing, "work", "thing")
        Thing().work(ones)
        with audit.section("outer"):
            Thing().work(ones)  # the innermost section counts it
    assert audit.sections["thing"]["launches"] == 2 and "outer" not in audit.sections
    assert Thing.__dict__["work"] is before


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="a Triton launch on the CPU needs TRITON_INTERPRET=1")
def test_triton_launches_are_counted_without_their_copies():
    from sglang_diffkv.config import DiffKVConfig
    from sglang_diffkv.kernels import store_tokens
    from sglang_diffkv.layout import PageGeometry

    geo = PageGeometry.for_config(DiffKVConfig.from_dict({"preset": "llama-3-8b"}), 64)
    pages = torch.zeros(2, geo.page_bytes, dtype=torch.uint8)
    ids, slots = torch.zeros(3, dtype=torch.int32), torch.arange(3, dtype=torch.int32)
    kv, score, pos = torch.randn(3, 64), torch.zeros(3), torch.zeros(3, dtype=torch.int32)
    with HostAudit() as audit, audit.section("store"):
        store_tokens(pages, geo.high, ids, slots, kv, kv, score, pos)
    st = audit.sections["store"]
    assert st["triton"] == 1 and st["syncs"] == 0 and st["uploads"] == 0
    assert st["ops"] < 10  # (the interpreter's own tensor copies are not counted)
