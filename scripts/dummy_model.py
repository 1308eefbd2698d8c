#!/usr/bin/env python3
"""Write a HuggingFace-style model folder for SGLang's `--load-format dummy`.

The folder holds only config.json, generation_config.json and a synthetic
tokenizer (tokenizer.json + tokenizer_config.json + special_tokens_map.json).
No weights: SGLang fills every parameter with random values when started with
`--load-format dummy`.

Shapes follow Llama-3-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads,
head_dim 128, intermediate 14336, vocab 128256, rope_theta 500000,
max_position_embeddings 8192, bf16). `--layers N` writes a shallower variant
(e.g. 2 layers) for fast smoke tests; everything else stays the same. `--shape` picks
another published shape for the tensor-parallel runs (its layer count unless --layers is
given): qwen2.5-32b (Qwen2, hidden 5120, 64 layers, 40 heads, 8 KV heads, head_dim 128,
intermediate 27648, vocab 152064, qkv bias) or llama-3-70b (hidden 8192, 80 layers, 64 heads,
8 KV heads, intermediate 28672); the synthetic tokenizer's ids fit both vocabularies.

Tokenizer: nothing can be downloaded on the device, and no installed package
ships a Llama-3 tokenizer, so a synthetic word-level tokenizer is generated
with the `tokenizers` library: token i is the word "t<i>" (ids 0..127999),
ids 128000..128255 are Llama-3-style special tokens (<|begin_of_text|> =
128000, <|end_of_text|> = 128001, <|eot_id|> = 128009, the rest reserved).
decode(ids) gives "t12 t7 ..." and encode() of that text gives the same ids
back, so text prompts and token-id prompts are interchangeable. A small
ShareGPT-format file of such words (sharegpt_synthetic.json) is written too,
for the --dataset-path of SGLang's benchmark scripts. No BOS is
added automatically. The token ids, not the text, are what matters for
performance work.

Usage:
    python3 dummy_model.py OUT_DIR [--layers N] [--shape llama-3-8b|qwen2.5-32b|llama-3-70b]
"""
import argparse
import json
import os

VOCAB = 128256
N_WORDS = 128000
SPECIAL = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128009: "<|eot_id|>",
}


def llama3_8b_config(num_layers: int = 32) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
        "transformers_version": "5.3.0",  # >= 5 silences a spurious "mistral regex" warning
    }


# published shapes (config.json fields that differ from Llama-3-8B's)
SHAPES: dict[str, dict] = {
    "llama-3-8b": {},
    "llama-3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    "qwen2.5-32b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "vocab_size": 152064,
                    "max_position_embeddings": 32768, "attention_bias": True},
}


def model_config(shape: str, num_layers: int | None) -> dict:
    """config.json for ``shape`` (SHAPES), with ``num_layers`` layers when given."""
    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: use one of {', '.join(SHAPES)}")
    cfg = llama3_8b_config()
    cfg.update(SHAPES[shape])
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    return cfg


def special_token_name(i: int) -> str:
    return SPECIAL.get(i, f"<|reserved_special_token_{i - N_WORDS}|>")


def write_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(N_WORDS)}
    for i in range(N_WORDS, VOCAB):
        vocab[special_token_name(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with " "
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(special_token_name(i), special=True, normalized=False)
         for i in range(N_WORDS, VOCAB)]
    )
    tok.save(os.path.join(out, "tokenizer.json"))

    added = {
        str(i): {
            "content": special_token_name(i),
            "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for i in range(N_WORDS, VOCAB)
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|end_of_text|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "added_tokens_decoder": added,
        # Minimal Llama-3-style template so /v1/chat/completions also works.
        "chat_template": (
            "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
            "{{ m['content'] }} <|eot_id|> {% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> "
            "{% endif %}"
        ),
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=1)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "pad_token": "<|end_of_text|>"}, f, indent=1)


def write_sharegpt(path: str, n: int = 64, seed: int = 0) -> None:
    """Small ShareGPT-format file of random words of the synthetic tokenizer.

    sglang.bench_offline_throughput / bench_serving always sample their warmup
    requests from a ShareGPT file (and download one when --dataset-path is not
    a valid file, which fails offline): pass this file as --dataset-path.
    """
    import random

    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randrange(N_WORDS)}" for _ in range(k))

    data = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": words(rng.randint(64, 512))},
            {"from": "gpt", "value": words(rng.randint(64, 512))},
        ]}
        for i in range(n)
    ]
    with open(path, "w") as f:
        json.dump(data, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=None,
                    help="num_hidden_layers (default: the shape's, 32 for Llama-3-8B; e.g. 2 "
                         "for smoke tests)")
    ap.add_argument("--shape", default="llama-3-8b", help=", ".join(SHAPES))
    ap.add_argument("--sharegpt-n", type=int, default=1024,
                    help="conversations in sharegpt_synthetic.json "
                         "(caps --num-prompts of the benches)")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="write only config files (use with --skip-tokenizer-init)")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        cfg = model_config(args.shape, args.layers)
        json.dump(cfg, f, indent=2)
    with open(os.path.join(args.out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 128000, "eos_token_id": [128001, 128009],
                   "do_sample": False}, f, indent=2)
    if not args.no_tokenizer:
        write_tokenizer(args.out_dir)
        write_sharegpt(os.path.join(args.out_dir, "sharegpt_synthetic.json"), n=args.sharegpt_n)
    print(f"wrote {args.out_dir} ({args.shape}, layers={cfg['num_hidden_layers']}, "
          f"tokenizer={not args.no_tokenizer})")


if __name__ == "__main__":
    main()
