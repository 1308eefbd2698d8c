"""A byte-level BPE tokenizer rebuilt from a GGUF file's vocabulary and merges.

transformers' GGUF loader converts ``tokenizer.ggml.model = gpt2`` vocabularies of Llama
GGUFs with its sentencepiece-style converter; for SmolLM2 (``tokenizer.ggml.pre =
smollm``) that maps every space to ``<|endoftext|>`` and prepends a BOS, which ruins
perplexity. This builds the tokenizer llama.cpp uses for such files: digits split one by
one, then GPT-2 byte-level pre-tokenisation, BPE with the stored merges, no BOS.
"""

from __future__ import annotations

from pathlib import Path

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined; both are special tokens.
_SPECIAL_TYPES = (3, 4)
_PRE_WITH_DIGIT_SPLIT = ("smollm",)
SUPPORTED_PRE = ("gpt2", "smollm", "default")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def needs_rebuild(gguf_path: Path) -> bool:
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_path))
    return _field(r, "tokenizer.ggml.model") == "gpt2" and _field(
        r, "general.architecture"
    ) in ("llama", "mistral")


def build_tokenizer(gguf_path: Path):
    """PreTrainedTokenizerFast equivalent to llama.cpp's tokenizer for this file."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    r = GGUFReader(str(gguf_path))
    pre = _field(r, "tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise ValueError(
            f"{gguf_path.name}: tokenizer.ggml.pre={pre!r} is not supported by the rebuilt "
            f"tokenizer (supported: {SUPPORTED_PRE}); convert the model to an HF directory"
        )
    tokens: list[str] = _field(r, "tokenizer.ggml.tokens")
    types: list[int] = _field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_WITH_DIGIT_SPLIT:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty in _SPECIAL_TYPES]

    def tok_id(key: str) -> str | None:
        i = _field(r, key)
        return None if i is None else tokens[int(i)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=tok_id("tokenizer.ggml.bos_token_id"),
        eos_token=tok_id("tokenizer.ggml.eos_token_id"),
        unk_token=tok_id("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_id("tokenizer.ggml.padding_token_id"),
        additional_special_tokens=special,
        chat_template=_field(r, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
