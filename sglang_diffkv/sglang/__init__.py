"""SGLang integration of DiffKV: ``--attention-backend diffkv``.

The only layer of ``sglang_diffkv`` that imports sglang (supported: sglang 0.5.17; the CPU
suite also checks registration and the pools against the newest release). Importing this
package itself imports nothing from sglang.

Modules:
    plugin     the ``sglang.srt.plugins`` entry point: backend registration and the hooks
    args       ``ServerArgs`` fix-ups: forced settings and refusals
    runner     builds the pools in place of SGLang's (capacity report)
    admission  exact physical admission (``PrefillAdder``)
    pool       request-to-token pool, logical-slot allocator, the paged DiffKV pool
    ops        the one seam to the compute: torch reference or Triton kernels
    graphs     static inputs of the CUDA-graph decode
    backend    ``DiffKVAttnBackend`` (extend / decode, CUDA-graph capture and replay)
    step_profile  ``SGLANG_DIFFKV_PROFILE``: the memory-management step profiler (its
               line format: ``sglang_diffkv.serving_io.profile_lines``)
    loop_trace    ``SGLANG_DIFFKV_LOOP_TRACE``: wraps the scheduler loop and writes its trace
               (format and reader: ``sglang_diffkv.bench.loop_records``)
"""
