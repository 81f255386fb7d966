"""Probe (GPU): the CuTe split kernel's fused merge against the merge kernel, by rows per tile.

The fused merge (backends/cutlass/fused_merge.py) runs in the last split CTA of each (request,
KV head, m-tile): one CTA walks rows x splits partials. It was measured ahead of the merge kernel
at 1-4 rows per tile (MHA, GQA 4 x Sq 1) before this probe measured 8-64 rows (GQA 4 x Sq 16, or a
prefix group's 16 members x 4 heads, where the prefix decode of probe_share_prefix_attn.py took
165 us for 34 MB of K/V on an H100); its results set heuristics.CUTLASS_FUSED_MERGE_MAX_ROWS.
Rows: each case (B:L:Hq:Sq over 8 KV heads, D 128, bf16, contiguous, causal) on backend cutlass
with its plan made under tile_override(fused_merge=True) (fused) and (fused_merge=False) (the merge
kernel), and whether the plan as made (heuristics.CUTLASS_FUSED_MERGE_MAX_ROWS) fuses,
graph replay, µs per call, and the max |diff| of the two outputs.
Prediction: at 64 rows the merge kernel wins by tens of µs; at 4 rows the two are within noise.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_fused_merge_rows.py [--cases ...]
"""
import argparse

import torch

from splitkv.api import decode
from splitkv.bench.timing import time_graph
from splitkv.heuristics import tile_override
from splitkv.plan import plan as make_plan

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="1:32768:32:1,1:32768:32:4,1:32768:32:8,1:32768:32:16,4:8192:32:8,"
                "1:131072:32:16,4:8192:32:16,1:8192:512:1,1:32768:512:1",
                help="batch:context:query heads:query length, comma-separated (8 KV heads)")
ap.add_argument("--reps", type=int, default=20)
a = ap.parse_args()
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run, no timing
backend = "cutlass" if dev.type == "cuda" else "torch"
Hkv, D, dt = 8, 128, torch.bfloat16 if dev.type == "cuda" else torch.float32
print(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (no timing)", flush=True)


@torch.no_grad()
def case(B, L, Hq, Sq):
    q = torch.randn(B, Sq, Hq, D, device=dev, dtype=dt)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    planned = make_plan(lens, Hq, Hkv, D, q_len=Sq, backend=backend, dtype=dt)
    with tile_override(fused_merge=True):
        fused = make_plan(lens, Hq, Hkv, D, q_len=Sq, backend=backend, dtype=dt)
    with tile_override(fused_merge=False):
        unfused = make_plan(lens, Hq, Hkv, D, q_len=Sq, backend=backend, dtype=dt)
    fns = {f"{name} (fuse {p.fuse})": (lambda p=p: decode(q, k, v, lens, plan=p))
           for name, p in (("fused", fused), ("merge kernel", unfused))}
    outs = [f().float() for f in fns.values()]
    rows = Hq // Hkv * Sq
    print(f"B {B} L {L} Hq {Hq} Sq {Sq}: {rows} rows per KV head, {fused.tile}, max_splits {fused.max_splits}, "
          f"the plan fuses: {planned.fuse}, max |diff| {(outs[0] - outs[1]).abs().max().item():.4f}", flush=True)
    if dev.type == "cuda":
        for name, f in fns.items():
            print(f"  {name:26s} {time_graph([f], dev, a.reps)[0]:9.1f} us", flush=True)
        torch.cuda.empty_cache()


for c in a.cases.split(","):
    case(*map(int, c.split(":")))
