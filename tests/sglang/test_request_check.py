"""Per-request DiffKV parameters are checked where SGLang checks sampling parameters: in the
tokenizer manager, before any scheduler sees the request (``request_check.verify_hook``)."""

from __future__ import annotations

import inspect

import harness as H
import pytest
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_tokenizer

from sglang_diffkv.sglang import plugin, request_check


@pytest.fixture
def diffkv_server():
    set_global_server_args_for_tokenizer(ServerArgs(model_path="dummy", attention_backend="diffkv"))
    request_check._config.cache_clear()
    yield
    request_check._config.cache_clear()


def test_verify_hook_target():
    """``SamplingParams.verify(self, vocab_size)`` is what the tokenizer manager calls on every
    request before sending it to a scheduler; our AFTER hook wraps it."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    target = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
    assert plugin.hooks_applied()[target]
    original = inspect.unwrap(SamplingParams.verify)
    assert [p for p in inspect.signature(original).parameters] == ["self", "vocab_size"]
    assert "sampling_params.verify(" in inspect.getsource(
        TokenizerManager._create_tokenized_object)


@pytest.mark.parametrize("params, key", [
    ({"diffkv_alpha_h": "abc"}, "diffkv_alpha_h"),
    ({"diffkv_alpha_h": None}, "diffkv_alpha_h"),
    ({"diffkv_alpha_l": [0.1]}, "diffkv_alpha_l"),
    ({"diffkv_alpha_h": 10**400}, "diffkv_alpha_h"),
    ({"diffkv_alpha_h": 0.1, "diffkv_alpha_l": 0.5}, "diffkv_alpha_l"),
    ({"diffkv_alpha_hh": 2.0}, "diffkv_alpha_hh"),
])
def test_a_bad_value_fails_the_request_in_the_tokenizer_manager(diffkv_server, params, key):
    sp = SamplingParams(max_new_tokens=4, custom_params=params)
    sp.normalize(None)
    with pytest.raises(ValueError) as e:
        sp.verify(H.VOCAB)
    msg = str(e.value)
    assert key in msg and "\n" not in msg, msg


def test_valid_and_foreign_keys_pass(diffkv_server):
    sp = SamplingParams(max_new_tokens=4, custom_params={
        "diffkv_alpha_h": 2.0, "diffkv_alpha_l": 0.1, "thinking_budget": 3})
    sp.normalize(None)
    sp.verify(H.VOCAB)


def test_other_backends_are_not_checked():
    set_global_server_args_for_tokenizer(ServerArgs(model_path="dummy", attention_backend="triton"))
    sp = SamplingParams(max_new_tokens=4, custom_params={"diffkv_alpha_h": "abc"})
    sp.normalize(None)
    sp.verify(H.VOCAB)  # not ours to judge
