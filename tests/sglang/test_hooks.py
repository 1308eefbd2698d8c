"""The SGLang functions our four AROUND hooks wrap (``plugin.HOOKS``), as we rely on them.

SGLang's ``HookRegistry.apply_hooks`` logs and skips a target it cannot resolve, so a renamed
function would silently leave diffkv on SGLang's own code. Each test here fails instead when
SGLang renames the function one hook wraps, changes the parameters the hook passes through
or reads, or stops calling it where the hook needs it. docs/backend.md ("SGLang hooks")
cites one test per hook:

- ``ServerArgs.__post_init__``          test_post_init_hook_target
- ``KVCacheConfigurator.configure``     test_configure_hook_target
- ``PrefillAdder.add_one_req``          test_add_one_req_hook_target
- ``Scheduler.get_next_batch_to_run``   test_get_next_batch_to_run_hook_target
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from array import array

import harness as H  # noqa: F401  (sglang importable on CPU, diffkv registered)
import pytest

from sglang_diffkv.sglang import plugin
from sglang_diffkv.sglang.args import (
    DECODE_GRAPH_BACKENDS,
    FORCED_SETTINGS,
    GRAPHS_OFF,
    REFERENCE_FORCED_SETTINGS,
)

TARGETS = dict(plugin.HOOKS)


def _target(name: str):
    """The current (wrapped) function at ``name`` and SGLang's own function under it."""
    owner, attr = name.rsplit(".", 1)
    fn = getattr(pkgutil.resolve_name(owner), attr)
    return fn, inspect.unwrap(fn)


def _params(fn) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]


def test_hooks_are_the_four_documented_targets():
    assert list(TARGETS) == [
        "sglang.srt.server_args.ServerArgs.__post_init__",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
    ]
    assert all(plugin.hooks_applied().values())


def test_post_init_hook_target():
    """``ServerArgs.__post_init__(self)``: the dataclass hook every ServerArgs runs (the
    launcher's parse and any ServerArgs(...) built in code), with the fields we force, read
    and refuse."""
    from sglang.srt.server_args import ServerArgs

    target = "sglang.srt.server_args.ServerArgs.__post_init__"
    fn, original = _target(target)
    assert plugin.hooks_applied()[target]
    assert original.__qualname__ == "ServerArgs.__post_init__"
    assert _params(original) == [("self", "POSITIONAL_OR_KEYWORD")]
    assert dataclasses.is_dataclass(ServerArgs)  # (its generated __init__ calls __post_init__)
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    forced = {name for name, _, _ in FORCED_SETTINGS + REFERENCE_FORCED_SETTINGS}
    read = {"attention_backend", "prefill_attention_backend", "decode_attention_backend",
            "speculative_algorithm", "enable_dp_attention", "enable_hierarchical_cache",
            "disaggregation_mode", "enable_mixed_chunk", "pp_size",
            "kv_cache_dtype", "cuda_graph_config", "cuda_graph_max_bs_decode",
            "cuda_graph_bs_decode", "model_path"}
    assert sorted((forced | read) - set(fields)) == []
    assert callable(ServerArgs.use_mla_backend)  # (check_model)
    # the per-phase graph flags still fold into cuda_graph_config with these backend names
    args = ServerArgs(model_path="dummy", attention_backend="triton",
                      cuda_graph_backend_prefill=GRAPHS_OFF)
    args._parse_cuda_graph_config()
    assert args.cuda_graph_config.prefill.backend == GRAPHS_OFF
    assert args.cuda_graph_config.decode.backend in DECODE_GRAPH_BACKENDS


def test_configure_hook_target():
    """``KVCacheConfigurator.configure(self, *, pre_model_load_memory)``: where the model
    runner builds its pools, returning a ``KVCacheConfigResult``; the hook calls the
    configurator's memory profile, token constraints and request count, and reads its
    fields."""
    from sglang.srt.mem_cache.kv_cache_configurator import (
        KVCacheConfigResult,
        KVCacheConfigurator,
    )
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    target = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure"
    fn, original = _target(target)
    assert plugin.hooks_applied()[target]
    assert original.__qualname__ == "KVCacheConfigurator.configure"
    assert _params(original) == [("self", "POSITIONAL_OR_KEYWORD"),
                                 ("pre_model_load_memory", "KEYWORD_ONLY")]
    assert "kv_cache_configurator.configure(" in inspect.getsource(ModelRunner.alloc_memory_pool)
    # what build_pools calls on the configurator
    for name, params in (("_profile_available_bytes", ["self", "pre_model_load_memory"]),
                         ("_apply_token_constraints", ["self", "token_capacity"]),
                         ("resolve_max_num_reqs", ["self", "token_capacity"])):
        assert [p for p, _ in _params(getattr(KVCacheConfigurator, name))] == params, name
    fields = {f.name for f in dataclasses.fields(KVCacheConfigurator)}
    read = {"server_args", "device", "ps", "model_config", "kv_cache_dtype", "layer_info",
            "is_draft_worker", "req_to_token_pool", "use_mla_backend", "is_hybrid_swa",
            "mambaish_config"}
    assert sorted(read - fields) == []
    # what build_pools returns
    assert set(KVCacheConfigResult.__struct_fields__) == {
        "max_total_num_tokens", "max_running_requests", "full_max_total_num_tokens",
        "swa_max_total_num_tokens", "req_to_token_pool", "token_to_kv_pool",
        "token_to_kv_pool_allocator", "memory_pool_config", "unified_memory_pool"}
    assert {"max_total_num_tokens", "max_running_requests", "mem_fraction_static"} <= {
        f.name for f in dataclasses.fields(MemoryPoolConfig)}


