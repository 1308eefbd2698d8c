"""Only here to ship ``sglang_diffkv.pth`` (the SGLang import hook) into site-packages.

Everything else is declared in pyproject.toml. ``.pth`` files must sit at the top of
site-packages, which setuptools' package data cannot express, so a regular build copies it
into the wheel root and an editable install (PEP 660) writes it into the editable wheel.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "sglang_diffkv" / "sglang" / "sglang_diffkv.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name))


class _StrategyWithPth:
    def __init__(self, inner) -> None:
        self.inner = inner

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def __call__(self, wheel, files, mapping) -> None:
        self.inner(wheel, files, mapping)
        wheel.writestr(PTH.name, PTH.read_bytes())


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
