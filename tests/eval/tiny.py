"""Tiny random Llama / Qwen2 models (head_dim 64, GQA) for fast hook tests."""

import torch

from sglang_diffkv.eval.model import LoadedModel, ModelShape


def tiny(arch: str = "llama", seed: int = 0) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=96, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.eval()
    return LoadedModel(model, None, ModelShape.from_config(model.config), f"tiny-{arch}", "random")
