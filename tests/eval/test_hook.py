"""The hooked attention on tiny random models: exact bypass, the reference DiffKV cache
against the dense fake-quant path, and the lifecycle bookkeeping."""

import pytest
import torch
from tiny import tiny

from sglang_diffkv.config import DiffKVConfig, TierConfig, preset
from sglang_diffkv.eval.backend import DenseBackend
from sglang_diffkv.eval.baselines import UniformBackend
from sglang_diffkv.eval.diffkv_backend import DiffKVBackend
from sglang_diffkv.eval.hook import ATTN_NAME, Router, hooked
from sglang_diffkv.eval.runner import greedy, teacher_force

P, T = 80, 12


def _ids(n_prompts: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (n_prompts, P + T + 1), generator=g)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_exact_bypass_reproduces_the_model_logits(arch):
    lm = tiny(arch)
    ids = _ids(2)
    (s,) = teacher_force(lm.model, [DenseBackend("exact", lm.shape, [0, 1])], ids, P)
    # decode through the hook == the plain model's full forward at every scored position
    assert s.kl.abs().max() < 1e-6
    assert bool(s.top1.all())
    torch.testing.assert_close(s.nll, s.ref_nll, atol=2e-5, rtol=0)
    assert lm.model.config._attn_implementation != ATTN_NAME  # restored after the block


def test_hook_off_is_the_plain_model():
    lm = tiny()
    ids = _ids(1)[:, :40]
    with torch.inference_mode():
        plain = lm.model(input_ids=ids, use_cache=False).logits
        with hooked(lm.model, Router([])):
            off = lm.model(input_ids=ids, use_cache=False).logits
    assert torch.equal(plain, off)


def test_reference_cache_without_compression_equals_dense_k8v4():
    """no-compression keeps every token high at K8V4 (one group): the paged reference cache
    and the dense fake-quant baseline must give the same logits at every step."""
    lm = tiny()
    ids = _ids(2, seed=3)
    nocomp = preset("no-compression")
    assert nocomp.high == TierConfig(8, 4)
    d, u = teacher_force(
        lm.model,
        [DiffKVBackend("nocomp", lm.shape, [0, 1], nocomp),
         UniformBackend("k8v4", lm.shape, [0, 1], TierConfig(8, 4))],
        ids, P,
    )
    assert d.kl.max() > 0  # quantisation does change the logits ...
    torch.testing.assert_close(d.kl, u.kl, atol=1e-6, rtol=1e-4)  # ... identically
    assert torch.equal(d.top1, u.top1)
    frac = d.memory.fractions
    assert torch.allclose(frac[..., 0], torch.ones_like(frac[..., 0]))


def test_per_row_thresholds_share_one_cache_and_order_memory():
    """Rows of one DiffKV backend carry their own (alpha_h, alpha_l); stronger thresholds
    keep fewer bytes, and the fractions partition the sequence."""
    lm = tiny()
    ids = _ids(1, seed=4)
    base = DiffKVConfig.from_dict({"preset": "default", "window": 16, "score_queries": 16})
    alphas = [(0.0, 0.0), (2.0, 0.0), (8.0, 1.5)]
    (s,) = teacher_force(
        lm.model, [DiffKVBackend("grid", lm.shape, [0, 0, 0], base, alphas)], ids, P)
    b = s.memory.bytes_per_token
    assert b[0] > b[1] > b[2]
    f = s.memory.fractions
    assert torch.allclose(f.sum(-1), torch.ones_like(f[..., 0]), atol=1e-9)
    assert float(f[2, ..., 2].mean()) > 0  # alpha_l = 1.5 prunes
    assert float(f[0, ..., 0].min()) == 1.0  # alpha 0 keeps everything high
    # rows with equal thresholds would be identical; distinct ones differ
    assert not torch.equal(s.kl[0], s.kl[2])


def test_greedy_bypass_matches_hf_generate():
    lm = tiny()
    prompt = _ids(1, seed=5)[:, :30]
    (toks,), _ = greedy(lm.model, [DenseBackend("exact", lm.shape, [0])], prompt, 6)
    with torch.inference_mode():
        hf = lm.model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6,
                               attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(toks[0], hf[0, 30:])
