"""Device-traffic audit: the bytes a piece of code moves, per torch op and per Triton launch,
counted on the CPU (the kernels under ``TRITON_INTERPRET=1``).

``host_audit`` counts what the host issues; this counts what the device would have to read
and write for it, which is what bounds a step that is not host-bound. A GPU profile of a
served step says how long a span took, not why; on the CPU every op and every launch can
be accounted exactly:

- torch ops (a ``TorchDispatchMode``): per aten op, its count and the bytes of its tensor
  inputs and outputs, with a gather (``index_select``, advanced indexing, ``gather``)
  counting the rows it reads (its output and index) rather than its whole source, and an
  in-place scatter (``index_copy_``, ``index_put_``) the rows it writes. Views and fresh
  allocations move nothing. A model, not a measurement: a fused elementwise op on the GPU
  reads what it is given, so it is close for the ops used here;
- Triton launches (``InterpretedFunction.run``, wrapped): per kernel, its grid and, from the
  interpreter's own masked loads and stores, the bytes its programs load and store
  (``loaded`` / ``stored``: every active lane's element, as the kernel asks for it: L2 and
  L1 traffic) and the distinct bytes among them (``unique_*``: what a perfect cache would
  take from or give to HBM), and its ``tl.dot`` work (multiply-adds, split by input
  precision: an fp32 dot with ``input_precision="ieee"`` runs on the CUDA cores, not the
  tensor cores).

Counting under the interpreter is slow (every load's addresses are kept until the launch
ends); it is for analysis scripts and tests at small shapes, never the serving path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from sglang_diffkv.host_audit import _ALLOC_OPS, SectionedMode, _is_view

_aten = torch.ops.aten
# ops that read only the rows their index picks: their output (and the index) is what moves
_GATHER_OPS = {
    _aten.index_select.default,
    _aten.index.Tensor,
    _aten.gather.default,
    _aten.embedding.default,
}
# in-place scatters: they read their source rows and the index and write as many rows
_SCATTER_OPS = {
    _aten.index_copy_.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
    _aten.index_add_.default,
    _aten.scatter_.src,
    _aten.scatter_.value,
}


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _nbytes(xs: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(xs))


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The bytes one aten op moves (module docstring's model); 0 for views and allocations."""
    if func in _ALLOC_OPS or _is_view(func):
        return 0
    if func in _GATHER_OPS:
        index = [t for t in _tensors(args[1:]) if t.dtype in (torch.int64, torch.int32,
                                                              torch.bool)]
        return _nbytes(out) + _nbytes(index)
    if func in _SCATTER_OPS:
        src = list(_tensors(args[1:]))  # index(es) and source rows, read; as many written
        moved = _nbytes(src)
        rows = [t for t in src if t.is_floating_point() or t.dtype == args[0].dtype]
        return moved + _nbytes(rows[-1:])
    if func is _aten.copy_.default:
        return 2 * _nbytes(args[1]) if args[0].shape == args[1].shape else (
            _nbytes(args[1]) + _nbytes(args[0]))
    return _nbytes((args, kwargs)) + _nbytes(out)


@dataclass
class OpCounts:
    count: int = 0
    bytes: int = 0


@dataclass
class LaunchCounts:
    count: int = 0
    grids: list[tuple[int, ...]] = field(default_factory=list)
    loaded: int = 0
    stored: int = 0
    unique_loaded: int = 0
    unique_stored: int = 0
    dot_fma: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def programs(self) -> int:
        return sum(int(np.prod(g)) for g in self.grids)


