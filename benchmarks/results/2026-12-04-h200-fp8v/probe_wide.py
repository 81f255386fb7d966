"""Probe: Triton fp8 (V_PAIRS tile) on batches whose plan streams whole sequences (one split per
request), graph replay, e4m3: the plan against forced 2 and 4 splits per request (NOTES #57).
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-fp8v/probe_wide.py
"""
import torch

import splitkv
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
for B, L, Hq, Hkv, ps in ((16, 32768, 32, 32, None), (16, 32768, 32, 32, 16), (64, 32768, 32, 8, None),
                          (64, 4096, 32, 32, None), (32, 8192, 32, 32, None), (8, 32768, 32, 32, None)):
    case = build_case(make_shape(B, L, Hq, Hkv, page_size=ps, kv_dtype="fp8_e4m3"), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    res = {}
    for _ in range(2):
        for ns in (None, 1, 2, 4):
            p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L, kv_dtype=sets[0].k_cache.dtype,
                             paged=ps is not None, num_splits=ns, backend="triton", **kw)
            p.refresh(sets[0].cache_seqlens)
            fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens,
                                                   block_table=t.block_table, plan=p, **kw) for t in sets]
            fns[0]()
            key = ns if ns else f"plan ({p.num_splits[0].item()}, fuse {p.fuse})"
            res.setdefault(key, []).append(time_graph(fns, dev, 20)[0])
    print(f"B={B} L={L} {Hq}/{Hkv} page {ps} e4m3, us (min of 2): " + " | ".join(
        f"splits {k}: {min(v):.1f}" for k, v in res.items()), flush=True)
    case.release()
