// One-launch decode-step compaction for the whole batch (all requests, layers, KV heads and
// both tiers): PageManager.ensure_decode_room of sglang_diffkv/memory/manager.py, on the GPU.
//
// plan -> one exclusive prefix sum -> disjoint runs of the circular free list -> counters.
// The all-or-nothing decision needs the batch total before any write. The main kernel is a
// cooperative launch (one block per SM, all resident) with two grid-wide syncs; where a
// cooperative launch is refused, a single-block version (__syncthreads only) runs instead.
// Flat order of requesters is (request, layer, head, tier), as in the torch reference, so
// every (row, tier) receives exactly the page id the reference hands it.
//
// Plain CUDA (no torch headers): nvcc builds it in seconds into a shared library that
// sglang_diffkv/kernels/compaction.py loads with ctypes (cached by source hash); a torch
// extension would spend ~1 min compiling torch headers for one launcher.
#include <cooperative_groups.h>
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

// One warp takes pages for rows [lo, hi) in flat order: 32 rows at a time, each wanting
// (row, tier) gets ring slot ``cursor`` + its exclusive rank (a warp scan of the wants).
__device__ __forceinline__ void take_rows(const Args& a, int64_t lo, int64_t hi,
                                          int64_t cursor, int lane) {
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
    take_rows(a, lo, hi, head + warp_base[warp], lane);
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

namespace cg = cooperative_groups;
constexpr int kCoopThreads = 256;
constexpr int kCoopWarps = kCoopThreads / 32;

__device__ __forceinline__ int64_t warp_sum(int64_t v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Same contract as decode_room_kernel, spread over the grid: every warp owns a contiguous
// run of rows; warp totals and room flags go through ``scratch`` [2 * warps] between the
// syncs, and each warp sums the totals of the warps before it (L2-resident, ~1k values).
__global__ void __launch_bounds__(kCoopThreads) decode_room_coop_kernel(Args a,
                                                                        int64_t* scratch) {
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kCoopWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kCoopWarps + (threadIdx.x >> 5);
  const int64_t rows = a.batch * a.rows_per_req;
  const int64_t per_warp = ((rows + nwarps - 1) / nwarps + 31) / 32 * 32;
  const int64_t lo = gw * per_warp;
  const int64_t hi = lo + per_warp < rows ? lo + per_warp : rows;

  // 1. plan (loads only, independent across iterations: they overlap)
  int64_t mine = 0;
  bool room_all = true;
#pragma unroll 4
  for (int64_t i = lo + lane; i < hi; i += 32) {
    int64_t slot;
    bool w_hi, w_lo, room;
    plan_row(a, i, &slot, &w_hi, &w_lo, &room);
    mine += w_hi + w_lo;
    room_all &= room;
  }
  const int64_t total = warp_sum(mine);
  const bool warp_room = __all_sync(0xffffffffu, room_all);
  if (lane == 0) {
    scratch[gw] = total;
    scratch[nwarps + gw] = warp_room;
  }
  grid.sync();

  int64_t before = 0, all = 0, bad = 0;
  for (int64_t w = lane; w < nwarps; w += 32) {
    const int64_t t = scratch[w];
    all += t;
    before += w < gw ? t : 0;
    bad += scratch[nwarps + w] == 0;
  }
  before = warp_sum(before);
  all = warp_sum(all);
  bad = warp_sum(bad);
  const int64_t head = *a.head;
  const int64_t free_now = *a.tail - head;
  const bool ok = bad == 0 && all <= free_now;

  // 2. take, 32 rows at a time in flat order, ranks by warp scan
  if (ok) {
    take_rows(a, lo, hi, head + before, lane);
  }
  grid.sync();  // every thread has read *a.head before it moves
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (ok) *a.head = head + all;
    a.result[0] = ok;
    a.result[1] = all;
    a.result[2] = free_now;
    a.result[3] = bad == 0;
  }
}

}  // namespace

// Returns the launch's cudaError_t (0 on success).
extern "C" int diffkv_decode_room_launch(
    const int64_t* req, const uint8_t* want_tier, int32_t* counts, int32_t* table,
    const int32_t* free_pages, int64_t* head, const int64_t* tail, int64_t* result,
    int64_t batch, int64_t rows_per_req, int64_t row_len, int64_t num_pages, int32_t tpp_high,
    int32_t tpp_low, int64_t* scratch, int64_t scratch_len, int32_t cooperative,
    cudaStream_t stream) {
  Args a{req,  want_tier, counts, table,        free_pages,   head,     tail,     result,
         batch, rows_per_req, row_len, num_pages, tpp_high, tpp_low};
  // co-resident blocks for the cooperative launch: queried once per process
  static int max_blocks = -1;
  if (max_blocks < 0) {
    int dev = 0, sms = 0, coop = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_room_coop_kernel,
                                                  kCoopThreads, 0);
    max_blocks = coop ? sms * (per_sm < 1 ? 0 : 1) : 0;
    cudaGetLastError();
  }
  const int64_t rows = batch * rows_per_req;
  int64_t blocks = (rows + kCoopThreads - 1) / kCoopThreads;
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks > scratch_len / (2 * kCoopWarps)) blocks = scratch_len / (2 * kCoopWarps);
  if (cooperative && blocks >= 1) {
    void* args[] = {&a, &scratch};
    const cudaError_t err = cudaLaunchCooperativeKernel(
        reinterpret_cast<void*>(decode_room_coop_kernel), dim3(static_cast<unsigned>(blocks)),
        dim3(kCoopThreads), args, 0, stream);
    if (err == cudaSuccess) return 0;
    cudaGetLastError();  // refused (e.g. not capturable here): the single-block kernel runs
  }
  decode_room_kernel<<<1, kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}
