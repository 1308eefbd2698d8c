// Split-K pass of DiffKV's decode attention on tensor cores: the CUDA twin of
// _partition_kernel in sglang_diffkv/kernels/decode_attention.py (same grid, same scratch,
// same merge pass), for the tier pair K8V4 (high) / K4V2 (low) with one metadata group per
// token, head_dim 128 and a GQA group of at most 8 query heads.
//
// Why a hand-written kernel: the Triton pass is instruction-bound (~514 / 780 SASS
// instructions per thread per high / low page, 10 barriers) because every code goes through
// an unpacked register tile and a shared-memory layout change before the MMA. Here each
// thread's loads ARE its MMA fragments, so no code ever leaves its register:
//
// * Both contractions use free index permutations. In S = Q K^T (A = q, B = codes) any
//   assignment of head dims to MMA k positions works if q's fragment uses the same one; in
//   O^T = V^T P^T (A = codes, B = probabilities) any assignment of tokens to k positions and
//   of dims to rows works if the output is un-permuted at the end. So a thread loads whole
//   16 / 32-byte runs of its own token (keys) or of its own 16 dims (values) and builds
//   fp16x2 fragment registers from them with one AND (or PRMT) each.
// * Codes become fp16 with no conversion: a code c (with its field's shift, a power of two
//   sigma) masked into the low bits of an fp16 is the subnormal c * sigma * 2^-24, exact,
//   and tensor cores multiply subnormals exactly. The 2^24 / sigma goes into q (keys: q is
//   pre-scaled by 1 / sigma per dim) or into the final un-scaling (values, per output row).
// * High tier: the QK accumulator fragment (rows = heads, columns = tokens) is, in fp16,
//   exactly the B fragment of the PV MMA (the FlashAttention-2 register reuse). Rows 8..15
//   of that MMA are padding (at most 8 heads).
// * Low tier: S^T = K q^T instead. A warp's 16 tokens fill all 16 rows of the A operand (no
//   padding rows: half the QK MMAs, and q is a plain B fragment), and one movmatrix.trans
//   per 8x8 block brings the probabilities into the PV B layout (see tier_partition).
// * Four warps split each page's tokens (8 per warp for the high tier, 16 for the low one)
//   and keep their own online softmax; they meet once per partition, in shared memory.
//   Each warp keeps its running max lazily: it rescales only when a new max exceeds the
//   held one by more than 8 (base-2), so the per-page rescale of the accumulators is rare.
// * Pages reach the SM by a bulk-copy pipeline (cp.async.bulk into shared memory, one
//   mbarrier per stage, STAGES pages in flight per program; thread 0 issues, reading each
//   page id one refill ahead). STAGES = 0 instead prefetches the next page into registers.
//   Measured on the H100 (docs/benchmarks.md, session 4): 2-4 stages reach 70-81% of copy
//   bandwidth where register prefetch reaches 52-56%.
//
// Scratch written (as the Triton pass, see DecodeAttentionPlan): acc [buf, BLOCK_G, D] fp32
// (unnormalised, relative to m), ml [buf, 2, BLOCK_G] (m, l; base 2), p [buf, ITERS, G, RS]
// fp16 probabilities relative to the writing warp's running max, mit [buf, ITERS, 4, G] that
// max per (iteration, warp): the merge pass reads mit with MW = 4.
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

// Argument structs live outside the unnamed namespace: a type from it would give the
// extern "C" launcher below internal linkage (no exported symbol).
struct TierArgs {
  int32_t tokens_per_page, pages_per_part, maxp;
  int32_t key_offset, key_meta_offset, value_offset, value_meta_offset;
  int32_t copy_bytes;  // bytes of a page the pass reads: up to the score segment, 16-aligned
};