class TrafficAudit(SectionedMode):
    """Bytes per torch op and per Triton launch inside ``section(name)`` (module docstring).
    ``ops[section][op name]`` / ``launches[section][kernel name]`` hold the counts."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, OpCounts]] = defaultdict(lambda: defaultdict(OpCounts))
        self.launches: dict[str, dict[str, LaunchCounts]] = defaultdict(
            lambda: defaultdict(LaunchCounts))
        # the launch under way: (loaded addresses, stored addresses, counters)
        self._live: tuple[list, list, LaunchCounts] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._stack:
            moved = op_bytes(func, args, kwargs, out)
            if moved or not (func in _ALLOC_OPS or _is_view(func)):
                c = self.ops[self._stack[-1]][str(func.overloadpacket.__name__)]
                c.count += 1
                c.bytes += moved
        return out

    # ---- Triton (interpreter) ---------------------------------------------------------

    def _on_load(self, ptrs: Any, mask: Any, dtype_np: Any) -> None:
        live = self._live
        if live is None:
            return
        sel = np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].astype(np.uint64)
        item = np.dtype(dtype_np).itemsize
        live[2].loaded += sel.size * item
        live[0].append((sel, item))

    def _on_store(self, ptrs: Any, value: Any, mask: Any) -> None:
        live = self._live
        if live is None:
            return
        sel = np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].astype(np.uint64)
        item = np.asarray(value.data).dtype.itemsize
        live[2].stored += sel.size * item
        live[1].append((sel, item))

    def _on_dot(self, a: Any, b: Any, precision: Any) -> None:
        live = self._live
        if live is None:
            return
        sa, sb = np.asarray(a.data).shape, np.asarray(b.data).shape
        fma = int(np.prod(sa[:-1])) * int(sb[-1]) * int(sa[-1])
        kind = f"{np.asarray(a.data).dtype}/{precision}"
        live[2].dot_fma[kind] += fma

    def __enter__(self) -> TrafficAudit:
        from triton.runtime import interpreter

        audit = self
        builder = interpreter.InterpreterBuilder
        load, store, dot = (builder.create_masked_load, builder.create_masked_store,
                            builder.create_dot)

        def masked_load(b: Any, ptrs: Any, mask: Any, other: Any, *rest: Any) -> Any:
            out = load(b, ptrs, mask, other, *rest)
            audit._on_load(ptrs, mask, np.asarray(out.data).dtype)
            return out

        def masked_store(b: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
            audit._on_store(ptrs, value, mask)
            return store(b, ptrs, value, mask, *rest)

        def create_dot(b: Any, x: Any, y: Any, d: Any, precision: Any, *rest: Any) -> Any:
            audit._on_dot(x, y, precision)
            return dot(b, x, y, d, precision, *rest)

        for name, fn in (("create_masked_load", masked_load),
                         ("create_masked_store", masked_store), ("create_dot", create_dot)):
            self._patch(builder, name, fn)
        run = interpreter.InterpretedFunction.run

        def counted_run(fn: Any, *args: Any, _run: Callable = run, **kwargs: Any) -> Any:
            if not audit._stack:
                with _disable_current_modes():
                    return _run(fn, *args, **kwargs)
            name = getattr(fn, "__name__", None) or str(fn)
            c = audit.launches[audit._stack[-1]][name]
            c.count += 1
            grid = kwargs.get("grid")
            c.grids.append(tuple(int(g) for g in grid) if grid is not None else ())
            audit._live = ([], [], c)
            try:
                with _disable_current_modes():
                    return _run(fn, *args, **kwargs)
            finally:
                loads, stores, _ = audit._live
                audit._live = None
                c.unique_loaded += _unique_bytes(loads)
                c.unique_stored += _unique_bytes(stores)

        self._patch(interpreter.InterpretedFunction, "run", counted_run)
        super().__enter__()
        return self

    # ---- results ---------------------------------------------------------------------

    def section_bytes(self, name: str) -> tuple[int, int]:
        """(torch ops' bytes, Triton launches' unique loaded + stored bytes) of a section."""
        ops = sum(c.bytes for c in self.ops.get(name, {}).values())
        tri = sum(c.unique_loaded + c.unique_stored
                  for c in self.launches.get(name, {}).values())
        return ops, tri

    def table(self, name: str, per: int = 1) -> str:
        """One line per op and kernel of a section (counts and MB divided by ``per``)."""
        mb = 1e6 * per
        lines = [f"{'op / kernel':<28}{'count':>7}{'MB':>10}{'MB ld':>9}{'MB st':>9}"
                 f"{'uniq ld':>9}{'uniq st':>9}  grid / dot multiply-adds"]
        for k, c in sorted(self.launches.get(name, {}).items()):
            dots = ", ".join(f"{v / 1e9 / per:.2f} G {p}" for p, v in c.dot_fma.items())
            grids = sorted(set(c.grids))
            lines.append(
                f"{k:<28}{c.count / per:>7.1f}{(c.unique_loaded + c.unique_stored) / mb:>10.1f}"
                f"{c.loaded / mb:>9.1f}{c.stored / mb:>9.1f}{c.unique_loaded / mb:>9.1f}"
                f"{c.unique_stored / mb:>9.1f}  {grids}{'; ' + dots if dots else ''}")
        for k, o in sorted(self.ops.get(name, {}).items(), key=lambda kv: -kv[1].bytes):
            lines.append(f"{'aten.' + k:<28}{o.count / per:>7.1f}{o.bytes / mb:>10.2f}")
        ops, tri = self.section_bytes(name)
        lines.append(f"{'total':<28}{'':>7}{(ops + tri) / mb:>10.1f}  (torch ops "
                     f"{ops / mb:.1f} MB, Triton unique {tri / mb:.1f} MB)")
        return "\n".join(lines)


def _unique_bytes(chunks: list[tuple[np.ndarray, int]]) -> int:
    """Distinct bytes among (addresses, element size) chunks (elements of one size each)."""
    if not chunks:
        return 0
    by_size: dict[int, list[np.ndarray]] = defaultdict(list)
    for addr, item in chunks:
        by_size[item].append(addr)
    return sum(int(np.unique(np.concatenate(a)).size) * item for item, a in by_size.items())
