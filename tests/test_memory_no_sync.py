"""The prefix-sharing op sequences that ``test_memory_gpu`` runs under CUDA's sync-debug
"error" mode, audited on the CPU (``host_audit.HostAudit``): no sync and no upload inside
the region the GPU test checks, so CPU CI catches a regression that only a GPU run would
otherwise show. Also what ``copy_pages`` copies, and the manager's host-int staging."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch

from sglang_diffkv.host_audit import HostAudit
from sglang_diffkv.memory import MemorySpec, PageCopies, PageManager, copy_pages
from sglang_diffkv.memory.inputs import as_int64

# the region the sequence must run without a host sync (GPU: sync-debug "error" mode; CPU:
# an audit section)
Region = Callable[[], AbstractContextManager]

SHARING_SPEC = MemorySpec(num_pages=48, max_reqs=6, num_layers=2, num_kv_heads=2,
                          high_tokens_per_page=2, low_tokens_per_page=3, max_context=12)
RADIX_SPEC = MemorySpec(num_pages=96, max_reqs=6, num_layers=2, num_kv_heads=2,
                        high_tokens_per_page=2, low_tokens_per_page=3, max_context=12)


def _prefilled(spec: MemorySpec, device: str) -> PageManager:
    """Request 1 prefilled with 9 tokens and reclaimed to (5 high, 4 low) per row."""
    m = PageManager(spec, device, validate=False)
    on = {"device": device}
    m.allocate_prefill(torch.tensor([1], **on), torch.tensor([9], **on))
    m.reclaim_prefill(torch.tensor([1], **on), torch.full((1, 2, 2), 5, **on),
                      torch.full((1, 2, 2), 4, **on))
    return m


def sharing_sequence(device: str, region: Region) -> None:
    """export / attach / release / free with shared pages (the handles' host work is list
    bookkeeping, never a read of device values)."""
    m = _prefilled(SHARING_SPEC, device)
    on = {"device": device}
    # The slot tensors are made before the region: a tensor made from a host list on the
    # device is a pageable copy, which synchronises (the caller's cost, not the ops').
    r1, r3 = torch.tensor([1], **on), torch.tensor([3], **on)
    r12, r23 = torch.tensor([1, 2], **on), torch.tensor([2, 3], **on)
    r123 = torch.tensor([1, 2, 3], **on)
    with region():
        (h,), res, copies = m.export_prefix(r1, [9])
        res2, _ = m.attach_prefix(r23, [h, h])
        m.ensure_decode_room(r123, torch.ones(3, 2, dtype=torch.bool, **on))
        m.free_requests(r12)
        m.release_prefix([h])
        m.free_requests(r3)
    assert bool(res.ok) and bool(res2.ok) and int(copies.mask.sum()) == 8  # 4 rows x 2
    m.check_invariants()
    assert int(m.num_free_pages()) == SHARING_SPEC.num_pages


def radix_sequence(device: str, region: Region) -> None:
    """What radix prefix sharing runs per prompt: a copy export with its cut counts and a
    decode reserve, the page copies, attaches at a cut (shared and copied), a suffix
    reserved (host lengths, as the radix path passes them) and reclaimed, releases."""
    spec = RADIX_SPEC
    m = _prefilled(spec, device)
    on = {"device": device}
    pages = torch.zeros(spec.num_pages, 16, dtype=torch.uint8, **on)
    cuts = torch.zeros(1, 2, 2, 3, 2, dtype=torch.int32, **on)
    cuts[..., 0], cuts[..., 1] = 2, 1  # (2 high and 1 low token before position 3, ...)
    # (slot tensors before the region: see sharing_sequence)
    r1, r2, r3 = (torch.tensor([r], **on) for r in (1, 2, 3))
    r12, r23 = torch.tensor([1, 2], **on), torch.tensor([2, 3], **on)
    with region():
        (h,), res, copies = m.export_prefix(r1, [9], copy=True, keep_free=4, cuts=cuts,
                                            cut_len=3)
        copy_pages(pages, copies)
        res2, copies2 = m.attach_prefix(r2, [h], h.cut_counts(3)[None])
        copy_pages(pages, copies2)
        res3, _ = m.attach_prefix(r3, [h], h.cut_counts(6)[None], copy=True)
        room = m.reserve_extend(r23, [4, 2])
        m.reclaim_extend(r23, torch.full((2, 2, 2), 4, **on), torch.full((2, 2, 2), 2, **on))
        m.free_requests(r12)
        m.release_prefix([h])
        m.free_requests(r3)
    assert bool(res.ok) and bool(res2.ok) and bool(res3.ok) and bool(room.ok)
    m.check_invariants()
    assert int(m.num_free_pages()) == spec.num_pages


@pytest.mark.parametrize("sequence", [sharing_sequence, radix_sequence],
                         ids=["sharing", "radix"])
def test_sequence_neither_syncs_nor_uploads(sequence: Callable[[str, Region], None]) -> None:
    with HostAudit() as audit:
        sequence("cpu", lambda: audit.section("checked"))
    checked = audit.sections["checked"]
    assert checked["ops"] > 0  # (the region ran inside the audit)
    assert checked["syncs"] == 0 and checked["uploads"] == 0, dict(checked.detail)


def test_copy_pages_copies_only_the_masked_lanes() -> None:
    pages = torch.arange(8, dtype=torch.uint8).view(8, 1).expand(8, 4).clone()
    copies = PageCopies(src=torch.tensor([0, 1, 2, 3]), dst=torch.tensor([7, 6, 5, 4]),
                        mask=torch.tensor([False, True, False, True]))
    copy_pages(pages, copies)
    assert pages[:, 0].tolist() == [0, 1, 2, 3, 3, 5, 1, 7]
    none = PageCopies(copies.src, copies.dst, torch.zeros(4, dtype=torch.bool))
    before = pages.clone()
    copy_pages(pages, none)  # (every lane copies its source onto itself)
    assert torch.equal(pages, before)


def test_as_int64_stages_host_ints_without_an_upload() -> None:
    cpu = torch.device("cpu")
    with HostAudit() as audit, audit.section("stage"):
        got = as_int64([4, 2], cpu)
        empty = as_int64([], cpu)
    assert got.dtype == torch.int64 and got.tolist() == [4, 2]
    assert empty.shape == (0,) and empty.dtype == torch.int64
    assert audit.sections["stage"]["uploads"] == audit.sections["stage"]["syncs"] == 0
    with pytest.raises(TypeError):
        as_int64([1.5], cpu)  # (refused, not truncated)
    t = torch.tensor([3], dtype=torch.int32)
    assert as_int64(t, cpu).dtype == torch.int64


@contextlib.contextmanager
def cuda_sync_errors() -> Iterator[None]:
    """CUDA's sync-debug "error" mode: any synchronising call inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