struct SplitArgs {
  const void* q;
  int64_t q_sb, q_sh;
  int32_t q_bf16;
  const uint8_t* pages;
  int64_t page_bytes;
  const int32_t* table;
  int64_t t_sr, t_sh;
  const int32_t* counts;
  int64_t c_sr, c_sh;
  const void* req;  // int32 or int64 request rows (req_i64)
  int32_t req_i64;
  float* acc;
  float* ml;
  __half* p;
  float* mit;
  float qk_scale;  // sm_scale * log2(e)
  int32_t row_len, group, block_g, iters_max, row_stride, maxp_total;
  int32_t stages;  // 0: register prefetch of the next page; else bulk-copy pipeline depth
  TierArgs hi, lo;
};

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxGroup = 8;       // MMA rows 0..7 carry the query heads, 8..15 are padding
constexpr float kLazyRescale = 8.0f;
constexpr float kTwo24 = 16777216.0f;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ void mma_k16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// Transpose of an 8x8 b16 matrix held in the m8n8 fragment layout (thread l holds row l / 4,
// columns 2 (l % 4) + {0, 1}): afterwards it holds the same positions of the transpose.
// Warp-collective: volatile so that it is never sunk into a branch that only some lanes take.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// 2^x on the SFU without exp2f's subnormal-range fix-up (an underflow to 0 is what we want)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <int NW>
struct Words {
  uint32_t w[NW];
};

// A vector load from global memory (read-only path) or from shared memory.
template <bool GLOBAL, typename T>
__device__ __forceinline__ T load_vec(const uint8_t* p) {
  if constexpr (GLOBAL) {
    return __ldg(reinterpret_cast<const T*>(p));
  } else {
    return *reinterpret_cast<const T*>(p);
  }
}

// NW consecutive 32-bit words from a 16-byte (NW >= 4), 8-byte or 4-byte aligned address.
template <int NW, bool GLOBAL>
__device__ __forceinline__ Words<NW> load_words(const uint8_t* p) {
  Words<NW> r;
  if constexpr (NW % 4 == 0) {
#pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
      const uint4 v = load_vec<GLOBAL, uint4>(p + 16 * i);
      r.w[4 * i] = v.x, r.w[4 * i + 1] = v.y, r.w[4 * i + 2] = v.z, r.w[4 * i + 3] = v.w;
    }
  } else if constexpr (NW == 2) {
    const uint2 v = load_vec<GLOBAL, uint2>(p);
    r.w[0] = v.x, r.w[1] = v.y;
  } else {
    static_assert(NW == 1, "1, 2 or a multiple of 4 words");
    r.w[0] = load_vec<GLOBAL, uint32_t>(p);
  }
  return r;
}

// ---- the bulk-copy pipeline: whole pages into shared memory, completion on mbarriers ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// One thread: copy ``bytes`` (a multiple of 16, both ends 16-byte aligned) from global to
// shared memory; the copy's arrival completes the barrier's current phase.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Fragment register R of a key chunk of KB-bit codes: halves (byte pi, byte pi + 2) of word
// R / (2F), field f, with pi = (R / F) % 2 and f = R % F (F = 8 / KB fields per byte). Its
// two local dims are key_dim(R, 0) and key_dim(R, 1), both scaled by 2^(KB f).
template <int KB>
__device__ __forceinline__ uint32_t key_frag(const uint32_t* words, int R) {
  constexpr int F = 8 / KB;
  const uint32_t w = words[R / (2 * F)] >> (8 * ((R / F) % 2));
  const uint32_t field = ((1u << KB) - 1) << (KB * (R % F));
  return w & (field * 0x00010001u);
}

template <int KB>
__host__ __device__ constexpr int key_dim(int R, int half) {
  constexpr int F = 8 / KB;
  return (4 * (R / (2 * F)) + (R / F) % 2 + 2 * half) * F + R % F;
}

// Fragment register for value slot s (a local dim: the thread's dims are its 16-dim chunk)
// of two tokens: halves (token t0, token t1), scaled by 2^(VB (s % F)).
template <int VB>
__device__ __forceinline__ uint32_t value_frag(const uint32_t* w0, const uint32_t* w1, int s) {
  constexpr int F = 8 / VB;
  const int k = (s / F) % 4;  // byte within the word
  const uint32_t x = __byte_perm(w0[s / (4 * F)], w1[s / (4 * F)], k | ((4 + k) << 8));
  const uint32_t field = ((1u << VB) - 1) << (VB * (s % F));
  return x & (field * 0x00010001u);
}

