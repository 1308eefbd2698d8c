// One-launch decode-step compaction for the whole batch (all requests, layers, KV heads and
// both tiers): PageManager.ensure_decode_room of sglang_diffkv/memory/manager.py, on the GPU.
//
// plan -> one exclusive prefix sum -> disjoint runs of the circular free list -> counters.
// A single block owns the whole batch: the all-or-nothing decision needs the batch total
// before any write, and one block makes that a __syncthreads instead of a grid-wide sync.
// Flat order of requesters is (request, layer, head, tier), as in the torch reference, so
// every (row, tier) receives exactly the page id the reference hands it.
//
// Plain CUDA (no torch headers): nvcc builds it in seconds into a shared library that
// sglang_diffkv/kernels/compaction.py loads with ctypes (cached by source hash); a torch
// extension would spend ~1 min compiling torch headers for one launcher.
#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 1024;

struct Args {
  const int64_t* req;        // [B] request slots
  const uint8_t* want_tier;  // [B, 2] which tiers may grow this step
  int32_t* counts;           // [max_reqs, L, H, 4] (n_high, n_low, high_pages, low_pages)
  int32_t* table;            // [max_reqs, L, H, row_len]
  const int32_t* free_pages; // [num_pages] ring
  int64_t* head;             // 0-dim ring counters
  const int64_t* tail;
  int64_t* result;           // [4]: ok, needed, free (before), rows_ok
  int64_t batch, rows_per_req, row_len, num_pages;
  int32_t tpp_high, tpp_low;
};

// Which tiers of flat row i = (b, layer, head) want a page, and whether the row has room.
__device__ __forceinline__ void plan_row(const Args& a, int64_t i, int64_t* slot, bool* w_hi,
                                         bool* w_lo, bool* room) {
  const int64_t b = i / a.rows_per_req;
  const int64_t r = a.req[b];
  *slot = r * a.rows_per_req + (i % a.rows_per_req);
  const int4 c = reinterpret_cast<const int4*>(a.counts)[*slot];
  *w_hi = c.x == c.z * a.tpp_high && a.want_tier[2 * b];
  *w_lo = c.y == c.w * a.tpp_low && a.want_tier[2 * b + 1];
  *room = (c.z + *w_hi) + (c.w + *w_lo) <= a.row_len;
}

// Rows are split into 32 contiguous runs, one per warp; a warp walks its run 32 rows at a
// time (lane = row, so the 16-byte counter loads coalesce), ranks its pages with a warp
// scan, and warps are ranked by one scan over their totals. Flat order (row, tier) is kept.
__global__ void __launch_bounds__(kThreads, 1) decode_room_kernel(Args a) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int64_t warp_base[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t rows = a.batch * a.rows_per_req;
  const int64_t per_warp = ((rows + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t lo = warp * per_warp;
  const int64_t hi = lo + per_warp < rows ? lo + per_warp : rows;

  // 1. plan: pages wanted by this warp's run, and whether every row has room
  int64_t total = 0;
  bool room_all = true;
#pragma unroll 4
  for (int64_t base = lo; base < hi; base += 32) {
    const int64_t i = base + lane;
    int want = 0;
    if (i < hi) {
      int64_t slot;
      bool w_hi, w_lo, room;
      plan_row(a, i, &slot, &w_hi, &w_lo, &room);
      want = w_hi + w_lo;
      room_all &= room;
    }
    total += __reduce_add_sync(0xffffffffu, want);
  }
  const bool rows_ok = __syncthreads_and(room_all);
  if (lane == 0) warp_base[warp] = total;
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the 32 warp totals
    const int64_t mine = warp_base[lane];
    int64_t incl = mine;
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t up = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += up;
    }
    warp_base[lane] = incl - mine;
  }
  __syncthreads();
  // the grand total is the last warp's base plus its total
  __shared__ int64_t grand;
  if (warp == kWarps - 1 && lane == 0) grand = warp_base[kWarps - 1] + total;
  __syncthreads();
  const int64_t needed = grand;
  const int64_t head = *a.head;
  const int64_t free_now = *a.tail - head;
  const bool ok = rows_ok && needed <= free_now;

  // 2. take: each wanting (row, tier) gets ring slot head + its exclusive rank
  if (ok) {
    int64_t cursor = head + warp_base[warp];
    for (int64_t base = lo; base < hi; base += 32) {
      const int64_t i = base + lane;
      int64_t slot = 0;
      bool w_hi = false, w_lo = false, room;
      if (i < hi) plan_row(a, i, &slot, &w_hi, &w_lo, &room);
      const int want = w_hi + w_lo;
      int incl = want;
      for (int off = 1; off < 32; off <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += up;
      }
      int64_t c = cursor + incl - want;
      if (want) {
        int32_t* cnt = a.counts + 4 * slot;
        int32_t* row = a.table + slot * a.row_len;
        if (w_hi) {
          row[cnt[2]] = a.free_pages[c % a.num_pages];
          cnt[2] += 1;
          ++c;
        }
        if (w_lo) {
          row[a.row_len - 1 - cnt[3]] = a.free_pages[c % a.num_pages];
          cnt[3] += 1;
        }
      }
      cursor += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();  // every thread has read *a.head before it moves
  if (threadIdx.x == 0) {
    if (ok) *a.head = head + needed;
    a.result[0] = ok;
    a.result[1] = needed;
    a.result[2] = free_now;
    a.result[3] = rows_ok;
  }
}

}  // namespace

// Returns the launch's cudaError_t (0 on success).
extern "C" int diffkv_decode_room_launch(
    const int64_t* req, const uint8_t* want_tier, int32_t* counts, int32_t* table,
    const int32_t* free_pages, int64_t* head, const int64_t* tail, int64_t* result,
    int64_t batch, int64_t rows_per_req, int64_t row_len, int64_t num_pages, int32_t tpp_high,
    int32_t tpp_low, cudaStream_t stream) {
  Args a{req,  want_tier, counts, table,        free_pages,   head,     tail,     result,
         batch, rows_per_req, row_len, num_pages, tpp_high, tpp_low};
  decode_room_kernel<<<1, kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}
