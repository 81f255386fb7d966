"""Probe: the same K/V bytes in two memory layouts, splitkv (a reused plan, auto) and SDPA cuDNN on each.

BLHD: the cache as splitkv's bench builds it, [B, L, Hkv, D] contiguous (a key's heads side by side).
BHLD: [B, Hkv, L, D] contiguous (each head's keys in one run, the layout SDPA's bench rows copy to),
passed to splitkv as its transpose(1, 2) view and to SDPA as is; SDPA on BLHD gets transpose views.
Graph replay over rotating sets (splitkv.bench.timing.time_graph), per call, two timings each.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_layout.py
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitkv
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

SHAPES = [(64, 4096, 32, 32), (16, 4096, 32, 32), (16, 32768, 32, 32), (16, 131072, 32, 8), (4, 32768, 32, 32),
          (1, 131072, 32, 32)]
dev = torch.device("cuda")
only = sys.argv[1:]  # optional "B,L,Hq,Hkv" filters
for B, L, Hq, Hkv in SHAPES:
    if only and f"{B},{L},{Hq},{Hkv}" not in only:
        continue
    case = build_case(make_shape(B, L, Hq, Hkv), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    nbytes = 2 * B * L * Hkv * 128 * 2
    bhld = [(t.k_cache[:, :L].transpose(1, 2).contiguous(), t.v_cache[:, :L].transpose(1, 2).contiguous())
            for t in sets]
    p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L)
    row = {}
    fns = {
        "splitkv BLHD": [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p) for t in sets],
        "splitkv BHLD": [lambda t=t, kv=kv: splitkv.decode(t.q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                                           t.cache_seqlens, plan=p) for t, kv in zip(sets, bhld)],
    }
    gqa = Hq != Hkv
    fns["cudnn BHLD"] = [lambda t=t, kv=kv: F.scaled_dot_product_attention(t.q.transpose(1, 2), kv[0], kv[1],
                                                                           enable_gqa=gqa)
                         for t, kv in zip(sets, bhld)]
    fns["cudnn BLHD"] = [lambda t=t: F.scaled_dot_product_attention(
        t.q.transpose(1, 2), t.k_cache[:, :L].transpose(1, 2), t.v_cache[:, :L].transpose(1, 2), enable_gqa=gqa)
        for t in sets]
    ref = None
    for name, fs in fns.items():
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                us = [time_graph(fs, dev, 20)[0] for _ in range(2)]
                o = fs[0]()
            o = o.transpose(1, 2) if name.startswith("cudnn") else o
            ref = o if ref is None else ref
            err = (o.float() - ref.float()).abs().max().item()
            row[name] = f"{min(us):.1f} us ({nbytes / min(us) / 1e6:.2f} TB/s; {us[0]:.1f}/{us[1]:.1f}) err {err:.1e}"
        except Exception as e:  # a layout a library refuses
            row[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    print(f"B={B} L={L} {Hq}/{Hkv} [{p.backend}]", " | ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    del bhld
    case.release()