template <typename QT, int D, int KB, int VB, int NT, bool LOW, int STAGES>
__device__ __forceinline__ void tier_partition(const SplitArgs& a, const TierArgs& t,
                                               const int32_t* row, int n_tok, int b, int h,
                                               int part, int slot_base, float* smem,
                                               uint8_t* stage, uint64_t* bars) {
  static_assert(D == 128, "the thread-to-dim mapping below assumes head_dim 128");
  constexpr int KDB = D * KB / 8;      // key bytes per token
  constexpr int KCH = KDB / 4;         // key bytes per thread (a quarter of the token)
  constexpr int KW = KCH / 4;          // ... as words
  constexpr int KREGS = KW * 2 * (8 / KB);  // fragment registers of a key chunk
  constexpr int KSTEPS = KREGS / 2;    // k16 MMA steps over D
  static_assert(KSTEPS * 16 == D, "a key chunk covers a quarter of the head dims");
  constexpr int VDB = D * VB / 8;      // value bytes per token
  constexpr int VCH = VDB / 8;         // value bytes per thread per token (16 dims)
  constexpr int VW = VCH / 4;
  constexpr int MT = D / 16;           // PV m-tiles (rows = dims)
  constexpr int TPW = 8 * NT;          // tokens per warp per page
  constexpr int NVT = 2 * NT;          // value tokens per thread per page
  static_assert(NT == 1 || NT % 2 == 0, "k8 for one n-tile, k16 steps otherwise");

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, c = lane & 3;  // MMA group (head / token / dim chunk), quad lane
  const int G = a.group, N = t.tokens_per_page;

  // ---- q fragments for this tier's key layout, pre-scaled by 1 / sigma per dim ----
  uint32_t qa[KSTEPS][2];
  float qsum = 0.f;
  {
    float qv[D / 4];
    if (gq < G) {
      const QT* qp = reinterpret_cast<const QT*>(a.q) + b * a.q_sb + (int64_t)(h * G + gq) * a.q_sh
                     + c * (D / 4);
#pragma unroll
      for (int i = 0; i < D / 4; i += 8) {  // 16-byte loads (rows of q are 16-byte aligned)
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(qp + i));
        const QT* e = reinterpret_cast<const QT*>(&v);
#pragma unroll
        for (int j = 0; j < 8; ++j) qv[i + j] = __half2float(__float2half_rn(to_float(e[j])));
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 4; ++i) qv[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < D / 4; ++i) qsum += qv[i];
#pragma unroll
    for (int R = 0; R < KREGS; ++R) {
      const float inv = 1.f / float(1 << (KB * (R % (8 / KB))));
      qa[R / 2][R % 2] = pack_h2(qv[key_dim<KB>(R, 0)] * inv, qv[key_dim<KB>(R, 1)] * inv);
    }
    qsum += __shfl_xor_sync(kFull, qsum, 1);
    qsum += __shfl_xor_sync(kFull, qsum, 2);
  }
  // the high tier's MMA rows 8..15 (no query head): a zero ptxas cannot see through, so it
  // keeps the fragment quads allocated instead of re-zeroing their padding registers per page
  const uint32_t pad = static_cast<uint32_t>(a.group) >> 31;
  const float qsum2 = qsum * a.qk_scale;
  const float key_unit = kTwo24 * a.qk_scale;
  // low tier: the sums of this thread's two logit heads 2c, 2c + 1 (lanes 8c and 8c + 4)
  float qs2[2] = {0.f, 0.f};
  if constexpr (LOW) {
    qs2[0] = __shfl_sync(kFull, qsum2, 8 * c);
    qs2[1] = __shfl_sync(kFull, qsum2, 8 * c + 4);
  }

  // ---- per-thread byte offsets inside a page. Slots run up to the tier's power-of-two
  // tile (past tokens_per_page for the last warp); the host checks every segment has room
  // for that many slots inside the page, so no clamping is needed: those slots read
  // in-page bytes that the masks below discard. ----
  const int k_off = t.key_offset + (warp * TPW + gq) * KDB + c * KCH;
  // metadata (one 4-byte word per token) of the tokens whose logits the thread holds: high
  // tier, tokens 2c, 2c + 1 of each n-tile (QK C columns); low tier, token gq (S^T C rows)
  const int meta_tok = warp * TPW + (LOW ? gq : 2 * c);
  const int km_off = t.key_meta_offset + meta_tok * 4;
  const int vm_off = t.value_meta_offset + meta_tok * 4;
  const int v_off = t.value_offset + (warp * TPW + 2 * c) * VDB + gq * VCH;

  const int n_pages = (n_tok + N - 1) / N;
  const int first = part * t.pages_per_part;
  const int last = min(first + t.pages_per_part, n_pages);
  const int64_t buf = ((int64_t)b * gridDim.y + h) * a.maxp_total + slot_base + part;

  // this thread's probabilities (head gq, tokens 2c, 2c + 1 of each n-tile) and its warp's
  // running max, at iteration 0; iteration it is it * stride further
  // (loop-carried pointers: ptxas would otherwise recompute the 64-bit products per page)
  __half* p_row = a.p + ((buf * a.iters_max) * G + gq) * a.row_stride + warp * TPW + 2 * c;
  const int p_iter_stride = G * a.row_stride;
  // (low tier: lanes 0..7 store it, head 2c + gq)
  float* mit_row = a.mit + ((buf * a.iters_max) * kWarps + warp) * G + (LOW ? 2 * c + gq : gq);

  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_ref = -INFINITY, l_part = 0.f, z_part = 0.f;  // high tier: head gq
  // low tier: heads 2c, 2c + 1; m_lo[e] is uniform over the 8 lanes c, c + 4, ..., c + 28
  float m_lo[2] = {-INFINITY, -INFINITY}, l_lo[2] = {0.f, 0.f}, z_lo[2] = {0.f, 0.f};

  using Meta = std::conditional_t<LOW, uint32_t, uint2>;  // metadata words per n-tile
  struct Page {
    Words<KW> k[NT];
    Words<VW> v[NVT];
    Meta km[NT], vm[NT];
  };
  // fragments of one page from its base address (global memory, or a shared-memory stage)
  auto load_page = [&](const uint8_t* base, auto global) {
    constexpr bool GL = decltype(global)::value;
    Page pg;
    const uint8_t* kp = base + k_off;
    const uint8_t* kmp = base + km_off;
    const uint8_t* vmp = base + vm_off;
    const uint8_t* vp = base + v_off;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      pg.k[nt] = load_words<KW, GL>(kp + nt * 8 * KDB);
      pg.km[nt] = load_vec<GL, Meta>(kmp + nt * 32);
      pg.vm[nt] = load_vec<GL, Meta>(vmp + nt * 32);
    }
#pragma unroll
    for (int i = 0; i < NVT; ++i) {
      pg.v[i] = load_words<VW, GL>(vp + ((i / 2) * 8 + i % 2) * VDB);
    }
    return pg;
  };
  auto page_id = [&](int page_local) {
    return __ldg(row + (LOW ? a.row_len - 1 - page_local : page_local));
  };

  auto process = [&](const Page& cur, int pl) {
    const int live = min(N, n_tok - pl * N);  // valid slots of this page
    if constexpr (LOW) {
      static_assert(NT == 2, "S^T = K q^T: the warp's 16 tokens are one m16 tile");
      // ---- logits: S^T = K q^T. A = keys, rows = the warp's tokens: a0 / a2 are token gq's
      // fragments (n-tile 0), a1 / a3 token 8 + gq's (n-tile 1), at the same k positions
      // (the thread's own dims, key_dim) as the high tier's B; so qa serves as B unchanged
      // (b0 / b1: head gq, k 2c, 2c + 1 / 2c + 8, 2c + 9). No padding rows.
      // Invariant: cc[2t + e] = logit of token warp * TPW + 8t + gq, head 2c + e. ----
      float cc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        mma_k16(cc, key_frag<KB>(cur.k[0].w, 2 * j), key_frag<KB>(cur.k[1].w, 2 * j),
                key_frag<KB>(cur.k[0].w, 2 * j + 1), key_frag<KB>(cur.k[1].w, 2 * j + 1),
                qa[j][0], qa[j][1]);
      }
      float s[2][2];  // [token t][head e], as cc
      bool ok[2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        ok[t] = warp * TPW + 8 * t + gq < live;
        const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&cur.km[t]));
        const float ks = sz.x * key_unit;  // the token's scale, shared by both heads
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[t][e] = ok[t] ? cc[2 * t + e] * ks + sz.y * qs2[e] : -INFINITY;
        }
      }

      // ---- online softmax with a lazily raised reference max, per head ----
      // A head's logits are spread over the 8 lanes of one quad lane c (2 tokens each), and
      // m_lo[e] is uniform over them: "some lane's own max passes the threshold" equals "the
      // head's max does", so the reduction (3 shuffle levels, lanes xor 4, 8, 16) waits for
      // the rare rescale, which the branch is warp-uniform to take.
      float mx[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) mx[e] = fmaxf(s[0][e], s[1][e]);
      if (__any_sync(kFull, mx[0] > m_lo[0] + kLazyRescale || mx[1] > m_lo[1] + kLazyRescale)) {
        float al[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          mx[e] = fmaxf(mx[e], __shfl_xor_sync(kFull, mx[e], 4));
          mx[e] = fmaxf(mx[e], __shfl_xor_sync(kFull, mx[e], 8));
          mx[e] = fmaxf(mx[e], __shfl_xor_sync(kFull, mx[e], 16));
          const float m_new = fmaxf(m_lo[e], mx[e]);
          al[e] = m_new == -INFINITY ? 1.f : fast_exp2(m_lo[e] - m_new);
          m_lo[e] = m_new;
          l_lo[e] *= al[e];
          z_lo[e] *= al[e];
        }
        // the PV accumulator's columns are heads 2c, 2c + 1: the thread's own alphas
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          acc[i][0] *= al[0], acc[i][1] *= al[1], acc[i][2] *= al[0], acc[i][3] *= al[1];
        }
      }
      float p[2][2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) p[t][e] = ok[t] ? fast_exp2(s[t][e] - m_lo[e]) : 0.f;
      }
      // pb[t]: (p, head 2c | p, head 2c + 1) of token 8t + gq, the stored probabilities;
      // wb[t]: the same times the token's value scale (a masked token's metadata may be
      // stale bytes (NaN): select, never multiply by 0)
      uint32_t pb[2], wb[2];
      float vz[2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&cur.vm[t]));
        vz[t] = v.y;
        pb[t] = pack_h2(p[t][0], p[t][1]);
        wb[t] = pack_h2(ok[t] ? p[t][0] * v.x : 0.f, ok[t] ? p[t][1] * v.x : 0.f);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        l_lo[e] += p[0][e] + p[1][e];
        z_lo[e] += (ok[0] ? p[0][e] * vz[0] : 0.f) + (ok[1] ? p[1][e] * vz[1] : 0.f);
      }
      // Each of pb[t], wb[t] is an 8x8 (token 8t + row, head col) block in the m8n8 fragment
      // layout; transposed, thread (gq, c) holds head gq, tokens 8t + 2c, 8t + 2c + 1: the
      // high tier's layout, so the stores below and the PV B fragment are as there.
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        pb[t] = transpose8x8(pb[t]);
        wb[t] = transpose8x8(wb[t]);
      }
      if (gq < G) {
#pragma unroll
        for (int t = 0; t < 2; ++t) *reinterpret_cast<uint32_t*>(p_row + t * 8) = pb[t];
      }
      if (gq < 2 && 2 * c + gq < G) *mit_row = gq ? m_lo[1] : m_lo[0];
      p_row += p_iter_stride;
      mit_row += kWarps * G;

      // ---- O^T += V^T P^T as in the high tier (k = tokens 2c, 2c + 1 | 8 + 2c, 9 + 2c) ----
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_k16(acc[mt], value_frag<VB>(cur.v[0].w, cur.v[1].w, 2 * mt),
                value_frag<VB>(cur.v[0].w, cur.v[1].w, 2 * mt + 1),
                value_frag<VB>(cur.v[2].w, cur.v[3].w, 2 * mt),
                value_frag<VB>(cur.v[2].w, cur.v[3].w, 2 * mt + 1), wb[0], wb[1]);
      }
    } else {
      // ---- logits: S = q K^T, columns = this warp's tokens ----
      float s[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float cc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
          mma_k16(cc, qa[j][0], pad, qa[j][1], pad, key_frag<KB>(cur.k[nt].w, 2 * j),
                  key_frag<KB>(cur.k[nt].w, 2 * j + 1));
        }
        const __half2* km = reinterpret_cast<const __half2*>(&cur.km[nt]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool ok = warp * TPW + nt * 8 + 2 * c + e < live;
          const float2 sz = __half22float2(km[e]);  // (scale, zero)
          const float logit = cc[e] * sz.x * key_unit + sz.y * qsum2;
          s[nt][e] = ok ? logit : -INFINITY;
        }
      }

      // ---- online softmax with a lazily raised reference max ----
      float mx = s[0][0];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][0], s[nt][1]));
      // m_ref is uniform over a head's quad, so "some thread's own max passes the threshold"
      // equals "the quad's max does": the quad reduction (two shuffles per page) can wait for
      // the rare rescale, which the branch is warp-uniform to take (same decision, same bits)
      if (__any_sync(kFull, mx > m_ref + kLazyRescale)) {
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
        const float m_new = fmaxf(m_ref, mx);
        const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(m_ref - m_new);
        m_ref = m_new;
        l_part *= alpha;
        z_part *= alpha;
        const float al0 = __shfl_sync(kFull, alpha, 8 * c);      // head 2c
        const float al1 = __shfl_sync(kFull, alpha, 8 * c + 4);  // head 2c + 1
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          acc[i][0] *= al0, acc[i][1] *= al1, acc[i][2] *= al0, acc[i][3] *= al1;
        }
      }
      uint32_t wb[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const __half2* vm = reinterpret_cast<const __half2*>(&cur.vm[nt]);
        const float2 v0 = __half22float2(vm[0]), v1 = __half22float2(vm[1]);
        // a masked token's metadata may be stale bytes (NaN): select, never multiply by 0
        const bool ok0 = s[nt][0] != -INFINITY, ok1 = s[nt][1] != -INFINITY;
        const float p0 = ok0 ? fast_exp2(s[nt][0] - m_ref) : 0.f;
        const float p1 = ok1 ? fast_exp2(s[nt][1] - m_ref) : 0.f;
        l_part += p0 + p1;
        z_part += (ok0 ? p0 * v0.y : 0.f) + (ok1 ? p1 * v1.y : 0.f);
        wb[nt] = pack_h2(ok0 ? p0 * v0.x : 0.f, ok1 ? p1 * v1.x : 0.f);
        if (gq < G) {
          *reinterpret_cast<__half2*>(p_row + nt * 8) = __floats2half2_rn(p0, p1);
        }
      }
      if (c == 0 && gq < G) *mit_row = m_ref;
      p_row += p_iter_stride;
      mit_row += kWarps * G;

      // ---- O^T += V^T P^T: rows = this thread group's dims, k = tokens, columns = heads ----
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (NT == 1) {
          mma_k8(acc[mt], value_frag<VB>(cur.v[0].w, cur.v[1].w, 2 * mt),
                 value_frag<VB>(cur.v[0].w, cur.v[1].w, 2 * mt + 1), wb[0]);
        } else {
#pragma unroll
          for (int kk = 0; kk < NT / 2; ++kk) {
            const Words<VW>* v = cur.v + 4 * kk;
            mma_k16(acc[mt], value_frag<VB>(v[0].w, v[1].w, 2 * mt),
                    value_frag<VB>(v[0].w, v[1].w, 2 * mt + 1),
                    value_frag<VB>(v[2].w, v[3].w, 2 * mt),
                    value_frag<VB>(v[2].w, v[3].w, 2 * mt + 1), wb[2 * kk], wb[2 * kk + 1]);
          }
        }
      }
    }
  };

  const int n_it = last - first;
  if constexpr (STAGES == 0) {
    using G1 = std::integral_constant<bool, true>;
    Page cur = load_page(a.pages + (int64_t)page_id(first) * a.page_bytes, G1{});
    for (int i = 0; i < n_it; ++i) {
      Page nxt = cur;
      if (i + 1 < n_it) {
        nxt = load_page(a.pages + (int64_t)page_id(first + i + 1) * a.page_bytes, G1{});
      }
      process(cur, first + i);
      cur = nxt;
    }
  } else {
    // Thread 0 keeps STAGES pages in flight (bulk copies of the bytes the pass reads) and
    // reads each page id one refill ahead, so no thread waits on a dependent load.
    using G0 = std::integral_constant<bool, false>;
    const int stride = a.page_bytes;
    const bool issuer = threadIdx.x == 0;
    int next_id = 0;
    if (issuer) {
#pragma unroll
      for (int st = 0; st < STAGES; ++st) {
        if (st < n_it) {
          bulk_copy(stage + st * stride, a.pages + (int64_t)page_id(first + st) * a.page_bytes,
                    t.copy_bytes, bars + st);
        }
      }
      if (STAGES < n_it) next_id = page_id(first + STAGES);
    }
    for (int i = 0; i < n_it; ++i) {
      const int st = i % STAGES;
      mbar_wait(bars + st, (i / STAGES) & 1);
      const Page cur = load_page(stage + st * stride, G0{});
      __syncthreads();  // every warp holds its fragments: the stage may be refilled
      if (issuer && i + STAGES < n_it) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        bulk_copy(stage + st * stride, a.pages + (int64_t)next_id * a.page_bytes, t.copy_bytes,
                  bars + st);
        if (i + STAGES + 1 < n_it) next_id = page_id(first + i + STAGES + 1);
      }
      process(cur, first + i);
    }
  }

  // ---- meet the other warps: common max, summed accumulators, in shared memory ----
  float* sm_m = smem;                             // [warp][head]
  float* sm_l = sm_m + kWarps * kMaxGroup;
  float* sm_z = sm_l + kWarps * kMaxGroup;
  float* sm_acc = sm_z + kWarps * kMaxGroup;      // [warp][head][D]
  if constexpr (LOW) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // head 2c + e: lanes c, c + 4, ..., c + 28
