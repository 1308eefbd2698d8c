"""Run in a fresh interpreter: what SGLang's own ``load_plugins()`` does in a spawned child.

Used by test_registration.py as ``python spawn_probe.py``. It never calls our ``register()``:
whatever is registered came from the ``sglang.srt.plugins`` entry point, loaded by SGLang
in a child started the way SGLang starts its scheduler processes (spawn).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import sys


def probe() -> dict:
    import sglang_cpu_env

    before = {"sglang": "sglang" in sys.modules,
              "plugin": "sglang_diffkv.sglang.plugin" in sys.modules}
    sglang_cpu_env.install()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, prepare_server_args

    load_plugins()
    out = {
        "imported_before_load": before,
        "choice": "diffkv" in ATTENTION_BACKEND_CHOICES,
        "factory": "diffkv" in ATTENTION_BACKENDS,
        "radix_factory": get_radix_cache_factory("diffkv") is not None,
        "hooks": {},
        "parsed": None,
    }
    if "sglang_diffkv.sglang.plugin" in sys.modules:
        from sglang_diffkv.sglang import plugin

        out["hooks"] = plugin.hooks_applied()
    logging.disable(logging.CRITICAL)  # (the forced-setting lines)
    try:
        a = prepare_server_args(["--model-path", "dummy", "--attention-backend", "diffkv"])
        out["parsed"] = {"attention_backend": a.attention_backend, "page_size": a.page_size}
        out["radix_cache_backend"] = a.radix_cache_backend
    except SystemExit:  # argparse: invalid choice
        pass
    return out


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
