"""DiffKV's device-resident page manager: circular free list, bidirectional page table,
prefix-sum compaction. Device-agnostic torch (CPU in tests, CUDA unchanged).

May import: the core package root (``layout``, ``decode_hint``); nothing else in
``sglang_diffkv``."""

from sglang_diffkv.memory.free_list import CircularFreeList, Take
from sglang_diffkv.memory.inputs import Phase
from sglang_diffkv.memory.invariants import check_invariants
from sglang_diffkv.memory.manager import PageManager
from sglang_diffkv.memory.result import AllocResult, OutOfPages, PageTableRowFull
from sglang_diffkv.memory.sharing import PageCopies, SharedPrefix, copy_pages
from sglang_diffkv.memory.spec import MemorySpec
from sglang_diffkv.memory.storage import alloc_page_storage

__all__ = [
    "AllocResult",
    "CircularFreeList",
    "MemorySpec",
    "OutOfPages",
    "PageCopies",
    "PageManager",
    "PageTableRowFull",
    "Phase",
    "SharedPrefix",
    "Take",
    "alloc_page_storage",
    "check_invariants",
    "copy_pages",
]
