"""Host µs per call of decode(plan=p) / decode() with the signature built from torch.device objects
(before) vs CUDA device indices (validate._signature now), interleaved in rounds on one process.
B=1 GQA 32/8 4K bf16. Usage: python benchmarks/probes/probe_signature.py [--json PATH]
Measured at tree b37ff64 (results/2026-12-07-h200-issues/signature.json: no difference); the
device-index signature was then reverted (NOTES #86), so at later trees both rows run the same code."""

import argparse
import json
import statistics

import torch

import splitkv
from splitkv import execute, validate
from splitkv.bench.timing import time_host


def signature_before(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, backend):
    bt = (block_table.shape, block_table.stride(), block_table.dtype, block_table.device) if block_table is not None \
        else None
    return (num_splits, softmax_scale, backend, type(num_splits), type(softmax_scale),
            q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device, bt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    B, L, Hq, Hkv, D = 1, 4096, 32, 8, 128
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sl = torch.full((B,), L, device=dev, dtype=torch.int32)
    now = validate._signature
    res: dict = {}
    for _ in range(args.rounds):
        for name, fn in (("before", signature_before), ("now", now)):
            validate._signature = fn
            validate.forget()
            execute.clear_plans()
            for be in ("triton", "cutlass"):
                p = splitkv.plan(sl, Hq, Hkv, D, backend=be)
                for _ in range(2):
                    splitkv.decode(q, k, v, sl, plan=p, backend=be)
                    splitkv.decode(q, k, v, sl, backend=be)
                for what, call in (("plan", lambda: splitkv.decode(q, k, v, sl, plan=p, backend=be)),
                                   ("noplan", lambda: splitkv.decode(q, k, v, sl, backend=be))):
                    us, _ = time_host(call, dev)
                    res.setdefault(f"{be} {what} {name}", []).append(us)
            us, _ = time_host(lambda: validate.check_keyed(q, k, v, sl, None, None, None, "auto", True), dev)
            res.setdefault(f"check_keyed {name}", []).append(us)
    validate._signature = now
    out = {key: {"median_us": statistics.median(v), "rounds": v} for key, v in res.items()}
    for key, val in out.items():
        print(f"{key:28s} {val['median_us']:6.2f}  " + " ".join(f"{x:.1f}" for x in val["rounds"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