#pragma unroll
      for (int o = 4; o < 32; o *= 2) {
        l_lo[e] += __shfl_xor_sync(kFull, l_lo[e], o);
        z_lo[e] += __shfl_xor_sync(kFull, z_lo[e], o);
      }
    }
    if (gq == 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sm_m[warp * kMaxGroup + 2 * c + e] = m_lo[e];
        sm_l[warp * kMaxGroup + 2 * c + e] = l_lo[e];
        sm_z[warp * kMaxGroup + 2 * c + e] = z_lo[e];
      }
    }
  } else {
    l_part += __shfl_xor_sync(kFull, l_part, 1);
    l_part += __shfl_xor_sync(kFull, l_part, 2);
    z_part += __shfl_xor_sync(kFull, z_part, 1);
    z_part += __shfl_xor_sync(kFull, z_part, 2);
    if (c == 0) {
      sm_m[warp * kMaxGroup + gq] = m_ref;
      sm_l[warp * kMaxGroup + gq] = l_part;
      sm_z[warp * kMaxGroup + gq] = z_part;
    }
  }
  __syncthreads();
  auto warp_weight = [&](int w, int head) {
    float mm = -INFINITY;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) mm = fmaxf(mm, sm_m[i * kMaxGroup + head]);
    const float mw = sm_m[w * kMaxGroup + head];
    return mw == -INFINITY ? 0.f : fast_exp2(mw - mm);
  };
  {
    const float w0 = warp_weight(warp, 2 * c), w1 = warp_weight(warp, 2 * c + 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // c0/c1: slot 2mt, c2/c3: slot 2mt + 1
        const int sl = 2 * mt + r;
        const float unscale = kTwo24 / float(1 << (VB * (sl % (8 / VB))));
        const int d = gq * (D / 8) + sl;
        sm_acc[(warp * kMaxGroup + 2 * c) * D + d] = acc[mt][2 * r] * unscale * w0;
        sm_acc[(warp * kMaxGroup + 2 * c + 1) * D + d] = acc[mt][2 * r + 1] * unscale * w1;
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * D; e += kThreads) {
    const int head = e / D, d = e % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      o += sm_acc[(w * kMaxGroup + head) * D + d] +
           warp_weight(w, head) * sm_z[w * kMaxGroup + head];
    }
    a.acc[(buf * a.block_g + head) * D + d] = o;
  }
  if (threadIdx.x < a.block_g) {
    const int head = threadIdx.x;
    float mm = -INFINITY, l = 0.f;
    if (head < G) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sm_m[w * kMaxGroup + head]);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) l += warp_weight(w, head) * sm_l[w * kMaxGroup + head];
    }
    a.ml[(buf * 2) * a.block_g + head] = mm;
    a.ml[(buf * 2 + 1) * a.block_g + head] = l;
  }
}

