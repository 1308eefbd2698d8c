#!/usr/bin/env python3
"""Write a SmolLM2-135M-shaped Llama with random weights scaled for sharp logits.

SGLang's ``--load-format dummy`` fills weights with U(-1e-3, 1e-3): logits are then nearly
uniform (the top-200 tokens hold ~0.2% of the mass) and attention is flat, so neither a
logit comparison nor the compression policy sees anything. This model (head_dim 64, 9 query
/ 3 KV heads, 30 layers, hidden 576; vocab 128256 so the dummy tokenizer's ids fit) has
N(0, sigma) weights large enough that attention is peaked and the next-token distribution
has a clear top. It stands in for the real SmolLM2-135M, whose only offline copy (a 98 MB
GGUF) exceeds what the GPU machine can receive.

    python3 scripts/sglang_backend_random_model.py OUT_DIR   # needs the dummy_model folder
    RANDOM_HEADS=8,4 python3 scripts/sglang_backend_random_model.py OUT_DIR   # for TP 2
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30,
         "max_position_embeddings": 8192, "tie_word_embeddings": False}
# RANDOM_HEADS=Q,KV: other head counts (e.g. 8,4 for tensor parallelism at TP 2, which needs
# both divisible by the TP size; SmolLM2's 9 / 3 are not); head_dim and hidden stay
if os.environ.get("RANDOM_HEADS"):
    _q, _kv = (int(x) for x in os.environ["RANDOM_HEADS"].split(","))
    if _q % _kv:
        raise SystemExit(f"RANDOM_HEADS={_q},{_kv}: query heads must be a multiple of KV heads")
    SHAPE |= {"num_attention_heads": _q, "num_key_value_heads": _kv}
# q/k projection scale: 0.12 gives attention logits of std ~8 (near one-hot, chaotic across
# 30 layers); 0.04 gives std ~1 (peaked but stable)
QK_SIGMA = float(os.environ.get("RANDOM_QK_SIGMA", "0.12"))


def main(out: str) -> None:
    d = Path(out)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(SHAPE)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(0)
    h, inter, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], cfg["vocab_size"]
    hd, nq, nkv = SHAPE["head_dim"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]

    def w(rows: int, cols: int, sigma: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * sigma).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(v, h, 1.0), "lm_head.weight": w(v, h, 0.15),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": w(nq * hd, h, QK_SIGMA),
            p + "self_attn.k_proj.weight": w(nkv * hd, h, QK_SIGMA),
            p + "self_attn.v_proj.weight": w(nkv * hd, h, 0.05),
            p + "self_attn.o_proj.weight": w(h, nq * hd, 0.02),
            p + "mlp.gate_proj.weight": w(inter, h, 0.03),
            p + "mlp.up_proj.weight": w(inter, h, 0.03),
            p + "mlp.down_proj.weight": w(h, inter, 0.02),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    print(f"random model: {sum(t.numel() for t in sd.values()) / 1e6:.0f} M parameters in {d}")


if __name__ == "__main__":
    main(sys.argv[1])
