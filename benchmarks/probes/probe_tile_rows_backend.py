"""Probe (GPU): cutlass against Triton on split plans of many query rows per KV head (m32 / m64
tiles), each backend at its own plan, where `auto` takes cutlass for every split plan
(heuristics.auto_prefers_cutlass).

probe_work_list.py measured share_prefix's group batch (16 rows, one live, 512 query heads over 8
KV heads: an m64 tile) on an H100: CuTe 50.5 us vs Triton 31.1 at 8K, 104.9 vs 84.3 at 32K. This
asks whether that holds for the m64 plans a model makes (speculative decoding, GQA 4 x Sq 16) and
for m32 (GQA 4 x Sq 8), or only for a batch with zero-length rows.
Cases B:L:Hq:Sq:page (8 KV heads, D 128, bf16, causal; page 0 = contiguous), graph replay, us per
call, the max |diff| of the two outputs. Prediction (none measured): within 10% where every row is live.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_tile_rows_backend.py [--cases ...]
"""
import argparse

import torch

from splitkv.api import decode
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import Shape
from splitkv.bench.timing import time_graph
from splitkv.plan import plan as make_plan

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="1:32768:32:16:0,1:131072:32:16:0,4:8192:32:16:0,1:32768:32:16:16,"
                "1:32768:32:8:0,4:8192:32:8:0,1:8192:512:1:64,1:32768:512:1:64")
ap.add_argument("--reps", type=int, default=20)
a = ap.parse_args()
dev = torch.device("cuda")
Hkv, D, dt = 8, 128, torch.bfloat16
print(torch.cuda.get_device_name(), flush=True)


@torch.no_grad()
def case(B, L, Hq, Sq, page):
    ts = build_case(Shape("probe", B, Hq, Hkv, D, (L,) * B, q_len=Sq, page_size=page or None), dt, dev).base
    q, k, v, lens, table = ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, ts.block_table
    outs = []
    for be in ("cutlass", "triton"):
        p = make_plan(lens, Hq, Hkv, D, q_len=Sq, max_seqlen=L, paged=bool(page), dtype=dt, kv_dtype=dt, backend=be)
        f = lambda p=p: decode(q, k, v, lens, block_table=table, plan=p)  # noqa: E731
        outs.append(f().float())
        t = time_graph([f], dev, a.reps)[0]
        print(f"  {be:8s} m{p.tile.block_m} n{p.tile.block_n} max_splits {p.max_splits} fuse {p.fuse}: {t:9.1f} us",
              flush=True)
    print(f"  max |diff| {(outs[0] - outs[1]).abs().max().item():.4f}", flush=True)


for c in a.cases.split(","):
    B, L, Hq, Sq, page = map(int, c.split(":"))
    print(f"B={B} L={L} Hq={Hq} Sq={Sq} page={page}", flush=True)
    case(B, L, Hq, Sq, page)
    torch.cuda.empty_cache()
