"""Host-work audit: what a piece of code asks of the device, counted on any device (CPU too).

A prefill step on the GPU is host-bound when the host issues its work slower than the GPU
runs it, and a host synchronisation (the host waiting for the GPU to finish everything
queued so far) makes it worse: the GPU then idles until the host has issued the next work.
Neither is visible in a CPU test's timing, but both are visible in the torch ops the code
dispatches. ``HostAudit`` is a ``TorchDispatchMode`` that counts them per named *section*
(``section(name)``, or ``watch(owner, attribute, name)`` to run an existing function inside
one), innermost section first; ops outside every section are not counted.

Per section it counts:

- ``ops``: every aten op dispatched (the host cost of an eager op is paid whatever it does);
- ``launches``: the ops that may launch a device kernel: every op less views (an op whose
  output aliases its input without writing it: ``view``, ``slice``, ``expand``...), fresh
  allocations (``empty*``) and the syncs and uploads below; an upper bound (a copy to the
  same dtype is still counted, a fused op may launch two kernels);
- ``triton``: Triton kernel launches (they bypass torch's dispatcher: counted by wrapping
  ``JITFunction.run`` and, under ``TRITON_INTERPRET=1``, ``InterpretedFunction.run``, with
  the mode suspended meanwhile so the interpreter's own copies are not counted);
- ``syncs``: ops that make the host wait for the device on CUDA, because their result's
  size or value is read on the host:
  ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``),
  ``Tensor.tolist`` (not an aten op: counted by wrapping the method),
  ``nonzero`` / ``argwhere`` / one-argument ``where`` (output size),
  ``masked_select``, ``index`` / ``index_put_`` with a boolean index (a nonzero inside),
  ``unique*`` (output size), ``repeat_interleave`` with a tensor of repeats and no
  ``output_size``, ``equal`` / ``is_nonzero`` (a host bool), and a copy from a CUDA tensor
  to the CPU;
- ``uploads``: host values made into a tensor (``torch.tensor(list)``, ``as_tensor`` of a
  list, indexing with a Python list: ``aten::lift_fresh``) and copies from the CPU to a
  CUDA tensor. Bound for the device, each is a pageable host-to-device copy, which
  synchronises the stream (``copy_`` waits for it) unless made from pinned memory with
  ``non_blocking=True``; on the CPU the same code makes the same ``lift_fresh``, so a CPU
  run counts what a GPU run would upload. (A tensor built for host-side bookkeeping is
  counted too: read the ``detail`` to tell them apart.)

``detail`` keeps, per section, each sync and upload op's name with its count, so a test can
say which one appeared. Counting costs host time; the audit is for tests and profiling runs
only (nothing in the serving path creates one).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_INHERITED = object()  # (a patched class attribute that was inherited, not its own)

CATEGORIES = ("ops", "launches", "triton", "syncs", "uploads")

_aten = torch.ops.aten
# ops whose output size or value the host reads (see the module docstring)
_SYNC_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.argwhere.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
}
_ALLOC_OPS = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
}
_UPLOAD_OPS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
_BOOL_INDEX_OPS = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _device_of(x: Any) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


def classify_op(func: Any, args: tuple, kwargs: dict) -> str | None:
    """``"syncs"``, ``"uploads"``, ``"launches"`` or None (a view or an allocation) for one
    dispatched op."""
    if func in _SYNC_OPS:
        return "syncs"
    if func in _UPLOAD_OPS:
        return "uploads"
    if func in _BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "syncs"
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "syncs"
    if func in (_aten._to_copy.default, _aten.copy_.default):
        src = args[1] if func is _aten.copy_.default else args[0]
        dst = _device_of(args[0]) if func is _aten.copy_.default else kwargs.get("device")
        src_dev = _device_of(src)
        if src_dev is not None and dst is not None:
            dst = torch.device(dst)
            if src_dev.type == "cuda" and dst.type == "cpu":
                return "syncs"
            if src_dev.type == "cpu" and dst.type == "cuda" and not (
                    kwargs.get("non_blocking") and src.is_pinned()):
                return "uploads"
    if func in _ALLOC_OPS or _is_view(func):
        return None
    return "launches"


@dataclass
class SectionCounts:
    counts: Counter = field(default_factory=Counter)  # category -> count
    detail: Counter = field(default_factory=Counter)  # "syncs:aten.nonzero.default" -> count

    def __getitem__(self, category: str) -> int:
        return self.counts[category]


class SectionedMode(TorchDispatchMode):
    """A dispatch mode that attributes what it sees to the innermost named section, and
    patches attributes only while it is active (restored, in reverse order, on exit). The
    host audit and ``traffic_audit.TrafficAudit`` both build on it."""

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[str] = []
        self._patches: list[tuple[Any, str, Any]] = []

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def watch(self, owner: Any, attribute: str, name: str) -> None:
        """Run ``owner.attribute`` (a function, method or class attribute) inside section
        ``name`` while the audit is active; restored when the audit exits."""
        original = (owner.__dict__.get(attribute, getattr(owner, attribute))
                    if isinstance(owner, type) else getattr(owner, attribute))
        target = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = self.wrap(target, name)
        self._patch(owner, attribute,
                    staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)

    def wrap(self, fn: Callable, name: str) -> Callable:
        """``fn`` run inside section ``name`` (for callables held where ``watch`` cannot
        patch them, e.g. a frozen dataclass's field)."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                return fn(*args, **kwargs)

        return wrapped

    def _patch(self, owner: Any, attribute: str, value: Any) -> None:
        # a class attribute it inherits is restored by deleting the patch (_INHERITED)
        old = (owner.__dict__.get(attribute, _INHERITED) if isinstance(owner, type)
               else getattr(owner, attribute))
        self._patches.append((owner, attribute, old))
        setattr(owner, attribute, value)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._patches:
            owner, attribute, value = self._patches.pop()
            if value is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, value)


