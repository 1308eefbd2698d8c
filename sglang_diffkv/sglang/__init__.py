"""SGLang integration of DiffKV: ``--attention-backend diffkv``.

Everything under this package may import sglang; nothing else in ``sglang_diffkv`` does.
Importing this package itself is cheap and imports nothing from sglang: the interpreter-start
hook (``_bootstrap``, loaded by ``sglang_diffkv.pth``) must stay free of heavy imports.

Modules:
    _bootstrap  post-import hook on sglang's modules (installed by the ``.pth`` file)
    plugin      the patches the hook applies; ``register()`` is also the entry point
    args        ``ServerArgs`` fix-ups: forced settings and refusals
    runner      builds the pools on SGLang's model runner (capacity report)
    pool        request-to-token pool, logical-slot allocator, the paged DiffKV pool
    ops         the one seam to the compute: torch reference or Triton kernels
    graphs      static inputs of the CUDA-graph decode
    backend     ``DiffKVAttnBackend`` (extend / decode, CUDA-graph capture and replay)
"""
