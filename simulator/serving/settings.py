"""Server settings: the subset of SGLang 0.5.10's ServerArgs and environment that shapes
scheduling and memory, with SGLang's defaults. ``None`` means "SGLang derives it" (from GPU
memory, the pool size or the model)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from sglang_diffkv.config import DEFAULT_CUDA_GRAPH_MAX_BS
from simulator.errors import SimulatorInputError

# srt/environ.py and schedule_policy.py constants
INIT_NEW_TOKEN_RATIO = 0.7            # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14     # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600     # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20             # SGLANG_RETRACT_DECODE_STEPS
CLIP_MAX_NEW_TOKENS = 4096            # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION

# --attention-backend diffkv's --cuda-graph-max-bs when the user leaves it unset (the one
# number the server-args fix-ups also use)
DIFFKV_DEFAULT_CUDA_GRAPH_MAX_BS = DEFAULT_CUDA_GRAPH_MAX_BS


@dataclass(frozen=True)
class ServerSettings:
    tp: int = 1
    chunked_prefill_size: int | None = None     # None: from GPU memory (8192 on H100/H200)
    max_prefill_tokens: int = 16384
    cuda_graph_max_bs: int | None = None        # None: from GPU memory and tp (diffkv: 512)
    disable_cuda_graph: bool = False
    enable_piecewise_cuda_graph: bool = True    # on by default in 0.5.10
    enable_mixed_chunk: bool = False
    disable_overlap_schedule: bool = False      # the overlap scheduler is on by default
    schedule_conservativeness: float = 1.0
    mem_fraction_static: float | None = None    # None: SGLang's formula
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    context_len: int | None = None              # None: the model's max_position_embeddings
    disable_radix_cache: bool = False
    ignore_eos: bool = True                     # clients send ignore_eos (bench_serving)

    def __post_init__(self) -> None:
        def pos_int(name: str, allow_none: bool = True, allow_neg1: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if allow_neg1 and v == -1:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimulatorInputError(f"{name}={v!r} must be a positive integer")

        pos_int("tp", allow_none=False)
        pos_int("chunked_prefill_size", allow_neg1=True)
        pos_int("max_prefill_tokens", allow_none=False)
        pos_int("cuda_graph_max_bs")
        pos_int("max_total_tokens")
        pos_int("max_running_requests")
        pos_int("context_len")
        c = self.schedule_conservativeness
        if not (isinstance(c, (int, float)) and c > 0 and math.isfinite(c)):
            raise SimulatorInputError(f"schedule_conservativeness={c!r} must be a number > 0")
        m = self.mem_fraction_static
        if m is not None and not (isinstance(m, (int, float)) and 0 < m < 1):
            raise SimulatorInputError(f"mem_fraction_static={m!r} must be in (0, 1)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