class HostAudit(SectionedMode):
    """Counts dispatched ops, Triton launches, syncs and uploads per section (module
    docstring). Use as a context manager; ``sections`` holds the counts afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, SectionCounts] = defaultdict(SectionCounts)

    def _count(self, category: str, what: str | None = None) -> None:
        if not self._stack:
            return
        sec = self.sections[self._stack[-1]]
        sec.counts[category] += 1
        if what is not None:
            sec.detail[f"{category}:{what}"] += 1

    # ---- the mode ------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._stack:
            self._count("ops")
            kind = classify_op(func, args, kwargs)
            if kind is not None:
                self._count(kind, str(func) if kind != "launches" else None)
        return func(*args, **kwargs)

    def __enter__(self) -> HostAudit:
        audit = self
        tolist = torch.Tensor.tolist

        def counted_tolist(t: torch.Tensor) -> Any:
            audit._count("syncs", "Tensor.tolist")
            return tolist(t)

        self._patch(torch.Tensor, "tolist", counted_tolist)
        for cls in _triton_function_classes():
            run = cls.run

            def counted_run(fn: Any, *args: Any, _run: Callable = run, **kwargs: Any) -> Any:
                audit._count("triton", getattr(fn, "__name__", None) or str(fn))
                with _disable_current_modes():
                    return _run(fn, *args, **kwargs)

            self._patch(cls, "run", counted_run)
        super().__enter__()
        return self

    # ---- results ---------------------------------------------------------------------------

    def total(self, category: str, sections: Iterator[str] | None = None) -> int:
        names = self.sections.keys() if sections is None else sections
        return sum(self.sections[n].counts[category] for n in names if n in self.sections)

    def table(self, per: dict[str, int] | None = None) -> str:
        """One line per section: each category's count (divided by ``per[section]`` when
        given, e.g. the number of layers for per-layer sections)."""
        lines = [f"{'section':<24}" + "".join(f"{c:>10}" for c in CATEGORIES)]
        for name in sorted(self.sections):
            div = (per or {}).get(name, 1)
            cells = "".join(f"{self.sections[name].counts[c] / div:>10.1f}" for c in CATEGORIES)
            lines.append(f"{name + ('/' + str(div) if div != 1 else ''):<24}{cells}")
        return "\n".join(lines)


def _triton_function_classes() -> list[type]:
    """Triton's launchable function classes present here (none without triton)."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:  # (the torch paths need no triton)
        return []
    return [jit.JITFunction, interpreter.InterpretedFunction]
