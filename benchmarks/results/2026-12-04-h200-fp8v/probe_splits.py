"""Probe: Triton fp8 (V_PAIRS tile), graph replay, forced split counts vs the plan, e4m3:
B=16 GQA 64/8 32K (group 8: the 168-register tile, three per SM fit; the plan aims at three) and
B=16 MHA 32K (two fit), each also with V_PAIRS off (launch.V_PAIRS = False, the byte read).
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-fp8v/probe_splits.py
"""
import torch

import splitkv
from splitkv import execute
from splitkv.backends.triton import launch as TL
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
for B, L, Hq, Hkv, ps in ((16, 32768, 64, 8, None), (16, 32768, 64, 8, 16), (16, 32768, 32, 32, None)):
    case = build_case(make_shape(B, L, Hq, Hkv, page_size=ps, kv_dtype="fp8_e4m3"), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    res = {}
    for _ in range(2):
        for pairs in (True, False):
            TL.V_PAIRS = pairs
            TL._split.cache.clear()
            execute.clear_plans()
            for ns in (None, 2, 3, 4):
                p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L, kv_dtype=sets[0].k_cache.dtype,
                                 paged=ps is not None, num_splits=ns, backend="triton", **kw)
                p.refresh(sets[0].cache_seqlens)
                fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens,
                                                       block_table=t.block_table, plan=p, **kw) for t in sets]
                fns[0]()
                key = (pairs, ns if ns else f"plan ({p.num_splits[0].item()})")
                res.setdefault(key, []).append(time_graph(fns, dev, 20)[0])
    TL.V_PAIRS = True
    print(f"B={B} L={L} {Hq}/{Hkv} page {ps} e4m3, us (min of 2): " + " | ".join(
        f"{'words' if k[0] else 'bytes'} splits {k[1]}: {min(v):.1f}" for k, v in res.items()), flush=True)
    case.release()
