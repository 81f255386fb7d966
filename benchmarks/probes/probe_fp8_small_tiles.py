"""Probe (waiting for a GPU run): Triton fp8 split tiles of fewer warps, with the split count scaled
to the CTAs each fits per SM, against the planner's 128x4x3 at its two per SM, e4m3, graph replay,
min of two interleaved rounds, error against the fp64 reference of the dequantised cache.

Why: at two 4-warp CTAs per SM the word-read tile (sm_90 SASS, CPU compile, Triton 3.6) runs 8
barriers per key loop (cross-warp softmax reductions through shared memory) with 8 warps per SM;
the sweep of 2026-12-04 (fp8_tiles.md) tried only 4 and 8 warps. 64x2x3: 184 registers, five CTAs
per SM by registers and shared memory (10 warps), 728 instructions per 64 keys; 64x1x3: 255
registers, six per SM, 2 barriers per loop. Prediction: a 2-warp tile at 4-5 per SM gains where
B=1 is latency-bound (B=1 GQA 128K 70.9 us, 3.79 TB/s; the issue wants 4.0); 1-warp tiles lose
(six warps per SM). Splits: the plan's count x (CTAs per SM of the tile / 2), and x 1.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_fp8_small_tiles.py
"""
import torch

import splitkv
from splitkv import execute
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph
from splitkv.reference import decode_reference

dev = torch.device("cuda")
TILES = [((128, 4, 3), 2), ((64, 2, 3), 5), ((64, 2, 4), 4), ((64, 1, 3), 6), ((32, 1, 4), 7)]  # (tile, CTAs/SM)
ROWS = [(1, 131072, 32, 8), (1, 32768, 32, 32), (16, 32768, 32, 8)]


def make(sets, Hq, Hkv, L, kw, tile, splits):
    bn, w, st = tile
    with H.tile_override(block_n=bn, num_warps=w, num_stages=st):
        p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L, kv_dtype=sets[0].k_cache.dtype,
                         num_splits=splits, backend="triton", **kw)
    p.refresh(sets[0].cache_seqlens)
    return p


print("graph replay us per call (min of 2 rounds); err = max |o - fp64 reference| / max |ref|", flush=True)
for B, L, Hq, Hkv in ROWS:
    case = build_case(make_shape(B, L, Hq, Hkv, kv_dtype="fp8_e4m3"), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    t = sets[0]
    ref = decode_reference(t.q, t.k_cache, t.v_cache, t.cache_seqlens, **kw)[0].double()
    base = splitkv.plan(t.cache_seqlens, Hq, Hkv, 128, max_seqlen=L, kv_dtype=t.k_cache.dtype, backend="triton",
                        **kw)
    base.refresh(t.cache_seqlens)
    planned = int(base.num_splits[0].item())
    res, err = {}, {}
    for _ in range(2):
        for tile, per_sm in TILES:
            for splits in sorted({planned, max(1, round(planned * per_sm / 2))}):
                execute.clear_plans()
                try:
                    p = make(sets, Hq, Hkv, L, kw, tile, splits)
                    fns = [lambda s=s, p=p: splitkv.decode(s.q, s.k_cache, s.v_cache, s.cache_seqlens, plan=p, **kw)
                           for s in sets]
                    out = fns[0]().clone()
                    key = ("x".join(map(str, tile)), splits)
                    err[key] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    res.setdefault(key, []).append(time_graph(fns, dev, 20)[0])
                except Exception as e:  # a tile the compiler or the device refuses
                    res.setdefault(("x".join(map(str, tile)), splits), []).append(float("nan"))
                    print(f"  {tile} splits {splits}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    print(f"B={B} L={L} {Hq}/{Hkv} e4m3 (plan: {planned} splits): " + " | ".join(
        f"{k[0]} s{k[1]} {min(v):.1f} (err {err.get(k, float('nan')):.1e})" for k, v in res.items()), flush=True)
    case.release()
