"""The same manager on CUDA tensors: no host sync on the hot path, identical state to CPU.
The prefix-sharing sequences are ``test_memory_no_sync``'s (audited there on the CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from test_memory_no_sync import cuda_sync_errors, radix_sequence, sharing_sequence
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
    sharing_sequence("cuda", cuda_sync_errors)


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
    radix_sequence("cuda", cuda_sync_errors)
