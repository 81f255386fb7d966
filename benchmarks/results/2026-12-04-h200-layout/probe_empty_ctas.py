"""Probe: what the exiting CTAs of a full grid cost. Uniform batches that fill the GPU run unsplit,
but the grid keeps FULL_GRID_MAX_SPLITS (4) split columns per request (B=16 GQA 128K: 64) for a
ragged batch's long requests; the extra columns exit at once. Each shape: the plan as made, and the
same plan with heuristics.FULL_GRID_MAX_SPLITS = 1 (one column, nothing to exit) and the same
tile (heuristics.tile_override); graph replay, two captures each.

Caveat found afterwards (NOTES #49): with max_splits 1, backend="auto" takes Triton, so the
"one column" rows ran Triton at the CuTe plan's tile; they do not isolate the grid.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_empty_ctas.py
"""
import torch

import splitkv
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
for B, L, Hq, Hkv in ((64, 4096, 32, 32), (16, 4096, 32, 32), (16, 32768, 32, 32), (16, 131072, 32, 8),
                      (64, 32768, 32, 8)):
    case = build_case(make_shape(B, L, Hq, Hkv), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    res = {}
    base = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L)
    t = base.tile
    for name, cols in (("grid as planned", H.FULL_GRID_MAX_SPLITS), ("one column", 1), ("planned again", None)):
        saved = H.FULL_GRID_MAX_SPLITS
        if cols is not None:
            H.FULL_GRID_MAX_SPLITS = cols
        with H.tile_override(t.block_n, t.num_warps, t.num_stages - (2 if base.paged else 0)):
            p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L)
        H.FULL_GRID_MAX_SPLITS = saved
        fns = [lambda s=s, p=p: splitkv.decode(s.q, s.k_cache, s.v_cache, s.cache_seqlens, plan=p) for s in sets]
        us = [time_graph(fns, dev, 20)[0] for _ in range(3)]
        o = fns[0]()
        res[name] = (min(us), p.max_splits, p.tile, o)
    same = torch.equal(res["grid as planned"][3], res["one column"][3])
    print(f"B={B} L={L} {Hq}/{Hkv}: " + " | ".join(f"{k}: {v[0]:.1f} us (max_splits {v[1]}, {v[2].block_n}x"
                                                      f"{v[2].num_warps}x{v[2].num_stages})" for k, v in res.items())
          + f" | outputs equal {same}", flush=True)
    case.release()
