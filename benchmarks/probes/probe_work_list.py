"""Probe (GPU): the split kernels' (split, request) grid against a work list, where the batch has
ragged headroom (heuristics.work_items gives a grid there today).

An auto plan whose batch x KV heads does not fill the GPU launches B x max_splits x Hkv CTAs, where
max_splits covers the ragged re-plan (up to RAGGED_SPLITS_PER_REQUEST x B per head): at B=16 GQA 32/8
that is 8192 CTAs, of which a uniform 32K batch uses 128. Surplus CTAs read their split count and
exit, but each takes a CTA slot: the CuTe split kernel holds 1-2 CTAs per SM (its smem), so 8000
surplus CTAs are ~30 rounds of launch-and-exit where the used ones are short. Where that shows:
zero-length rows (an engine's batch bucket with fewer live requests; share_prefix's group batch,
whose prefix decode took 49.5 us of CuTe kernel time for 33.5 MB on an H100, Triton 24.0:
probe_share_prefix_attn.py --profile). The work list (one CTA per scheduled item and KV head)
launches max(ragged_target, target, B) columns instead.
Rows: each case on cutlass and triton, the plan as made (grid) and with the list forced
(heuristics.work_items patched to give the list to every auto plan), graph replay, us per call;
the max |diff| of the two outputs.
Cases B:L:live:Hq:page — the first `live` rows hold L keys (the rest 0; live "r": lengths 1K..128K
geometric, all rows), 8 KV heads, D 128, bf16, page 0 = contiguous.
Prediction: with zero-length rows and short work (prefix 8K, bucket 16 with 4 live 8K) the list
saves ~20-30 us on cutlass, little on triton; long uniform rows (B=16 128K) within noise.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_work_list.py [--cases ...]
"""
import argparse

import torch

import splitkv.heuristics as H
from splitkv.api import decode
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import Shape
from splitkv.bench.timing import time_graph
from splitkv.plan import plan as make_plan

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="16:8192:1:512:64,16:32768:1:512:64,16:8192:4:32:64,16:32768:9:32:64,"
                "16:32768:16:32:0,16:131072:16:32:0,16:131072:r:32:16,12:4096:12:32:0,16:4096:16:32:0",
                help="B:L:live:Hq:page, comma-separated")
ap.add_argument("--backends", default="cutlass,triton")
ap.add_argument("--reps", type=int, default=20)
a = ap.parse_args()
dev = torch.device("cuda")
Hkv, D, dt = 8, 128, torch.bfloat16
print(torch.cuda.get_device_name(), flush=True)
grid_items = H.work_items


def list_items(rule, batch):
    if rule.mode != "auto" or rule.max_splits == 1:
        return None
    return min(max(rule.ragged_target, rule.target, batch), batch * rule.max_splits)


@torch.no_grad()
def case(B, L, live, Hq, page):
    if live == "r":
        lens = torch.logspace(10, 17, B, base=2).round().int().tolist()
    else:
        lens = [L] * int(live) + [0] * (B - int(live))
    cap = max(lens)
    ts = build_case(Shape("probe", B, Hq, Hkv, D, tuple(lens), page_size=page or None), dt, dev).base
    q, k, v, lens, table = ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, ts.block_table
    outs = {}
    for be in a.backends.split(","):
        for mode, fn in (("grid", grid_items), ("list", list_items)):
            H.work_items = fn
            try:
                p = make_plan(lens, Hq, Hkv, D, max_seqlen=cap, paged=bool(page), dtype=dt, kv_dtype=dt, backend=be)
            finally:
                H.work_items = grid_items
            cols = p.work_items or B * p.max_splits
            f = lambda p=p: decode(q, k, v, lens, block_table=table, plan=p)  # noqa: E731
            outs[be, mode] = f().float()
            t = time_graph([f], dev, a.reps)[0]
            print(f"  {be:8s} {mode}: {cols:5d} columns x {Hkv * p.m_tiles} (tile m{p.tile.block_m} n{p.tile.block_n}, "
                  f"fuse {p.fuse}) {t:9.1f} us", flush=True)
    ref = outs[next(iter(outs))]
    print("  max |diff| vs the first row:", max((o - ref).abs().max().item() for o in outs.values()), flush=True)


for c in a.cases.split(","):
    B, L, live, Hq, page = c.split(":")
    print(f"B={B} L={L} live={live} Hq={Hq} page={page}", flush=True)
    case(int(B), int(L), live, int(Hq), int(page))
    torch.cuda.empty_cache()
