"""H200 tuning run for the Triton backend: tile variants and split targets vs SDPA cuDNN / flash.

    python benchmarks/triton_tune.py --out DIR [--quick]

Eager times: triton.testing.do_bench median (L2 flushed between reps), plan made once outside the
timed region (plan reuse, as in a multi-layer step). Graph times: N calls over rotating KV buffers
(> 240 MB, so reads are cold) captured in one CUDA graph, replay time / N.
Effective bandwidth = bytes of valid K + V / time. Writes DIR/triton_tune.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitkv
from splitkv import heuristics as H
from splitkv.reference import decode_reference

PEERS = [  # (B, Hq, Hkv, L) from shared/PEERS.md
    (1, 32, 32, 4096), (1, 32, 32, 32768), (1, 32, 32, 131072), (4, 32, 32, 32768),
    (16, 32, 32, 4096), (16, 32, 32, 32768), (64, 32, 32, 4096),
    (1, 32, 8, 4096), (1, 32, 8, 32768), (1, 32, 8, 131072), (4, 32, 8, 4096),
    (16, 32, 8, 131072), (64, 32, 8, 32768), (1, 64, 8, 4096),
]
TILES = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 3)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def sdpa(q, k, v, which):
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[which]
    qt = q.transpose(1, 2)
    with sdpa_kernel([be]):
        return lambda: torch.nn.functional.scaled_dot_product_attention(qt, k, v, enable_gqa=k.shape[1] != qt.shape[1])


def graph_us(make_call, n_bufs):
    calls = [make_call(i) for i in range(n_bufs)]
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    t = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        t.append(s.elapsed_time(e) * 1e3 / n_bufs)
    return sorted(t)[len(t) // 2]


def shape_rows(B, Hq, Hkv, L, D=128, dt=torch.bfloat16):
    rows = []
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt)
    kh = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt)  # [B, Hkv, L, D] storage, peers' layout
    vh = torch.randn_like(kh)
    kn, vn = kh.transpose(1, 2).contiguous(), vh.transpose(1, 2).contiguous()  # [B, L, Hkv, D]
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * B * L * Hkv * D * 2
    sub = slice(0, 1)
    ref, _ = decode_reference(q[sub], kn[sub], vn[sub], sl[sub], dtype=torch.float32)

    def row(name, us, o=None, extra=None):
        err = (o[sub].float() - ref).abs().max().item() if o is not None else None
        r = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, provider=name, us=round(us, 2), tbps=round(kv_bytes / us / 1e6, 3), err=err)
        r.update(extra or {})
        rows.append(r)
        print(f"B={B:3d} {Hq}/{Hkv} L={L:6d} {name:28s} {us:9.1f} us {r['tbps']:5.2f} TB/s err={err}", flush=True)

    for which in ("cudnn", "flash"):
        try:
            f = sdpa(q, kh, vh, which)
            o = f().transpose(1, 2)
            row(f"sdpa_{which}", bench(f), o)
        except Exception as e:  # noqa: BLE001 - a peer that rejects a shape is reported, not fatal
            print(f"  sdpa_{which} failed: {type(e).__name__}: {str(e)[:120]}")
    base = splitkv.plan(sl, Hq, Hkv, D, backend="triton")
    for tile in TILES:
        p2 = dataclasses.replace(base, tile=H.TileConfig(base.tile.block_m, *tile))  # same splits
        for kk, vv, lay in ((kn, vn, "BLHD"), (kh.transpose(1, 2), vh.transpose(1, 2), "BHLD")):
            if lay == "BHLD" and tile != TILES[0]:
                continue
            try:
                o = splitkv.decode(q, kk, vv, sl, plan=p2, backend="triton")
                row(f"triton n{tile[0]} w{tile[1]} s{tile[2]} {lay}", bench(lambda: splitkv.decode(
                    q, kk, vv, sl, plan=p2, backend="triton")), o,
                    dict(splits=int(base.num_splits[0]), tile=tile, layout=lay))
            except Exception as e:  # noqa: BLE001
                print(f"  tile {tile} failed: {type(e).__name__}: {str(e)[:200]}")
    for bps in (1, 4):
        old = H.BLOCKS_PER_SM
        H.BLOCKS_PER_SM = bps
        p = splitkv.plan(sl, Hq, Hkv, D, backend="triton")
        H.BLOCKS_PER_SM = old
        o = splitkv.decode(q, kn, vn, sl, plan=p, backend="triton")
        row(f"triton blocks_per_sm={bps}", bench(lambda: splitkv.decode(q, kn, vn, sl, plan=p, backend="triton")),
            o, dict(splits=int(p.num_splits[0])))
    return rows


def graph_rows(B, Hq, Hkv, L, D=128, dt=torch.bfloat16):
    kv_bytes = 2 * B * L * Hkv * D * 2
    n = max(4, math.ceil(256e6 / kv_bytes))
    qs = [torch.randn(B, 1, Hq, D, device="cuda", dtype=dt) for _ in range(n)]
    ks = [torch.randn(B, L, Hkv, D, device="cuda", dtype=dt) for _ in range(n)]
    vs = [torch.randn_like(k) for k in ks]
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    out = torch.empty_like(qs[0])
    rows = []
    for tile in TILES:
        for bps in ((1, 2, 4) if tile == TILES[0] else (2,)):
            old, H.BLOCKS_PER_SM = H.BLOCKS_PER_SM, bps
            p = splitkv.plan(sl, Hq, Hkv, D, max_seqlen=L, backend="triton")
            H.BLOCKS_PER_SM = old
            p = dataclasses.replace(p, tile=H.TileConfig(p.tile.block_m, *tile))
            us = graph_us(lambda i, p=p: (lambda: splitkv.decode(qs[i], ks[i], vs[i], sl, plan=p, out=out,
                                                                 backend="triton")), n)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, L=L, provider=f"triton graph n{tile[0]} w{tile[1]} s{tile[2]} bps{bps}",
                             us=round(us, 2), tbps=round(kv_bytes / us / 1e6, 3), splits=p.max_splits))
    khs = [k.transpose(1, 2) for k in ks]
    vhs = [v.transpose(1, 2) for v in vs]
    for which in ("cudnn", "flash"):
        try:
            us = graph_us(lambda i, w=which: sdpa(qs[i], khs[i], vhs[i], w), n)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, L=L, provider=f"sdpa_{which} graph", us=round(us, 2),
                             tbps=round(kv_bytes / us / 1e6, 3)))
        except Exception as e:  # noqa: BLE001
            print(f"  graph sdpa_{which} failed: {type(e).__name__}: {str(e)[:160]}")
    for r in rows:
        print(f"GRAPH B={B} {Hq}/{Hkv} L={L} {r['provider']:34s} {r['us']:8.1f} us {r['tbps']:.2f} TB/s "
              f"splits={r.get('splits')}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--graph-only", action="store_true")
    ap.add_argument("--graph-quick", action="store_true")
    a = ap.parse_args()
    shapes = PEERS[:2] if a.quick else PEERS
    t0 = time.time()
    rows = []
    for s in [] if a.graph_only else shapes:
        rows += shape_rows(*s)
        torch.cuda.empty_cache()
    for s in [(1, 32, 8, 4096), (1, 64, 8, 4096), (4, 32, 8, 4096), (1, 32, 8, 32768), (1, 32, 32, 4096),
              (1, 32, 32, 32768), (16, 32, 32, 4096)][: 2 if a.graph_quick else None]:
        rows += graph_rows(*s)
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), seconds=round(time.time() - t0, 1))
    with open(f"{a.out}/triton_tune.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