constexpr int kSmemFloats = 3 * kWarps * kMaxGroup + kWarps * kMaxGroup * 128;

template <typename QT, int HNT, int LNT, int STAGES>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const SplitArgs a) {
  __shared__ float smem[kSmemFloats];
  __shared__ alignas(8) uint64_t bars[STAGES > 0 ? STAGES : 1];
  extern __shared__ __align__(128) uint8_t stage[];  // STAGES pages
  if constexpr (STAGES > 0) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int st = 0; st < STAGES; ++st) mbar_init(bars + st);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
  const int b = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  const int64_t r = a.req_i64 ? reinterpret_cast<const int64_t*>(a.req)[b]
                              : reinterpret_cast<const int32_t*>(a.req)[b];
  const int32_t* row = a.table + r * a.t_sr + h * a.t_sh;
  const int32_t* cnt = a.counts + r * a.c_sr + h * a.c_sh;
  if (s < a.hi.maxp) {
    const int n = cnt[0];
    if (s * a.hi.pages_per_part < (n + a.hi.tokens_per_page - 1) / a.hi.tokens_per_page) {
      tier_partition<QT, 128, 8, 4, HNT, false, STAGES>(a, a.hi, row, n, b, h, s, 0, smem,
                                                        stage, bars);
    }
  } else {
    const int n = cnt[1];
    const int part = s - a.hi.maxp;
    if (part * a.lo.pages_per_part < (n + a.lo.tokens_per_page - 1) / a.lo.tokens_per_page) {
      tier_partition<QT, 128, 4, 2, LNT, true, STAGES>(a, a.lo, row, n, b, h, part, a.hi.maxp,
                                                       smem, stage, bars);
    }
  }
}

}  // namespace

