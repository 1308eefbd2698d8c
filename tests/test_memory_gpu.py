"""The same manager on CUDA tensors: no host sync on the hot path, identical state to CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from test_memory_properties import PageManagerMachine
from test_memory_sharing import SharingMachine

from sglang_diffkv.memory import MemorySpec, PageManager

pytestmark = pytest.mark.gpu

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPEC = MemorySpec(
    num_pages=48, max_reqs=6, num_layers=2, num_kv_heads=2,
    high_tokens_per_page=2, low_tokens_per_page=3, max_context=12,
)


def run_ops(m: PageManager) -> list[torch.Tensor]:
    """A fixed workload with every op, an exhaustion and ring wrap-around; returns the ok
    flags (left on the device)."""
    dev = m.device
    t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    oks = []
    for cycle in range(4):
        reqs = t([cycle % 3, 3 + cycle % 3])
        oks.append(m.allocate_prefill(reqs, t([5 + cycle, 3])).ok)
        oks.append(m.allocate_prefill(t([cycle % 3 ^ 1]), t([12])).ok)  # too big at times
        n_high = torch.tensor([[[2, 0], [3, 1]], [[1, 1], [0, 3]]], device=dev)
        n_low = torch.tensor([[[3, 1], [0, 4]], [[2, 0], [1, 0]]], device=dev)
        m.reclaim_prefill(reqs, n_high, n_low)
        for step in range(5):
            tiers = t([[True, step % 2 == 0], [step % 3 == 0, True]])
            oks.append(m.ensure_decode_room(reqs, tiers).ok)
            m.add_tokens(reqs, t([[1, 0], [0, 0]]) * oks[-1])
        m.free_requests(reqs)
        done = (m.phase[: SPEC.max_reqs] == 1).nonzero().view(-1).tolist()  # test-only sync
        if done:
            m.free_requests(t(done))
    return oks


@requires_cuda
def test_hot_path_never_syncs_and_matches_cpu() -> None:
    cpu = PageManager(SPEC, "cpu")
    cpu_oks = run_ops(cpu)
    gpu = PageManager(SPEC, "cuda", validate=False)
    on = {"device": "cuda"}
    req = torch.tensor([5], **on)
    ones = torch.ones(1, 2, 2, dtype=torch.int64, **on)
    tiers = torch.ones(1, 2, dtype=torch.bool, **on)
    deltas = torch.ones(1, 2, dtype=torch.int64, **on)
    lens = torch.tensor([4], **on)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        gpu.allocate_prefill(req, lens)
        gpu.reclaim_prefill(req, ones, ones)
        gpu.ensure_decode_room(req, tiers)
        gpu.add_tokens(req, deltas)
        gpu.free_requests(req)
        gpu.num_free_pages()
        gpu.num_free_pages_host()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gpu.check_invariants()
    gpu_oks = run_ops(gpu)
    assert [bool(x) for x in gpu_oks] == [bool(x) for x in cpu_oks]
    assert not all(bool(x) for x in cpu_oks), "the workload should hit exhaustion"
    a = cpu.snapshot()
    b = gpu.snapshot()
    # The GPU manager ran one extra request first, so compare structure, not ids.
    assert torch.equal(a["counts"], b["counts"].cpu())
    assert torch.equal(a["phase"], b["phase"].cpu())
    assert torch.equal(a["table"] >= 0, b["table"].cpu() >= 0)
    gpu.check_invariants()
    gpu.allocate_prefill(torch.tensor([0], **on), torch.tensor([3], **on))
    gpu.num_free_pages_host()  # enqueues a copy of the current count
    torch.cuda.synchronize()
    assert gpu.num_free_pages_host() == int(gpu.num_free_pages()) == SPEC.num_pages - 4 * 3


class CudaPageManagerMachine(PageManagerMachine):
    device = "cuda"


CudaPageManagerMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=20, deadline=None
)
TestCudaPageManagerMachine = requires_cuda(CudaPageManagerMachine.TestCase)


@requires_cuda
def test_sharing_ops_never_sync() -> None:
    """export / attach / release / free with shared pages: all on the device (the handles'
    host work is list bookkeeping, never a read of device values)."""
    m = PageManager(SPEC, "cuda", validate=False)
    on = {"device": "cuda"}
    m.allocate_prefill(torch.tensor([1], **on), torch.tensor([9], **on))
    m.reclaim_prefill(torch.tensor([1], **on), torch.full((1, 2, 2), 5, **on),
                      torch.full((1, 2, 2), 4, **on))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (h,), res, copies = m.export_prefix(torch.tensor([1], **on), [9])
        res2, copies2 = m.attach_prefix(torch.tensor([2, 3], **on), [h, h])
        m.ensure_decode_room(torch.tensor([1, 2, 3], **on), torch.ones(3, 2, dtype=torch.bool,
                                                                       **on))
        m.free_requests(torch.tensor([1, 2], **on))
        m.release_prefix([h])
        m.free_requests(torch.tensor([3], **on))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(res.ok) and bool(res2.ok) and int(copies.mask.sum()) == 8  # 4 rows x 2
    m.check_invariants()
    assert int(m.num_free_pages()) == SPEC.num_pages


class CudaSharingMachine(SharingMachine):
    device = "cuda"


CudaSharingMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=20, deadline=None
)
TestCudaSharingMachine = requires_cuda(CudaSharingMachine.TestCase)


@requires_cuda
def test_radix_ops_never_sync() -> None:
    """What radix prefix sharing runs per prompt: a copy export with its cut counts and a
    decode reserve, the sync-free page copy, attaches at a cut (shared and copied), a suffix
    reserved and reclaimed, releases: all on the device."""
    from sglang_diffkv.memory import copy_pages

    spec = MemorySpec(num_pages=96, max_reqs=6, num_layers=2, num_kv_heads=2,
                      high_tokens_per_page=2, low_tokens_per_page=3, max_context=12)
    m = PageManager(spec, "cuda", validate=False)
    on = {"device": "cuda"}
    pages = torch.zeros(spec.num_pages, 16, dtype=torch.uint8, **on)
    m.allocate_prefill(torch.tensor([1], **on), torch.tensor([9], **on))
    m.reclaim_prefill(torch.tensor([1], **on), torch.full((1, 2, 2), 5, **on),
                      torch.full((1, 2, 2), 4, **on))
    cuts = torch.zeros(1, 2, 2, 3, 2, dtype=torch.int32, **on)
    cuts[..., 0], cuts[..., 1] = 2, 1  # (2 high and 1 low token before position 3, ...)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (h,), res, copies = m.export_prefix(torch.tensor([1], **on), [9], copy=True,
                                            keep_free=4, cuts=cuts, cut_len=3)
        copy_pages(pages, copies)
        res2, copies2 = m.attach_prefix(torch.tensor([2], **on), [h], h.cut_counts(3)[None])
        copy_pages(pages, copies2)
        res3, _ = m.attach_prefix(torch.tensor([3], **on), [h], h.cut_counts(6)[None],
                                  copy=True)
        room = m.reserve_extend(torch.tensor([2, 3], **on), [4, 2])
        m.reclaim_extend(torch.tensor([2, 3], **on), torch.full((2, 2, 2), 4, **on),
                         torch.full((2, 2, 2), 2, **on))
        m.free_requests(torch.tensor([1, 2], **on))
        m.release_prefix([h])
        m.free_requests(torch.tensor([3], **on))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(res.ok) and bool(res2.ok) and bool(res3.ok) and bool(room.ok)
    m.check_invariants()
    assert int(m.num_free_pages()) == spec.num_pages
