"""Extend attention over a compressed prefix (Triton): chunked prefill and radix-cache hits.

An extend step's fresh queries (packed [T, Hq, D], SGLang's extend layout) attend over their
request's paged prefix (mixed K8V4 / K4V2 pages, pruned tokens absent: what the decode pass
reads) and, causally, over the fresh unquantised K/V; one softmax over both. The torch oracle
is ``sglang_diffkv.extend_attention.paged_extend_attention`` (``extend_attention_reference``).

One program per (query tile, KV head, split). A query tile is ``QT`` consecutive fresh tokens
of one request times the KV head's GQA group: ``BLOCK_M = QT * G`` (padded to a power of two)
query rows, so every page and fresh key tile is read once for all of them (the decode
split-K pass has one query per request; here a tile plays its part). A program runs one
online softmax (base 2) over its share of the keys: high pages from the left of the row, low
pages from the right (bit widths are constexprs per loop, as in the decode pass), then fresh
key tiles up to the tile's last query with the causal mask. Keys are not dequantised:
``q . k = sum over key groups of scale * (q . codes) + zero * sum(q)``, codes being exact in
fp16 / bf16; values are dequantised per page tile for the P.V dot.

Splits: with few tiles (short extends over long prefixes) one (tile, head) is split into
``splits`` programs, each taking an equal share of each tier's pages and of the fresh key
tiles; they write (m, l, unnormalised acc) and ``_merge_kernel`` combines them by their LSE
(the decode pass's merge). With ``splits == 1`` the program writes the output and LSE itself.
Shares are computed in the kernel from each row's counters, so no host bound on the prefix
length is needed. Nothing here writes pages (no score accumulation).

Compiled variants: ``splits`` follows the step's batch (any of 1 .. 32), so it is a runtime
argument, and only whether there are splits (SPLIT) is a constexpr; the tile shape is one of
a few powers of two (``variants.tile_shape``). Every launch parameter that follows the batch
is picked by ``variants.extend_launch``: a compile mid-serving stalls a prefill step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_diffkv.extend_attention import ExtendAttention, paged_extend_attention
from sglang_diffkv.kernels import variants
from sglang_diffkv.kernels._tier import INTERPRET, page_views, row_pointers, tier_constexprs
from sglang_diffkv.kernels.variants import EXTEND_BLOCK_M, MAX_SPLITS, tile_shape
from sglang_diffkv.layout import PageGeometry

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_M", "MAX_SPLITS", "default_splits",
           "extend_attention", "extend_attention_reference", "scratch_elements",
           "tile_shape"]

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # (a constexpr: read inside the kernels)
DEFAULT_BLOCK_M = EXTEND_BLOCK_M  # query rows per tile (fresh tokens x GQA group)
DEFAULT_BLOCK_K = 64  # fresh keys per iteration


@triton.jit
def _softmax_step(m, l_sum, acc, logits, v, DOT_F32: tl.constexpr):
    """One online-softmax step (base 2) over a key tile: masked logits are -inf; a row with
    no key seen yet keeps m = -inf, l = 0, acc = 0 (no NaN). P is cast to v's dtype for the
    P.V dot (fp32 with IEEE products under DOT_F32)."""
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(logits - m_use[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_sum, acc * alpha[:, None] + pv


@triton.jit
def _tier_pages(
    m, l_sum, acc, qd, u8, f16, row, n_tok, split, splits, qk_scale,
    PAGE_BYTES: tl.constexpr, ROW_LEN, LOW: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, DOT_F32: tl.constexpr,
    KB: tl.constexpr, VB: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
    N: tl.constexpr, BN: tl.constexpr, KOFF: tl.constexpr, KMOFF: tl.constexpr,
    VOFF: tl.constexpr, VMOFF: tl.constexpr,
):
    """The split's share of one tier's pages: cdiv(pages, splits) pages per split."""
    KPER: tl.constexpr = 8 // KB
    VPER: tl.constexpr = 8 // VB
    KDB: tl.constexpr = D // KPER
    VDB: tl.constexpr = D // VPER
    KGS: tl.constexpr = D // KG
    VGS: tl.constexpr = D // VG
    n_pages = tl.cdiv(n_tok, N)
    per = tl.cdiv(n_pages, splits)
    first = split * per
    last = tl.minimum(first + per, n_pages)
    d = tl.arange(0, D)
    slot = tl.arange(0, BN)
    srow = slot.to(tl.int64)
    # the byte and bit field of every dimension (codes are read straight into [BN, D] tiles)
    kcol = d // KPER
    kshift = (d % KPER) * KB
    vcol = d // VPER
    vshift = (d % VPER) * VB
    qf = qd.to(tl.float32)
    qsum_all = tl.sum(qf, axis=1)
    for pg in range(first, last):
        valid = (slot < N) & (pg * N + slot < n_tok)
        if LOW:
            col = ROW_LEN - 1 - pg
        else:
            col = pg
        page = tl.load(row + col)
        base = page.to(tl.int64) * PAGE_BYTES
        kbytes = tl.load(u8 + (base + KOFF + srow * KDB)[:, None] + kcol[None, :],
                         mask=valid[:, None], other=0).to(tl.int32)
        kc = ((kbytes >> kshift[None, :]) & ((1 << KB) - 1)).to(qd.dtype)
        logits = tl.zeros([BLOCK_M, BN], tl.float32)
        for gg in tl.static_range(KG):
            if KG == 1:
                qg = qd
                qsum = qsum_all
            else:
                sel = ((d // KGS) == gg)[None, :]
                qg = tl.where(sel, qd, 0.0).to(qd.dtype)
                qsum = tl.sum(tl.where(sel, qf, 0.0), axis=1)
            if DOT_F32:
                dots = tl.dot(qg, tl.trans(kc), input_precision="ieee")
            else:
                dots = tl.dot(qg, tl.trans(kc))
            kmeta = (base + KMOFF) // 2 + srow * (2 * KG) + gg * 2
            ks = tl.load(f16 + kmeta, mask=valid, other=0.0).to(tl.float32)
            kz = tl.load(f16 + kmeta + 1, mask=valid, other=0.0).to(tl.float32)
            logits += dots * ks[None, :] + qsum[:, None] * kz[None, :]
        logits = tl.where(valid[None, :], logits * qk_scale, float("-inf"))

        vbytes = tl.load(u8 + (base + VOFF + srow * VDB)[:, None] + vcol[None, :],
                         mask=valid[:, None], other=0).to(tl.int32)
        vc = ((vbytes >> vshift[None, :]) & ((1 << VB) - 1)).to(tl.float32)
        if VG == 1:
            vmeta = (base + VMOFF) // 2 + srow * 2
            vs = tl.load(f16 + vmeta, mask=valid, other=0.0).to(tl.float32)
            vz = tl.load(f16 + vmeta + 1, mask=valid, other=0.0).to(tl.float32)
            v = vc * vs[:, None] + vz[:, None]
        else:
            vs = tl.zeros([BN, D], tl.float32)
            vz = tl.zeros([BN, D], tl.float32)
            for gg in tl.static_range(VG):
                vmeta = (base + VMOFF) // 2 + srow * (2 * VG) + gg * 2
                s_g = tl.load(f16 + vmeta, mask=valid, other=0.0).to(tl.float32)
                z_g = tl.load(f16 + vmeta + 1, mask=valid, other=0.0).to(tl.float32)
                in_group = ((d // VGS) == gg)[None, :]
                vs = tl.where(in_group, s_g[:, None], vs)
                vz = tl.where(in_group, z_g[:, None], vz)
            v = vc * vs + vz
        if DOT_F32:
            m, l_sum, acc = _softmax_step(m, l_sum, acc, logits, v, DOT_F32)
        else:  # dequantised values in fp16 for the dot (codes * scale + zero, rounded once)
            m, l_sum, acc = _softmax_step(m, l_sum, acc, logits, v.to(tl.float16), DOT_F32)
    return m, l_sum, acc


# TILES, ROW_LEN and splits follow the batch or the server's size: runtime ints, not
# specialised (each value class would be a compile of its own mid-serving)
@triton.jit(do_not_specialize=("TILES", "ROW_LEN", "splits"))
def _extend_kernel(
    q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, starts, lens,
    u8, f16, table, t_sr, t_sh, counts, c_sr, c_sh, req,
    out, o_st, o_sh, lse, l_st, l_sh, acc_ptr, ml_ptr, qk_scale, TILES, ROW_LEN, splits,
    PAGE_BYTES: tl.constexpr, G: tl.constexpr, QT: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    H_KB: tl.constexpr, H_VB: tl.constexpr, H_KG: tl.constexpr, H_VG: tl.constexpr,
    H_N: tl.constexpr, H_BN: tl.constexpr, H_KOFF: tl.constexpr, H_KMOFF: tl.constexpr,
    H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SOFF: tl.constexpr, H_POFF: tl.constexpr,
    L_KB: tl.constexpr, L_VB: tl.constexpr, L_KG: tl.constexpr, L_VG: tl.constexpr,
    L_N: tl.constexpr, L_BN: tl.constexpr, L_KOFF: tl.constexpr, L_KMOFF: tl.constexpr,
    L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SOFF: tl.constexpr, L_POFF: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    b = pid // TILES
    t0 = (pid % TILES) * QT
    n = tl.load(lens + b)
    if t0 < n:
        start = tl.load(starts + b)
        r = tl.arange(0, BLOCK_M)
        t = r // G
        tok = t0 + t
        rvalid = (t < QT) & (tok < n)
        hq = h * G + r % G
        d = tl.arange(0, D)
        qrow = (start + tok).to(tl.int64)
        qd = tl.load(q + (qrow * q_st + hq * q_sh)[:, None] + d[None, :],
                     mask=rvalid[:, None], other=0.0)
        if DOT_F32:
            qd = qd.to(tl.float32)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)

        # ---- the compressed prefix: high pages, then low pages ----
        row, cnt = row_pointers(table, t_sr, t_sh, counts, c_sr, c_sh, req, b, h)
        m, l_sum, acc = _tier_pages(
            m, l_sum, acc, qd, u8, f16, row, tl.load(cnt), s, splits, qk_scale, PAGE_BYTES,
            ROW_LEN, False, BLOCK_M, D, DOT_F32, H_KB, H_VB, H_KG, H_VG, H_N, H_BN, H_KOFF, H_KMOFF,
            H_VOFF, H_VMOFF)
        m, l_sum, acc = _tier_pages(
            m, l_sum, acc, qd, u8, f16, row, tl.load(cnt + 1), s, splits, qk_scale,
            PAGE_BYTES, ROW_LEN, True, BLOCK_M, D, DOT_F32, L_KB, L_VB, L_KG, L_VG, L_N, L_BN,
            L_KOFF, L_KMOFF, L_VOFF, L_VMOFF)

        # ---- the fresh tokens, causally: keys [0, min(n, t0 + QT)) ----
        kend = tl.minimum(n, t0 + QT)
        n_blk = tl.cdiv(kend, BK)
        per = tl.cdiv(n_blk, splits)
        first = s * per
        last = tl.minimum(first + per, n_blk)
        kk = tl.arange(0, BK)
        for blk in range(first, last):
            kpos = blk * BK + kk
            kvalid = kpos < kend
            krow = (start + kpos).to(tl.int64)
            kt = tl.load(k + (krow * k_st + h * k_sh)[:, None] + d[None, :],
                         mask=kvalid[:, None], other=0.0)
            if DOT_F32:
                logits = tl.dot(qd, tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(qd, tl.trans(kt))
            ok = (kpos[None, :] <= tok[:, None]) & kvalid[None, :]
            logits = tl.where(ok, logits * qk_scale, float("-inf"))
            vt = tl.load(v + (krow * v_st + h * v_sh)[:, None] + d[None, :],
                         mask=kvalid[:, None], other=0.0)
            m, l_sum, acc = _softmax_step(m, l_sum, acc, logits, vt, DOT_F32)

        if not SPLIT:
            o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(out + (qrow * o_st + hq * o_sh)[:, None] + d[None, :],
                     o.to(out.dtype.element_ty), mask=rvalid[:, None])
            tl.store(lse + qrow * l_st + hq * l_sh, (m + tl.log2(l_sum)) * LN2, mask=rvalid)
        else:
            buf = ((pid * tl.num_programs(1) + h) * splits + s).to(tl.int64)
            tl.store(acc_ptr + (buf * BLOCK_M + r)[:, None] * D + d[None, :], acc)
            tl.store(ml_ptr + buf * 2 * BLOCK_M + r, m)
            tl.store(ml_ptr + (buf * 2 + 1) * BLOCK_M + r, l_sum)


@triton.jit(do_not_specialize=("TILES", "splits"))
def _merge_kernel(
    lens, starts, out, o_st, o_sh, lse, l_st, l_sh, acc_ptr, ml_ptr, TILES, splits,
    G: tl.constexpr, QT: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
):
    """Combine a (tile, head)'s splits by their (m, l): the output and natural-log LSE."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // TILES
    t0 = (pid % TILES) * QT
    n = tl.load(lens + b)
    if t0 < n:
        r = tl.arange(0, BLOCK_M)
        t = r // G
        tok = t0 + t
        rvalid = (t < QT) & (tok < n)
        hq = h * G + r % G
        d = tl.arange(0, D)
        head = ((pid * tl.num_programs(1) + h) * splits).to(tl.int64)
        m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(0, splits):
            m_max = tl.maximum(m_max, tl.load(ml_ptr + (head + s) * 2 * BLOCK_M + r))
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        l_tot = tl.zeros([BLOCK_M], tl.float32)
        o = tl.zeros([BLOCK_M, D], tl.float32)
        for s in range(0, splits):
            w = tl.exp2(tl.load(ml_ptr + (head + s) * 2 * BLOCK_M + r) - m_safe)
            l_tot += w * tl.load(ml_ptr + ((head + s) * 2 + 1) * BLOCK_M + r)
            a = tl.load(acc_ptr + ((head + s) * BLOCK_M + r)[:, None] * D + d[None, :])
            o += a * w[:, None]
        o = o / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
        qrow = (tl.load(starts + b) + tok).to(tl.int64)
        tl.store(out + (qrow * o_st + hq * o_sh)[:, None] + d[None, :],
                 o.to(out.dtype.element_ty), mask=rvalid[:, None])
        tl.store(lse + qrow * l_st + hq * l_sh, (m_safe + tl.log2(l_tot)) * LN2, mask=rvalid)


