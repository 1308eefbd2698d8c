"""Decode attention kernel vs the torch oracle (paged_decode_attention + add_scores)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sglang_diffkv.config import K4V2, K4V2_GROUPED, K8V4, K8V4_GROUPED
from sglang_diffkv.kernels import decode_split_cuda as split_cuda
from sglang_diffkv.kernels._nvcc import nvcc_path
from sglang_diffkv.kernels.decode_attention import (
    TRITON_ASM,
    VARIANTS,
    DecodeAttentionPlan,
    decode_attention_reference,
)
from sglang_diffkv.kernels.decode_split_cuda import geometry_reason
from sglang_diffkv.kernels.testing import random_decode_case, rel_err
from sglang_diffkv.layout import PageGeometry


def score_view(pages: torch.Tensor) -> torch.Tensor:
    return pages.view(torch.float32)


def check_case(geo, contexts, hkv, group, dtype, high, low, device, seed, plan_batch=None,
               **plan_kw):
    """``plan_batch``: build the plan for that many requests (>= len(contexts)) and run it on
    the smaller batch, as the SGLang seam does with its power-of-two batch buckets."""
    case = random_decode_case(geo, contexts, hkv, num_layers=2, high_frac=high, low_frac=low,
                              jitter=True, spare_reqs=2, device=device, seed=seed)
    b, d = len(contexts), geo.head_dim
    torch.manual_seed(seed)
    q = torch.randn(b, hkv * group, d, device=device).to(dtype)
    plan = DecodeAttentionPlan.build(geo, hkv * group, hkv, plan_batch or b, case.max_context,
                                     device, **plan_kw)
    for buf in (plan.acc, plan.ml, plan.mit, plan.pbuf):
        buf.fill_(float("nan"))  # scratch is poisoned: every read value must be written
    out = torch.full((b, hkv * group, d), float("nan"), device=device)
    lse = torch.full((b, hkv * group), float("nan"), device=device)
    ref_pages = case.pages.clone()
    plan.run(q, case.pages, case.table, case.counts, case.req_idx, 1, d**-0.5, out=out,
             lse=lse)
    ref_out, ref_lse = decode_attention_reference(q, ref_pages, geo, case.table, case.counts,
                                                  case.req_idx, 1, d**-0.5)
    assert rel_err(out, ref_out.float()) < 5e-3
    live = torch.isfinite(ref_lse)  # -inf: a (request, head) whose cache is empty
    assert torch.equal(torch.isfinite(lse), live)
    assert rel_err(lse[live], ref_lse[live]) < 1e-5
    # Only score fields may change, and they must match the oracle's accumulation.
    changed = case.pages != ref_pages
    s, sr = score_view(case.pages), score_view(ref_pages)
    moved = (s != sr) & ~(torch.isnan(s) & torch.isnan(sr))
    fields = changed.view(-1, 4).any(-1).view_as(s)
    assert torch.equal(fields, moved), "bytes outside the accumulated scores changed"
    torch.testing.assert_close(s[moved], sr[moved], rtol=2e-3, atol=1e-6)
    return case


@pytest.mark.parametrize(
    "head_dim,tiers,group,dtype",
    [
        (64, (K8V4_GROUPED, K4V2_GROUPED), 4, torch.bfloat16),
        (128, (K8V4, K4V2), 2, torch.float16),
        (64, (K8V4, K4V2), 1, torch.bfloat16),
    ],
)
def test_decode_attention_cpu(head_dim, tiers, group, dtype):
    geo = PageGeometry.build(head_dim, *tiers)
    check_case(geo, [150, 70, 301], 2, group, dtype, 0.4, 0.4, "cpu", seed=head_dim + group,
               pages_per_iter=2, target_programs=24)


@pytest.mark.parametrize("variant", [v for v in TRITON_ASM if v != "base"])
@pytest.mark.parametrize("tiers", [(K8V4, K4V2), (K8V4_GROUPED, K4V2_GROUPED)])
def test_decode_attention_variants_cpu(variant, tiers):
    # (under the interpreter the inline-asm conversion takes the plain path; the asm itself
    # is checked byte by byte in test_codes.py and on the GPU by sglang_diffkv.kernels.gpu_check)
    geo = PageGeometry.build(64, *tiers)
    check_case(geo, [130, 61, 200], 2, 4, torch.bfloat16, 0.45, 0.4, "cpu", seed=11,
               pages_per_iter=1, target_programs=12, variant=variant)


@pytest.mark.parametrize("tile", [128, 8192])
def test_merge_tile_sizes_match_the_oracle_cpu(tile):
    # the merge pass's score tile (merge_tile elements) sets how many partition iterations
    # one loop step covers: one per step, or the whole partition at once
    geo = PageGeometry.build(64, K8V4, K4V2)
    check_case(geo, [150, 70, 301], 2, 4, torch.bfloat16, 0.4, 0.4, "cpu", seed=tile,
               pages_per_iter=1, target_programs=12, merge_tile=tile)


def test_plan_rejects_unknown_variant():
    geo = PageGeometry.build(64, K8V4, K4V2)
    with pytest.raises(ValueError, match="variant"):
        DecodeAttentionPlan.build(geo, 4, 2, 2, 64, "cpu", variant="nope")


def test_cuda_variant_names_what_it_cannot_run():
    geo = PageGeometry.build(128, K8V4, K4V2)
    assert geometry_reason(geo, 4, 1) is None
    assert "one page per iteration" in geometry_reason(geo, 4, 2)
    assert "GQA group 16" in geometry_reason(geo, 16, 1)
    assert "head_dim=64" in geometry_reason(PageGeometry.build(64, K8V4, K4V2), 4, 1)
    grouped = PageGeometry.build(128, K8V4_GROUPED, K4V2_GROUPED)
    assert "one metadata group" in geometry_reason(grouped, 4, 1)
    with pytest.raises(ValueError, match="variant='cuda' cannot run this plan: not a CUDA"):
        DecodeAttentionPlan.build(geo, 8, 2, 2, 256, "cpu", variant="cuda")
    # "auto" takes the Triton asm pass where the CUDA one cannot run
    assert DecodeAttentionPlan.build(geo, 8, 2, 2, 256, "cpu").variant == "asm"


def test_decode_attention_one_page_per_iteration_cpu():
    # (the oracle's gather_tokens cannot take a tier that is empty in the whole batch, so
    # nearly-single-tier mixes stand in for all-high / all-low here)
    geo = PageGeometry.build(64, K8V4, K4V2)
    check_case(geo, [97, 33], 1, 4, torch.float16, 0.97, 0.03, "cpu", seed=5,
               pages_per_iter=1, target_programs=8)


def test_plan_for_a_larger_batch_runs_a_smaller_one_cpu():
    # A plan built for 8 requests runs 3 (grid from q, scratch indexed by the program's
    # batch index): same output, LSE and score updates as the oracle, with poisoned scratch
    # beyond the 3 requests' share never read.
    geo = PageGeometry.build(64, K8V4, K4V2)
    check_case(geo, [120, 47, 201], 2, 4, torch.float16, 0.4, 0.45, "cpu", seed=21,
               plan_batch=8, pages_per_iter=1, target_programs=16)


def test_plan_runs_an_empty_batch():
    geo = PageGeometry.build(64, K8V4, K4V2)
    plan = DecodeAttentionPlan.build(geo, 4, 2, 8, 64, "cpu")
    case = random_decode_case(geo, [40], 2)
    out, lse = plan.run(torch.randn(0, 4, 64), case.pages, case.table, case.counts,
                        case.req_idx[:0], 0, 0.1)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_plan_rejects_bad_shapes():
    geo = PageGeometry.build(64, K8V4, K4V2)
    plan = DecodeAttentionPlan.build(geo, 4, 2, 2, 64, "cpu")
    case = random_decode_case(geo, [40, 50], 2)
    # more requests than the plan's scratch holds
    with pytest.raises(ValueError, match=r"q must be \[B, 4, 64\] with B <= 2"):
        plan.run(torch.randn(3, 4, 64), case.pages, case.table, case.counts, case.req_idx, 0,
                 0.1)
    with pytest.raises(ValueError, match="q must be"):
        plan.run(torch.randn(2, 8, 64), case.pages, case.table, case.counts, case.req_idx, 0,
                 0.1)
    with pytest.raises(ValueError, match="req_idx must be"):
        plan.run(torch.randn(1, 4, 64), case.pages, case.table, case.counts, case.req_idx, 0,
                 0.1)
    with pytest.raises(ValueError, match="not a multiple"):
        DecodeAttentionPlan.build(geo, 5, 2, 2, 64, "cpu")


def test_plan_reruns_with_prepared_views_bit_identically_cpu():
    """The plan's launch constants are cached at build (and ``common`` per row length);
    runs with ``page_views`` passed in (the per-step path) and computed per call, and a
    second plan's first run, give the same output, LSE and pages, bit for bit, layer after
    layer on the same plan."""
    from sglang_diffkv.kernels._tier import page_views

    geo = PageGeometry.build(64, K8V4_GROUPED, K4V2_GROUPED)
    case = random_decode_case(geo, [130, 61, 200], 2, num_layers=2, high_frac=0.45,
                              low_frac=0.4, jitter=True, spare_reqs=2, seed=31)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(32)).to(torch.bfloat16)
    kw = dict(pages_per_iter=1, target_programs=12)
    plan = DecodeAttentionPlan.build(geo, 8, 2, 4, case.max_context, "cpu", **kw)
    fresh = DecodeAttentionPlan.build(geo, 8, 2, 4, case.max_context, "cpu", **kw)
    p_call, p_step = case.pages.clone(), case.pages.clone()
    views = page_views(p_step)
    for layer in (0, 1, 0):
        want = fresh.run(q, p_call, case.table, case.counts, case.req_idx, layer, 0.125)
        got = plan.run(q, p_step, case.table, case.counts, case.req_idx, layer, 0.125,
                       views=views)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(p_step, p_call)
        fresh = DecodeAttentionPlan.build(geo, 8, 2, 4, case.max_context, "cpu", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mix", [(0.98, 0.01), (0.01, 0.98), (0.3, 0.5)])
def test_decode_attention_gpu(mix, variant):
    geo = PageGeometry.build(128, K8V4, K4V2)
    check_case(geo, [1000, 4096, 3000, 17], 8, 4, torch.bfloat16, *mix, "cuda", seed=3,
               variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", split_cuda.STAGES)
@pytest.mark.parametrize("group,dtype", [(8, torch.float16), (3, torch.bfloat16),
                                         (1, torch.float16)])
def test_decode_attention_cuda_groups_gpu(group, dtype, stages):
    # the CUDA pass maps query heads onto MMA rows 0..7: full, odd and single-head groups;
    # every pipeline depth (register prefetch and 2-4 bulk-copy stages)
    geo = PageGeometry.build(128, K8V4, K4V2)
    check_case(geo, [33, 2000, 700, 58, 1, 5000], 4, group, dtype, 0.3, 0.5, "cuda",
               seed=group, variant="cuda", num_stages=stages, target_programs=64)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed on this machine")
def test_cuda_split_library_builds_and_matches_the_python_struct(tmp_path):
    # CPU CI: the source compiles, exports the launcher and agrees with ctypes on the
    # argument struct's layout (reading its size runs no GPU code)
    lib = ctypes.CDLL(str(split_cuda.LIBRARY.build(tmp_path)))
    split_cuda.declare(lib)  # raises on a missing launcher or a struct size mismatch
    assert lib.diffkv_decode_split_args_size() == ctypes.sizeof(split_cuda.SplitArgs)
