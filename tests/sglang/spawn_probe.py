"""Run in a fresh interpreter: report what sglang looks like there, and in a spawned child.

Used by test_registration.py as ``python spawn_probe.py``. It never calls our ``register()``:
whatever is registered came from the ``.pth`` import hook processed at interpreter start.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def probe() -> dict:
    import sglang_cpu_env

    before = {"sglang": "sglang" in sys.modules, "torch": "torch" in sys.modules}
    sglang_cpu_env.install()
    from sglang.srt import server_args
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.model_executor.model_runner import ModelRunner

    return {
        "imported_at_start": before,
        "choice": "diffkv" in server_args.ATTENTION_BACKEND_CHOICES,
        "factory": "diffkv" in ATTENTION_BACKENDS,
        "pools": ModelRunner._init_pools.__module__,
        "cell": ModelRunner.get_cell_size_per_token.__module__,
        "admission": PrefillAdder.add_one_req.__module__,
        "post_init": getattr(server_args.ServerArgs.__post_init__, "_diffkv_wrapped", False),
    }


def _child(queue: mp.Queue) -> None:
    queue.put(probe())


if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # what sglang's engine uses for scheduler processes
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    child = q.get(timeout=300)
    p.join(60)
    print(json.dumps({"child": child}))
