"""Static state of DiffKV's CUDA-graph decode (``DiffKVAttnBackend``'s graph methods).

A captured graph replays its kernels with the arguments of its capture: the same buffers,
grids and scalars. So every per-step input of the decode path lives in one set of buffers
sized for the largest captured batch, and each captured batch size ``bs`` uses their first
``bs`` rows:

- ``req`` (cache row per batch row), ``positions``, ``alpha`` and ``seed`` (benchmark mode):
  written by ``load`` before each replay. Rows past the real batch are padding: they point
  at the pool's pad request (never allocated, counters zero, so attention over it reads
  nothing) with position -1 (the policy kernel stores nothing for it). SGLang's own padded
  ``req_pool_indices`` are stale, so they are never used.
- one ``DecodeStep`` per batch size: the policy step's prepared inputs (views of the
  buffers above) and a decode-attention plan for ``bs`` requests of up to the cache's
  ``max_context`` tokens (a graph cannot resize its grid or scratch per step). All plans
  share one ``ScratchArena``: graphs replay one at a time.

Page allocation (``begin_decode``) stays outside the graph, in the replay's metadata step:
it needs the host (success check), the graph does not.
"""

from __future__ import annotations

import torch

from sglang_diffkv.sglang.ops import DecodeStep, DiffKVOps


class DecodeGraphState:
    def __init__(self, ops: DiffKVOps, pad_req: int, max_bs: int, num_q_heads: int) -> None:
        if not ops.use_kernels:
            raise ValueError("CUDA-graph decode needs the Triton kernel path "
                             "(SGLANG_DIFFKV_KERNELS is 0: the torch reference syncs)")
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self.ops = ops
        self.pad_req = pad_req
        self.max_bs = max_bs
        self.num_q_heads = num_q_heads
        dev = ops.cache.device
        self.req = torch.full((max_bs,), pad_req, dtype=torch.int64, device=dev)
        self.positions = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.alpha = torch.zeros(max_bs, 2, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.arena = ops.k.ScratchArena(dev)
        self.steps: dict[int, DecodeStep] = {}

    def step(self, bs: int) -> DecodeStep:
        """The captured batch size ``bs``'s step inputs, built on first use (at capture,
        outside the graph: plans allocate)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"batch size {bs} outside the captured range 1..{self.max_bs}")
        step = self.steps.get(bs)
        if step is None:
            c = self.ops.cache
            mix = c.config.bench_mix
            policy = self.ops.policy_k.prepare_decode_step(
                c.pages, self.req[:bs], self.positions[:bs], self.alpha[:bs],
                c.spec.num_kv_heads, bench=None if mix is None else (self.seed[:bs], mix),
            )
            # the kernels must read the buffers load() writes, not copies of them
            for got, want in ((policy.positions, self.positions), (policy.alpha, self.alpha)):
                if got.data_ptr() != want.data_ptr():
                    raise AssertionError("prepared decode inputs copied a static buffer")
            plan = self.ops.k.DecodeAttentionPlan.build(
                c.geometry, self.num_q_heads, c.spec.num_kv_heads, bs, c.spec.max_context,
                c.device, arena=self.arena,
            )
            step = self.steps[bs] = DecodeStep(max_seq_len=None, policy=policy,
                                               plans={self.num_q_heads: plan})
        return step

    def load(self, bs: int, req: torch.Tensor, positions: torch.Tensor) -> None:
        """This replay's real requests into rows [0, n) and padding into [n, bs)."""
        n = req.numel()
        if n > bs or positions.shape != (n,):
            raise ValueError(f"{n} requests (positions {tuple(positions.shape)}) do not fit "
                             f"the captured batch size {bs}")
        c = self.ops.cache
        self.req[:n].copy_(req)
        self.req[n:bs].fill_(self.pad_req)
        self.positions[:n].copy_(positions)
        self.positions[n:bs].fill_(-1)
        self.alpha[:n].copy_(c.alpha[req])
        if c.config.bench_mix is not None:
            self.seed[:n].copy_(c.bench_seed[req])

    def scratch_bytes(self) -> int:
        return int(self.arena.buf.numel())