// The tier pairs and page shapes this file is built for; the Python side checks first.
extern "C" int diffkv_decode_split_supports(int32_t head_dim, int32_t hi_bn, int32_t lo_bn) {
  return head_dim == 128 && hi_bn == 32 && lo_bn == 64;
}

extern "C" int32_t diffkv_decode_split_args_size() { return sizeof(SplitArgs); }

// Returns the launch's cudaError_t (0 on success). grid = (batch, kv_heads, maxp_total).
extern "C" int diffkv_decode_split_launch(const SplitArgs* a, int32_t batch, int32_t kv_heads,
                                          cudaStream_t stream) {
  const dim3 grid(batch, kv_heads, a->maxp_total);
  const size_t dyn = static_cast<size_t>(a->stages) * a->page_bytes;
  switch (a->stages * 2 + (a->q_bf16 ? 1 : 0)) {
    case 0: decode_split_kernel<__half, 1, 2, 0><<<grid, kThreads, 0, stream>>>(*a); break;
    case 1: decode_split_kernel<__nv_bfloat16, 1, 2, 0><<<grid, kThreads, 0, stream>>>(*a); break;
    case 4: decode_split_kernel<__half, 1, 2, 2><<<grid, kThreads, dyn, stream>>>(*a); break;
    case 5: decode_split_kernel<__nv_bfloat16, 1, 2, 2><<<grid, kThreads, dyn, stream>>>(*a); break;
    case 6: decode_split_kernel<__half, 1, 2, 3><<<grid, kThreads, dyn, stream>>>(*a); break;
    case 7: decode_split_kernel<__nv_bfloat16, 1, 2, 3><<<grid, kThreads, dyn, stream>>>(*a); break;
    case 8: decode_split_kernel<__half, 1, 2, 4><<<grid, kThreads, dyn, stream>>>(*a); break;
    case 9: decode_split_kernel<__nv_bfloat16, 1, 2, 4><<<grid, kThreads, dyn, stream>>>(*a); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}
