"""Probe (waiting for a GPU run): Triton fp8 split kernel with the contiguous key-row offsets hoisted
out of the key loop (launch.HOIST_ROWS, split_kernel HOIST_ROWS) against the per-row 64-bit
products of the library's default, e4m3, graph replay with a plan made per state, interleaved
(A B, three times, min), with the error against the fp64 reference of the dequantised cache.

Prediction (benchmarks/NOTES.md, open leads): the sm_90 SASS key loop (D 128, group 4) shrinks from
717 to 681 instructions (-5%), registers 184 -> 239 (two CTAs per SM either way). The kernel is
latency-bound at two CTAs per SM rather than issue-bound (~32% of the issue slots a 4.0 TB/s stream
needs), so expect 0-3% at B=1 (70.9 us at B=1 GQA 128K; the issue's 4.0 TB/s needs 67.1) and
less at B=16. Adopt (HOIST_ROWS on for fp8) where every row is level or faster.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_hoist.py
"""
import torch

import splitkv
from splitkv import execute
from splitkv.backends.triton import launch as TL
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph
from splitkv.reference import decode_reference

dev = torch.device("cuda")
STATES = ("rows", "hoist")
ROWS = [(1, 131072, 32, 8), (1, 32768, 32, 32), (16, 32768, 32, 8), (16, 32768, 32, 32), (4, 32768, 32, 8)]


def state(name):
    TL.HOIST_ROWS = name == "hoist"
    execute.clear_plans()


print("graph replay us per call (min of 3 per state); err = max |o - fp64 reference| / max |ref|", flush=True)
for B, L, Hq, Hkv in ROWS:
    case = build_case(make_shape(B, L, Hq, Hkv, kv_dtype="fp8_e4m3"), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    us, outs, desc = {s: [] for s in STATES}, {}, ""
    for _ in range(3):
        for s in STATES:
            state(s)
            p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L, kv_dtype=sets[0].k_cache.dtype,
                             backend="triton", **kw)
            p.refresh(sets[0].cache_seqlens)
            fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p, **kw)
                   for t in sets]
            outs[s] = fns[0]().clone()
            us[s].append(time_graph(fns, dev, 20)[0])
            desc = p.describe()
    t = sets[0]
    ref = decode_reference(t.q, t.k_cache, t.v_cache, t.cache_seqlens, **kw)[0].double()
    err = {s: ((outs[s].double() - ref).abs().max() / ref.abs().max()).item() for s in STATES}
    print(f"B={B} L={L} {Hq}/{Hkv} e4m3: " + " | ".join(f"{s} {min(us[s]):.1f} (err {err[s]:.1e})" for s in STATES)
          + f" | bitwise equal {torch.equal(outs['rows'], outs['hoist'])} | plan: {desc}", flush=True)
    case.release()
state("rows")
