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

__global__ void __launch_bounds__(kThreads, 1) decode_room_kernel(Args a) {
  __shared__ int64_t scan[kThreads];
  const int tid = threadIdx.x;
  const int64_t rows = a.batch * a.rows_per_req;
  const int64_t per = (rows + kThreads - 1) / kThreads;
  const int64_t lo = tid * per;
  const int64_t hi = lo + per < rows ? lo + per : rows;

  // 1. plan: pages wanted by this thread's contiguous run of rows
  int64_t mine = 0;
  bool room_all = true;
  for (int64_t i = lo; i < hi; ++i) {
    int64_t slot;
    bool w_hi, w_lo, room;
    plan_row(a, i, &slot, &w_hi, &w_lo, &room);
    mine += w_hi + w_lo;
    room_all &= room;
  }
  const bool rows_ok = __syncthreads_and(room_all);

  // 2. inclusive Hillis-Steele scan over the block (1024 entries, 10 steps)
  scan[tid] = mine;
  __syncthreads();
  for (int off = 1; off < kThreads; off <<= 1) {
    const int64_t add = tid >= off ? scan[tid - off] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  const int64_t needed = scan[kThreads - 1];
  const int64_t head = *a.head;
  const int64_t free_now = *a.tail - head;
  const bool ok = rows_ok && needed <= free_now;

  // 3. take: each wanting (row, tier) gets ring slot head + its exclusive rank
  if (ok) {
    int64_t cursor = head + scan[tid] - mine;
    for (int64_t i = lo; i < hi; ++i) {
      int64_t slot;
      bool w_hi, w_lo, room;
      plan_row(a, i, &slot, &w_hi, &w_lo, &room);
      int32_t* c = a.counts + 4 * slot;
      int32_t* row = a.table + slot * a.row_len;
      if (w_hi) {
        row[c[2]] = a.free_pages[cursor % a.num_pages];
        c[2] += 1;
        ++cursor;
      }
      if (w_lo) {
        row[a.row_len - 1 - c[3]] = a.free_pages[cursor % a.num_pages];
        c[3] += 1;
        ++cursor;
      }
    }
  }
  __syncthreads();  // every thread has read *a.head before it moves
  if (tid == 0) {
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
