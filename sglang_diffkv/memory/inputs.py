"""Op arguments: made into device tensors (``as_index``, ``as_int64``) and checked at the
boundary. The checks copy to the host (a sync), so the manager runs them only when built with
``validate=True``; the hot path trusts its caller."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from enum import IntEnum

import torch


class Phase(IntEnum):
    """Lifecycle of a request slot (stored as int8 per slot on the device)."""

    FREE = 0  # no pages, row all -1, counts all 0
    PREFILLED = 1  # all-high over-allocation, waiting for reclaim_prefill
    DECODING = 2  # reclaimed: high pages on the left, low pages on the right


def as_index(req_idx: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """Request slots as an int64 tensor on ``device``."""
    t = torch.as_tensor(req_idx, device=device)
    if t.dim() != 1:
        raise ValueError(f"req_idx must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise ValueError(f"req_idx must be an integer tensor, got {t.dtype}")
    return t.to(torch.int64)


def as_int64(values: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on ``device``. A tensor is converted as it is; host ints reach a
    CUDA device through pinned memory and a non-blocking copy, which the stream queues like
    a kernel: ``torch.tensor(list, device=...)``, or ``.to(device)`` of a pageable tensor,
    is a synchronous copy (the host waits for the stream, and SGLang's overlap scheduler
    has a forward in flight on it).

    The host tensor is made from a buffer, not by ``torch.tensor(list)``: that is
    ``aten.lift_fresh``, which ``host_audit.HostAudit`` counts as an upload because on CUDA
    it usually is a pageable one, so a CPU audit of a caller tells this staged copy from
    one that synchronises."""
    if isinstance(values, torch.Tensor):
        return values.to(device, torch.int64)
    ints = [operator.index(v) for v in values]  # (a float is refused, not truncated)
    if not ints:  # (frombuffer refuses an empty buffer)
        return torch.zeros(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array("q", ints), dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def check_req_idx(req: torch.Tensor, max_reqs: int) -> list[int]:
    """Slots in [0, max_reqs), no duplicates (duplicates would race in the scatters)."""
    host = req.tolist()
    bad = [r for r in host if not 0 <= r < max_reqs]
    if bad:
        raise ValueError(f"req_idx {bad[0]} is outside [0, max_reqs={max_reqs})")
    if len(set(host)) != len(host):
        dup = next(r for r in host if host.count(r) > 1)
        raise ValueError(f"req_idx {dup} appears more than once in one batch")
    return host


def check_phase(
    phase: torch.Tensor, req_host: list[int], allowed: tuple[Phase, ...], op: str
) -> None:
    phases = phase.cpu().tolist()
    for r in req_host:
        if phases[r] not in allowed:
            names = " or ".join(p.name for p in allowed)
            raise ValueError(
                f"{op}: request slot {r} is {Phase(phases[r]).name}, expected {names}"
            )


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def first_violation(mask: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True in ``mask`` (host), or None."""
    hits = mask.nonzero()
    return None if hits.numel() == 0 else tuple(hits[0].tolist())
