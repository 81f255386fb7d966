"""Attention variants and head dims on the GPU: what a window, softcap, sinks or ALiBi cost next to
plain decode, padded head dims (80, 96, 192) in TB/s, and fp8 (e4m3) KV caches against bf16, with
FlashInfer in the same run (its fp8 paged decode for the fp8 rows).

    python benchmarks/variants.py [--out DIR] [--reps N]

Every row: a bf16 paged (16) cache and its contiguous twin; splitkv eager without a plan (what a
user calls), and CUDA-graph replay with a plan; FlashInfer's decode wrapper (eager, its plan
outside the timing) with the same variant where it has one (window_left, logits_soft_cap). Each
splitkv output is checked against splitkv.reference on a subsample of heads first. Writes
variants.json and variants.md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import splitkv  # noqa: E402
from splitkv.bench.timing import time_eager, time_graph  # noqa: E402
from splitkv.reference import decode_reference  # noqa: E402

# (name, B, L, Hq, Hkv, D, variant kwargs); sinks / alibi tensors are made per row; "backend" in
# the kwargs pins one (variants run on triton: its plain rows show what the variant itself costs)
ROWS = [
    ("plain 4K", 1, 4096, 32, 8, 128, {}),
    ("plain 4K, triton", 1, 4096, 32, 8, 128, dict(backend="triton")),
    ("window 4K of 128K", 1, 131072, 32, 8, 128, dict(window_size=(4095, -1))),  # 4096 keys, as HF counts
    ("plain 128K", 1, 131072, 32, 8, 128, {}),
    ("plain 32K", 1, 32768, 32, 8, 128, {}),
    ("plain 32K, triton", 1, 32768, 32, 8, 128, dict(backend="triton")),
    ("softcap 30, 32K", 1, 32768, 32, 8, 128, dict(softcap=30.0)),
    ("sinks, 32K", 1, 32768, 32, 8, 128, dict(sinks=True)),
    ("alibi, 32K", 1, 32768, 32, 8, 128, dict(alibi=True)),
    ("B16 plain D128 32K", 16, 32768, 32, 8, 128, {}),
    ("B16 plain D80 32K", 16, 32768, 32, 8, 80, {}),
    ("B16 plain D96 32K", 16, 32768, 32, 8, 96, {}),
    ("B1 plain D192 32K", 1, 32768, 32, 8, 192, {}),
    ("B1 plain D256 32K", 1, 32768, 32, 8, 256, {}),
    ("B16 plain D128 32K, triton", 16, 32768, 32, 8, 128, dict(backend="triton")),
    # fp8 (e4m3) caches vs bf16 at >= 256 MB of bf16 KV: per-tensor scales
    ("B1 GQA 128K fp8", 1, 131072, 32, 8, 128, dict(fp8=True)),
    ("B16 GQA 32K fp8", 16, 32768, 32, 8, 128, dict(fp8=True)),
    ("B1 MHA 32K bf16", 1, 32768, 32, 32, 128, {}),
    ("B1 MHA 32K fp8", 1, 32768, 32, 32, 128, dict(fp8=True)),
]


def _inputs(B, L, Hq, Hkv, D, paged, fp8=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shape = (B, L, Hkv, D) if not paged else (B * (L // 16), 16, Hkv, D)
    k = torch.randn(*shape, device="cuda", generator=g).to(dt)
    v = torch.randn(*shape, device="cuda", generator=g).to(dt)
    if not paged:
        return q, k, v, lens, None
    perm = torch.randperm(B * (L // 16), device="cuda", generator=g).int()
    return q, k, v, lens, perm.view(B, L // 16)


def _variant(kw, Hq):
    out = {k: v for k, v in kw.items() if k not in ("sinks", "alibi", "fp8")}
    if kw.get("fp8"):
        out.update(k_scale=1.0, v_scale=1.0)
    g = torch.Generator().manual_seed(1)
    if kw.get("sinks"):
        out["sinks"] = (torch.randn(Hq, generator=g) * 2).cuda()
    if kw.get("alibi"):
        out["alibi_slopes"] = (torch.rand(Hq, generator=g) * 0.01).cuda()
    return out


def _check(q, k, v, lens, bt, kw, o):
    heads = [0, q.shape[2] - 1]
    g = q.shape[2] // k.shape[2]
    sub = {key: (val[heads] if isinstance(val, torch.Tensor) else val) for key, val in kw.items() if key != "backend"}
    kvh = [h // g for h in heads]
    ro, _ = decode_reference(q[:1, :, heads], k[..., kvh, :] if bt is not None else k[:1][..., kvh, :],
                             v[..., kvh, :] if bt is not None else v[:1][..., kvh, :], lens[:1],
                             block_table=bt[:1] if bt is not None else None, **sub)
    err = (o[:1, :, heads].double() - ro).abs().max().item()
    assert err < 2e-2, f"max error {err}"
    return err


def _flashinfer(q, k, v, bt, lens, kw):
    try:
        import flashinfer
    except ImportError:
        return None, "flashinfer not importable"
    if bt is None or "sinks" in kw or "alibi_slopes" in kw or "backend" in kw:
        return None, "n/a"
    fp8 = "k_scale" in kw
    if q.shape[-1] not in (64, 128, 256):  # its kernels are built for these (others fault)
        return None, "head dim not built"
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    pages = bt.shape[1]
    ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=Hq != Hkv)
    indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * pages
    last = torch.full((B,), 16, dtype=torch.int32, device="cuda")
    extra = {}
    if "window_size" in kw:
        extra["window_left"] = kw["window_size"][0]
    if "softcap" in kw:
        extra["logits_soft_cap"] = kw["softcap"]
    w.plan(indptr, bt.reshape(-1), last, Hq, Hkv, D, 16, pos_encoding_mode="NONE", q_data_type=q.dtype,
           kv_data_type=k.dtype, **extra)
    qq = q.reshape(B, Hq, D)
    if fp8:
        return (lambda: w.run(qq, (k, v), k_scale=kw["k_scale"], v_scale=kw["v_scale"])), ""
    return (lambda: w.run(qq, (k, v))), ""


def _row(name, B, L, Hq, Hkv, D, kw, paged, gbytes, reps, dev) -> dict:
    q, k, v, lens, bt = _inputs(B, L, Hq, Hkv, D, paged, fp8="k_scale" in kw)
    row = dict(name=name, paged=paged, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
               variant={key: (val if not isinstance(val, torch.Tensor) else "tensor") for key, val in kw.items()})
    try:
        o = splitkv.decode(q, k, v, lens, block_table=bt, **kw)
        row["max_err"] = _check(q, k, v, lens, bt, kw, o)
        row["eager_us"] = time_eager(lambda: splitkv.decode(q, k, v, lens, block_table=bt, **kw), dev, reps)[0]
        p = splitkv.plan(lens, Hq, Hkv, D, max_seqlen=L, paged=paged, dtype=q.dtype, kv_dtype=k.dtype, **kw)
        pkw = {key: val for key, val in kw.items() if key != "backend"}
        row["backend"] = p.backend
        row["graph_us"] = time_graph([lambda: splitkv.decode(q, k, v, lens, block_table=bt, plan=p, **pkw)],
                                     dev, reps)[0]
        row["graph_TBps"] = gbytes / row["graph_us"] * 1e6 / 1e3
    except Exception as e:  # noqa: BLE001 - a row that fails is reported, the rest go on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        fn, why = _flashinfer(q, k, v, bt, lens, kw)
    except Exception as e:  # noqa: BLE001 - e.g. a head dim FlashInfer was not built for
        fn, why = None, f"{type(e).__name__}: {e}"[:200]
    if fn is not None:
        try:
            row["flashinfer_eager_us"] = time_eager(fn, dev, reps)[0]
        except Exception as e:  # noqa: BLE001
            row["flashinfer"] = f"{type(e).__name__}: {e}"[:200]
    else:
        row["flashinfer"] = why
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name, B, L, Hq, Hkv, D, vk in ROWS:
        kw = _variant(vk, Hq)
        keys = min(L, kw["window_size"][0] + 1) if "window_size" in kw else L
        gbytes = 2 * B * keys * Hkv * D * (1 if vk.get("fp8") else 2) / 1e9  # bytes actually read
        for paged in (False, True):
            row = _row(name, B, L, Hq, Hkv, D, kw, paged, gbytes, args.reps, dev)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "variants.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# Variants and head dims ({meta['device']}, {meta['date']}, torch {meta['torch']})", "",
             "| row | cache | backend | eager us (no plan) | graph us (plan) | graph TB/s | FlashInfer eager us |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        fi = f"{r['flashinfer_eager_us']:.1f}" if "flashinfer_eager_us" in r else r.get("flashinfer", "")
        if "error" in r:
            lines.append(f"| {r['name']} | {'paged16' if r['paged'] else 'contig'} | error: {r['error']} | | | | {fi} |")
            continue
        lines.append(f"| {r['name']} | {'paged16' if r['paged'] else 'contig'} | {r['backend']} | "
                     f"{r['eager_us']:.1f} | {r['graph_us']:.1f} | {r['graph_TBps']:.2f} | {fi} |")
    (out / "variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
