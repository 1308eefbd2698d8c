"""SGLang 0.5.10's memory sizing, as formulas:

  * ``_handle_gpu_memory_settings``: chunked_prefill_size and cuda_graph_max_bs by GPU memory,
    then mem_fraction_static = round((gpu_mem - reserved) / gpu_mem, 3) with
    reserved = 512 + max(chunked, 2048) * 1.5 + cuda_graph_max_bs * 2 + tp * pp / 8 * 1024
    (+ 8 MB per piecewise-graph token size), floored at 10 GB on GPUs over 60 GB (all in MB);
  * ``profile_max_num_token``: rest = free_after_load - free_before_load * (1 - mfs), and the
    pool takes ``rest`` bytes (tokens = rest // cell_size for token pools);
  * ``_resolve_max_num_reqs``: min(clamp(tokens / context_len * 512, 2048, 4096), tokens // 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import SimulatorInputError
from simulator.specs.calibration import Calibration
from simulator.specs.gpu import GPUSpec
from simulator.specs.model import ModelSpec

GIB = 2**30


def default_chunk_and_graph(gpu_mem_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) SGLang picks for a GPU of this memory."""
    if gpu_mem_mib < 20 * 1024:
        return 2048, 8
    if gpu_mem_mib < 35 * 1024:
        return 2048, 24 if tp < 4 else 80
    if gpu_mem_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(
        range(512, max_bs + 1, 32))
    return [b for b in sizes if b <= max_bs]


def piecewise_graph_token_sizes(max_tokens: int) -> list[int]:
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
             + list(range(4608, max_tokens + 1, 512)))
    return [s for s in sizes if s <= max_tokens]


def mem_fraction_static(gpu_mem_mib: float, chunked_prefill_size: int, max_prefill_tokens: int,
                        cuda_graph_max_bs: int, tp: int, piecewise_graph: bool,
                        pp: int = 1) -> float:
    reserved = 512.0
    if chunked_prefill_size > 0:
        reserved += max(chunked_prefill_size, 2048) * 1.5
    else:
        reserved += max(max_prefill_tokens, 2048) * 1.5
    reserved += cuda_graph_max_bs * 2
    reserved += tp * pp / 8 * 1024
    if piecewise_graph:
        max_tokens = chunked_prefill_size if chunked_prefill_size > 0 else max_prefill_tokens
        reserved += len(piecewise_graph_token_sizes(max_tokens)) * 8
    if gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes per rank: what SGLang's profile_max_num_token leaves for the KV pool."""

    mem_fraction_static: float
    free_before_load: float
    weights: float
    free_after_load: float
    kv_rest: float

    def to_dict(self) -> dict[str, float]:
        return {"mem_fraction_static": self.mem_fraction_static,
                "free_before_load_gib": self.free_before_load / GIB,
                "weights_gib": self.weights / GIB,
                "free_after_load_gib": self.free_after_load / GIB,
                "kv_pool_gib": self.kv_rest / GIB}


def kv_memory_budget(gpu: GPUSpec, model: ModelSpec, tp: int, mfs: float,
                     calib: Calibration) -> MemoryBudget:
    # free memory torch reports before the weights load (SGLang's pre_model_load_memory)
    before = gpu.usable_bytes - calib.cuda_context_gib * GIB
    weights = model.weight_bytes(tp)
    after = before - weights - calib.post_load_overhead_gib * GIB
    rest = after - before * (1 - mfs)
    if rest <= 0:
        raise SimulatorInputError(
            f"{model.name} at tp={tp} leaves no KV memory on {gpu.name}: weights "
            f"{weights / GIB:.1f} GiB per GPU, mem_fraction_static={mfs}; raise tp or use a "
            "bigger GPU"
        )
    return MemoryBudget(mfs, before, weights, after, rest)


def default_max_running_requests(token_capacity: int, context_len: int) -> int:
    n = int(token_capacity / context_len * 512)
    return max(1, min(max(n, 2048), 4096, token_capacity // 2))
