"""Probe (GPU): the CuTe split kernel's fused merge against the merge kernel, by rows per tile.

The fused merge (backends/cutlass/fused_merge.py) runs in the last split CTA of each (request,
KV head, m-tile): one CTA walks rows x splits partials. It was measured ahead of the merge kernel
at 1-4 rows per tile (MHA, GQA 4 x Sq 1) before this probe measured 8-64 rows (GQA 4 x Sq 16, or a
prefix group's 16 members x 4 heads, where the prefix decode of probe_share_prefix_attn.py took
165 us for 34 MB of K/V on an H100); its results set heuristics.CUTLASS_FUSED_MERGE_MAX_ROWS.
Rows: each case (B:L:Hq:Sq:Hkv:page, D 128, bf16, causal; page 0 = contiguous) on backend cutlass with
its plan made under tile_override(fused_merge=True) (fused) and (fused_merge=False) (the merge
kernel), whether the plan as made fuses (heuristics.cutlass_fuses_merge: at most
CUTLASS_FUSED_MERGE_MAX_ROWS rows and CUTLASS_FUSED_MERGE_MAX_PARTIALS rows x splits), graph
replay, us per call, and the max |diff| of the two outputs.
Prediction (first run): at 64 rows the merge kernel wins by tens of us; at 4 rows the two are within
noise. Second run (the default cases: the plans the partials cap moves, and three it keeps fused):
the merge kernel ahead by ~0.5-1 us where rows x splits > 64, the fused merge ahead where <= 64.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_fused_merge_rows.py [--cases ...]
"""
import argparse

import torch

from splitkv.api import decode
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import Shape
from splitkv.bench.timing import time_graph
from splitkv.heuristics import tile_override
from splitkv.plan import plan as make_plan

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="1:4096:64:1:8:0,1:32768:64:1:8:0,1:131072:64:1:8:0,1:4096:64:1:8:16,"
                "1:32768:32:1:8:16,1:131072:32:1:8:16,1:4096:32:2:8:0,1:32768:32:1:4:0,1:32768:8:1:2:0,"
                "2:32768:32:1:4:16,1:4096:32:1:8:0,1:4096:32:1:8:16,4:4096:64:1:8:0",
                help="batch:context:query heads:query length:KV heads:page size (0: contiguous), comma-separated")
ap.add_argument("--reps", type=int, default=20)
a = ap.parse_args()
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run, no timing
backend = "cutlass" if dev.type == "cuda" else "torch"
D, dt = 128, torch.bfloat16 if dev.type == "cuda" else torch.float32
print(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (no timing)", flush=True)


@torch.no_grad()
def case(B, L, Hq, Sq, Hkv, page):
    ts = build_case(Shape("probe", B, Hq, Hkv, D, (L,) * B, q_len=Sq, page_size=page or None), dt, dev).base
    q, k, v, lens, table = ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, ts.block_table
    kw = dict(q_len=Sq, max_seqlen=L, paged=bool(page), dtype=dt, kv_dtype=dt, backend=backend)
    planned = make_plan(lens, Hq, Hkv, D, **kw)
    with tile_override(fused_merge=True):
        fused = make_plan(lens, Hq, Hkv, D, **kw)
    with tile_override(fused_merge=False):
        unfused = make_plan(lens, Hq, Hkv, D, **kw)
    fns = {f"{name} (fuse {p.fuse})": (lambda p=p: decode(q, k, v, lens, block_table=table, plan=p))
           for name, p in (("fused", fused), ("merge kernel", unfused))}
    outs = [f().float() for f in fns.values()]
    rows = Hq // Hkv * Sq
    print(f"B {B} L {L} Hq {Hq} Hkv {Hkv} Sq {Sq} page {page}: {rows} rows per KV head, {fused.tile}, "
          f"max_splits {fused.max_splits}, the plan fuses: {planned.fuse}, "
          f"max |diff| {(outs[0] - outs[1]).abs().max().item():.4f}", flush=True)
    if dev.type == "cuda":
        for name, f in fns.items():
            print(f"  {name:26s} {time_graph([f], dev, a.reps)[0]:9.1f} us", flush=True)
        torch.cuda.empty_cache()


for c in a.cases.split(","):
    case(*map(int, c.split(":")))