def default_splits(programs: int, device: torch.device) -> int:
    """``variants.default_splits`` on ``device``'s SMs."""
    return variants.default_splits(programs, variants.sm_count(device))


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    *,
    max_new: int | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_k: int = DEFAULT_BLOCK_K,
    splits: int | None = None,
    num_warps: int = 4,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ExtendAttention:
    """``paged_extend_attention`` on the device: q [T, Hq, D], k / v [T, Hkv, D] (one dtype:
    fp16, bf16 or fp32), request b's fresh tokens at rows extend_start_loc[b] + [0,
    extend_seq_lens[b]); its prefix is layer ``layer`` of table / counts row req_idx[b].
    Returns (out in q's dtype unless ``out`` is given, natural-log LSE fp32 [T, Hq]); rows
    outside every request are not written. ``max_new``: the host's max(extend_seq_lens)
    (read off the device, synchronising, when absent). ``splits``: programs per (tile,
    head) (``default_splits`` when absent). ``scratch``: (acc, ml) fp32 buffers of at least
    ``scratch_elements`` for splits > 1 (allocated when absent)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    b = req_idx.shape[0]
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"q [T, Hq, D], k and v [T, Hkv, D] expected, got {tuple(q.shape)} / "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    if hq % hkv or d != geometry.head_dim or k.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match (Hq a "
                         f"multiple of Hkv, head_dim {geometry.head_dim})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16,
                                                                torch.float32):
        raise ValueError(f"q, k and v must share one dtype of fp16 / bf16 / fp32, got "
                         f"{q.dtype} / {k.dtype} / {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dimension")
    if table.dim() != 4 or table.shape[2] != hkv or table.stride(-1) != 1:
        raise ValueError(f"table must be int32 [max_reqs, layers, {hkv}, row_len] with "
                         f"contiguous rows, got {tuple(table.shape)}")
    if counts.shape[:3] != table.shape[:3] or table.dtype != torch.int32 or (
            counts.dtype != torch.int32):
        raise ValueError("table and counts must be int32 and cover the same rows")
    if extend_start_loc.shape != (b,) or extend_seq_lens.shape != (b,):
        raise ValueError(f"extend_start_loc and extend_seq_lens must be [{b}] like req_idx")
    if pages.shape[1] != geometry.page_bytes:
        raise ValueError(f"pages must be [num_pages, {geometry.page_bytes}]")
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if max_new is None:
        max_new = int(extend_seq_lens.max()) if b else 0
    group = hq // hkv
    if b == 0 or max_new <= 0:
        return ExtendAttention(out, lse)
    launch = variants.extend_launch(group, b, hkv, max_new, variants.sm_count(q.device),
                                    block_m=block_m, splits=splits)
    bm, tiles, splits = launch.block_m, launch.tiles, launch.splits
    dev = q.device
    starts = extend_start_loc.to(device=dev, dtype=torch.int64)
    lens = extend_seq_lens.to(device=dev, dtype=torch.int32)
    if launch.split:
        need = scratch_elements(b * tiles, hkv, splits, bm, d)
        if scratch is None:
            scratch = (torch.empty(need[0], dtype=torch.float32, device=dev),
                       torch.empty(need[1], dtype=torch.float32, device=dev))
        elif scratch[0].numel() < need[0] or scratch[1].numel() < need[1]:
            raise ValueError(f"scratch holds {scratch[0].numel()} / {scratch[1].numel()} "
                             f"elements, {need} needed")
        acc, ml = scratch
    else:
        acc = ml = lse  # (unused: the programs write out / lse themselves)
    u8, f16, _, _ = page_views(pages)
    tab, cnt = table[:, layer], counts[:, layer]
    tiers = {**tier_constexprs(geometry.high, "H_"), **tier_constexprs(geometry.low, "L_")}
    dot_f32 = INTERPRET or q.dtype == torch.float32
    _extend_kernel[(b * tiles, hkv, splits)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        starts, lens, u8, f16, tab, tab.stride(0), tab.stride(1), cnt, cnt.stride(0),
        cnt.stride(1), req_idx, out, out.stride(0), out.stride(1), lse, lse.stride(0),
        lse.stride(1), acc, ml, sm_scale * LOG2E, tiles, table.shape[-1], splits,
        PAGE_BYTES=geometry.page_bytes, G=group, D=d, BK=block_k, DOT_F32=dot_f32,
        **launch.constexprs(), **tiers, num_warps=num_warps,
    )
    if launch.split:
        _merge_kernel[(b * tiles, hkv)](
            lens, starts, out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
            acc, ml, tiles, splits, G=group, QT=launch.qt, BLOCK_M=bm, D=d,
            num_warps=num_warps,
        )
    return ExtendAttention(out, lse)


def scratch_elements(tiles: int, num_kv_heads: int, splits: int, block_m: int,
                     head_dim: int) -> tuple[int, int]:
    """fp32 elements of the split scratch (acc, ml) for ``tiles`` query tiles in all."""
    rows = tiles * num_kv_heads * splits * block_m
    return rows * head_dim, rows * 2


def extend_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    pages: torch.Tensor,
    geometry: PageGeometry,
    table: torch.Tensor,
    counts: torch.Tensor,
    req_idx: torch.Tensor,
    layer: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    **_: object,
) -> ExtendAttention:
    """The torch oracle (``paged_extend_attention``) behind the kernel's signature."""
    return paged_extend_attention(q, k, v, extend_start_loc, extend_seq_lens, pages, geometry,
                                  table, counts, req_idx, layer, sm_scale, out=out, lse=lse)
