"""GPU kernels (Triton; CUDA C++ for compaction and the decode split-K pass) with their torch
references.

Each kernel ``f`` has a twin ``f_reference`` taking the same arguments, so a caller can
switch between them (the backend's CPU path uses the references).

May import: the core package root and ``memory``; never ``bench``, ``eval`` or ``sglang``.
On a GPU, ``python -m sglang_diffkv.kernels.gpu_check`` checks every kernel against its
reference and ``python -m sglang_diffkv.kernels.bench`` times them (docs/benchmarks.md).
"""

from sglang_diffkv.kernels.compaction import (
    compaction_backend,
    decode_compaction,
    decode_compaction_reference,
)
from sglang_diffkv.kernels.decode_attention import (
    DecodeAttentionPlan,
    ScratchArena,
    decode_attention,
    decode_attention_reference,
    describe_split_pass,
)
from sglang_diffkv.kernels.decode_policy import decode_policy_step, decode_policy_step_reference
from sglang_diffkv.kernels.extend_attention import extend_attention, extend_attention_reference
from sglang_diffkv.kernels.prefill import (
    PrefillBuffers,
    compress_prefill,
    compress_prefill_reference,
    prefill_scores,
    prefill_scores_reference,
)
from sglang_diffkv.kernels.store import (
    store_decode,
    store_decode_reference,
    store_tokens,
    store_tokens_reference,
)

__all__ = [
    "DecodeAttentionPlan",
    "PrefillBuffers",
    "ScratchArena",
    "compaction_backend",
    "compress_prefill",
    "compress_prefill_reference",
    "decode_attention",
    "decode_attention_reference",
    "decode_compaction",
    "decode_compaction_reference",
    "decode_policy_step",
    "decode_policy_step_reference",
    "describe_split_pass",
    "extend_attention",
    "extend_attention_reference",
    "prefill_scores",
    "prefill_scores_reference",
    "store_decode",
    "store_decode_reference",
    "store_tokens",
    "store_tokens_reference",
]
