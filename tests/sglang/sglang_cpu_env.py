"""Make sglang (0.5.17) importable on a CPU-only CI machine.

sglang hard-imports two CUDA-only binary packages at module level: ``torchvision`` (its PyPI
build for torch 2.13 links libtorch_cuda) and ``sgl_kernel`` (a 336 MB CUDA wheel). Neither is
used by the code paths the tests drive (pools, allocator, ScheduleBatch, ForwardBatch, our
backend), so we install import-time stand-ins: any attribute of a stand-in module is another
stand-in, and calling one raises, so an unexpected use fails loudly instead of silently.

``install()`` must run before the first ``import sglang``. It is idempotent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_STUBBED_ROOTS = ("torchvision", "sgl_kernel")


class _Missing:
    """A callable/attribute placeholder for a CUDA-only symbol."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> _Missing:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a CPU-test stand-in for a CUDA-only symbol")

    def __mro_entries__(self, bases: tuple) -> tuple:
        # `class X(sgl_kernel.Something)` at import time: derive from object instead.
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self.__name__}.{item}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StubModule(spec.name)
        mod.__path__ = []  # a package, so submodule imports resolve through the finder
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in _STUBBED_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def install() -> None:
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    # transformers caches whether torchvision exists; fix the answer to False before the
    # stand-in appears, otherwise AutoProcessor & co. try to use it.
    try:
        import transformers.utils.import_utils as iu

        for name in ("is_torchvision_available", "is_torchvision_v2_available"):
            fn = getattr(iu, name, None)
            if fn is not None and hasattr(fn, "cache_clear"):
                fn.cache_clear()
            if fn is not None:
                setattr(iu, name, lambda: False)
        if hasattr(iu, "_torchvision_available"):
            iu._torchvision_available = False
    except ImportError:
        pass
    sys.meta_path.insert(0, _StubFinder())