def test_add_one_req_hook_target():
    """``PrefillAdder.add_one_req(self, req, has_chunked_req, truncation_align_size)``: the
    scheduler's per-request admission, answering ``AddReqResult.NO_TOKEN`` when memory is
    short; the hook counts a prompt's extend tokens as SGLang does."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_diffkv.sglang.admission import extend_len

    target = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
    fn, original = _target(target)
    assert plugin.hooks_applied()[target]
    assert original.__qualname__ == "PrefillAdder.add_one_req"
    assert [p for p, _ in _params(original)] == [
        "self", "req", "has_chunked_req", "truncation_align_size"]
    assert AddReqResult.NO_TOKEN in AddReqResult
    assert "adder.add_one_req(" in inspect.getsource(Scheduler)
    init = inspect.getsource(PrefillAdder.__init__)
    assert "self.token_to_kv_pool_allocator = " in init and "self.can_run_list = " in init
    # extend_len is SGLang's cand_extend_input_len
    src = inspect.getsource(original)
    assert "len(req.full_untruncated_fill_ids) - len(\n            req.prefix_indices\n" in src
    sp = H.SamplingParams(max_new_tokens=4, temperature=0)
    sp.normalize(None)
    req = H.Req("r", "", array("q", range(1, 31)), sp, vocab_size=H.VOCAB)
    req.init_next_round_input(None)
    assert extend_len(req) == 30


def test_get_next_batch_to_run_hook_target():
    """``Scheduler.get_next_batch_to_run(self, running_batch, last_batch)``: called once per
    iteration by both event loops on every TP rank, after the requests are broadcast; every
    admission (``get_new_batch_prefill``, the PrefillAdder) and retraction
    (``update_running_batch``: check_decode_mem / retract_decode) decision runs inside it.
    The hook reads the scheduler's ``token_to_kv_pool_allocator``."""
    from sglang.srt.managers.scheduler import Scheduler

    target = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
    fn, original = _target(target)
    assert plugin.hooks_applied()[target]
    assert original.__qualname__ == "Scheduler.get_next_batch_to_run"
    assert [p for p, _ in _params(original)] == ["self", "running_batch", "last_batch"]
    src = inspect.getsource(original)
    assert "self.get_new_batch_prefill(" in src and "self.update_running_batch(" in src
    assert "check_decode_mem()" in inspect.getsource(Scheduler.update_running_batch)
    assert "retract_decode(" in inspect.getsource(Scheduler.update_running_batch)
    assert "add_one_req(" in inspect.getsource(Scheduler._get_new_batch_prefill_raw)
    for loop in (Scheduler.event_loop_normal, Scheduler.event_loop_overlap):
        loop_src = inspect.getsource(loop)
        assert "recv_requests()" in loop_src
        assert loop_src.count("self.get_next_batch_to_run(") == 1, loop.__name__
    assert "self.token_to_kv_pool_allocator" in inspect.getsource(Scheduler)


@pytest.mark.parametrize("target", list(TARGETS))
def test_register_wraps_each_target_once(target):
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    plugin.register()
    ours = [h for _, h, _ in HookRegistry._hooks[target]
            if h is plugin._resolve(TARGETS[target])]
    assert len(ours) == 1
    fn, original = _target(target)
    layers = []  # the wrappers down to SGLang's function (its own decorators, e.g. nvtx)
    while hasattr(fn, "__wrapped__"):
        layers.append(fn)
        fn = fn.__wrapped__
    assert fn is original
    hook = plugin._resolve(TARGETS[target])
    assert [plugin._wraps(f, hook) for f in layers].count(True) == 1  # ours, once
