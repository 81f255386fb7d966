"""Probe: Triton fp8 (word-read tile) plans of batches that fill the GPU, by the grid's split columns
(heuristics.FULL_GRID_MAX_SPLITS: 4 as planned, 2, 1), graph replay with a graph-safe plan, e4m3,
uniform batches and one ragged batch (lengths evenly spaced up to the bound), states interleaved twice.
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-fp8v/probe_grid.py
"""
import torch

import splitkv
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
COLS = (4, 2, 1)
ROWS = [(16, 32768, 32, 32), (64, 32768, 32, 8), (8, 32768, 32, 32),
        (16, [2048 * (i + 1) for i in range(16)], 32, 32), (64, [512 * (i + 1) for i in range(64)], 32, 8)]
for B, L, Hq, Hkv in ROWS:
    case = build_case(make_shape(B, L, Hq, Hkv, kv_dtype="fp8_e4m3"), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    bound = L if isinstance(L, int) else max(L)
    res, desc = {}, {}
    for _ in range(2):
        for cols in COLS:
            H.FULL_GRID_MAX_SPLITS = cols
            if hasattr(H.uniform_schedule, "cache_clear"):
                H.uniform_schedule.cache_clear()
            p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=bound, kv_dtype=sets[0].k_cache.dtype,
                             backend="triton", **kw)
            p.refresh(sets[0].cache_seqlens)
            fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p, **kw)
                   for t in sets]
            fns[0]()
            desc[cols] = f"max_splits {p.rule.max_splits}, splits {sorted(set(p.num_splits.tolist()))}, fuse {p.fuse}"
            res.setdefault(cols, []).append(time_graph(fns, dev, 20)[0])
    H.FULL_GRID_MAX_SPLITS = 4
    name = f"L={L}" if isinstance(L, int) else f"ragged {min(L)}..{max(L)}"
    print(f"B={B} {name} {Hq}/{Hkv} e4m3, us (min of 2): " + " | ".join(
        f"cols {c}: {min(v):.1f} ({desc[c]})" for c, v in res.items()), flush=True)
    case.release()
