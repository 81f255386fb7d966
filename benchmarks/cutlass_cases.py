"""Correctness cases of the CuTe DSL backend against splitkv.reference (fp64), used by
benchmarks/gpu_cutlass.py on the GPU. Fresh random inputs per case; unused cache slots, pages and
block-table entries are poisoned (NaN / out-of-range ids), outputs pre-filled with NaN.
"""

import math

import torch

import splitkv
from splitkv.reference import decode_lowp, decode_reference

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------------------- inputs
def make_inputs(dtype, D, Hq, Hkv, Sq, lengths, page_size=None, device="cuda", seed=0, lmax=None):
    """q, k, v, seqlens, block_table (None when contiguous) + the dense k/v for decode_lowp.
    Unused cache slots and pages hold NaN; unused block-table entries hold an out-of-range id."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(lengths)
    lmax = lmax or max(max(lengths), 1)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(device, DT[dtype])
    kd = torch.randn(B, lmax, Hkv, D, generator=g).to(device, DT[dtype])
    vd = torch.randn(B, lmax, Hkv, D, generator=g).to(device, DT[dtype])
    for b, L in enumerate(lengths):
        kd[b, L:] = float("nan")
        vd[b, L:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if page_size is None:
        return q, kd, vd, seqlens, None, kd, vd
    max_pages = -(-lmax // page_size)
    used = [-(-L // page_size) for L in lengths]
    P = sum(used) + 3  # spare pages stay NaN
    perm = torch.randperm(P, generator=g).tolist()
    kp = torch.full((P, page_size, Hkv, D), float("nan"), dtype=DT[dtype], device=device)
    vp = torch.full_like(kp, float("nan"))
    bt = torch.full((B, max_pages), 10**7, dtype=torch.int32)  # never read: would fault if it were
    nxt = 0
    for b, L in enumerate(lengths):
        for j in range(used[b]):
            pid = perm[nxt]
            nxt += 1
            bt[b, j] = pid
            lo, hi = j * page_size, min((j + 1) * page_size, L)
            kp[pid, : hi - lo] = kd[b, lo:hi]
            vp[pid, : hi - lo] = vd[b, lo:hi]
    return q, kp, vp, seqlens, bt.to(device), kd, vd


# ------------------------------------------------------------------------------------ correctness
def err_stats(o, lse, ref_o, ref_lse):
    o, lse = o.double(), lse.double()
    empty = torch.isinf(ref_lse)  # [B, Hq, Sq]: rows that see no key
    e_o = (o - ref_o).abs()
    fin = ~empty
    e_lse = (lse - ref_lse).abs()[fin]
    empty_ok = bool(torch.all(torch.isinf(lse[empty]) & (lse[empty] < 0))) and bool(
        torch.all(o.permute(0, 2, 1, 3)[empty] == 0))
    return dict(err_o=float(e_o.max()) if e_o.numel() else 0.0,
                err_lse=float(e_lse.max()) if e_lse.numel() else 0.0,
                nan=bool(torch.isnan(o).any() or torch.isnan(lse).any()), empty_ok=empty_ok)


def check_case(spec: dict, backend="cutlass", device="cuda") -> dict:
    """Run one decode through `backend` and compare with the fp64 reference."""
    q, k, v, seqlens, bt, kd, vd = make_inputs(spec["dtype"], spec["D"], spec["Hq"], spec["Hkv"], spec["Sq"],
                                               spec["lengths"], spec.get("page"), device, spec.get("seed", 0))
    causal = spec.get("causal", True)
    kw = dict(block_table=bt, causal=causal, num_splits=spec.get("splits"), return_lse=True, backend=backend)
    out = torch.full_like(q, float("nan"))  # every element must be written
    o, lse = splitkv.decode(q, k, v, seqlens, out=out, **kw)
    o2, lse2 = splitkv.decode(q, k, v, seqlens, **kw)
    ref_o, ref_lse = decode_reference(q, k, v, seqlens, block_table=bt, causal=causal)
    res = err_stats(o, lse, ref_o, ref_lse)
    res["deterministic"] = bool(torch.equal(o, o2) and torch.equal(lse.nan_to_num(), lse2.nan_to_num()))
    low = decode_lowp(q, kd, vd, seqlens, causal=causal).double()  # torch's own low-precision error
    low_err = float((low - ref_o).abs().nan_to_num(0.0).max())
    res["tol_o"] = 2 * low_err + 1e-3
    res["ok"] = (not res["nan"] and res["empty_ok"] and res["deterministic"] and res["err_o"] <= res["tol_o"]
                 and res["err_lse"] <= 2e-3)
    return res


def matrix_cases(quick=False):
    """One case per split variant (dtype x D x block_m x paged) + real sizes."""
    cases, i = [], 0
    for dtype in ("fp16", "bf16"):
        for D in (64, 128, 256):
            for G, Sq in ((4, 1), (8, 4), (16, 16)):  # 4 / 32 / 256 packed rows: block_m 16 / 32 / 64 (x4)
                for page in (None, (1, 16, 64, 256)[i % 4]):
                    cases.append(dict(name=f"{dtype} D{D} G{G} Sq{Sq} {'page' + str(page) if page else 'dense'}",
                                      dtype=dtype, D=D, Hq=2 * G, Hkv=2, Sq=Sq, page=page,
                                      lengths=[0, 1, 17, 113, 4097][: 3 if quick else 5],
                                      splits=(None, 1, 3, 17)[i % 4], causal=i % 3 != 2, seed=i))
                    i += 1
    real = [dict(name="real B1 32/8 32K bf16", dtype="bf16", D=128, Hq=32, Hkv=8, Sq=1, lengths=[32768]),
            dict(name="real B1 32/8 128K paged16", dtype="bf16", D=128, Hq=32, Hkv=8, Sq=1, lengths=[131072],
                 page=16),
            dict(name="real B16 32/32 4K fp16", dtype="fp16", D=128, Hq=32, Hkv=32, Sq=1, lengths=[4096] * 16),
            dict(name="real B4 64/8 16K paged64 fp16", dtype="fp16", D=128, Hq=64, Hkv=8, Sq=1,
                 lengths=[16384, 9000, 1, 16000], page=64),
            dict(name="real B3 32/4 Sq4 ragged paged256", dtype="bf16", D=128, Hq=32, Hkv=4, Sq=4,
                 lengths=[100000, 5, 33000], page=256),
            dict(name="real B2 8/1 D256 MQA 20K", dtype="bf16", D=256, Hq=8, Hkv=1, Sq=1, lengths=[20000, 777]),
            dict(name="real B2 28/4 G7 D64 8K", dtype="fp16", D=64, Hq=28, Hkv=4, Sq=2, lengths=[8191, 65])]
    return cases + ([] if quick else real)


def check_merge_only(device="cuda") -> list[dict]:
    """fp32/fp16/bf16 partials (merge_states users) through the cutlass merge vs fp64 math."""
    from splitkv.backends import cutlass as C

    rows = []
    for pdt in (torch.float32, torch.float16, torch.bfloat16):
        for odt in (torch.float16, torch.bfloat16):
            for D in (64, 128, 256):
                name = f"merge {str(pdt)[6:]}->{str(odt)[6:]} D{D}"
                try:
                    S, B, H, T = 37, 3, 4, 2
                    o_part = torch.randn(S, B, H, T, D, device=device).to(pdt)
                    lse_part = torch.randn(S, B, H, T, device=device) * 3
                    ns = torch.tensor([37, 1, 5], dtype=torch.int32, device=device)
                    lse_part[2:, 2] = -math.inf  # request 2: only splits 0, 1 live
                    o_part[2:, 2] = float("nan")  # ... dead partials hold NaN, which must not leak
                    lse_part[:, 1, 0] = -math.inf  # request 1, head 0: no key at all
                    out = torch.full((B, T, H, D), float("nan"), dtype=odt, device=device)
                    lse = torch.empty(B, H, T, device=device)
                    C.merge(o_part, lse_part, ns, out, lse)
                    live = torch.arange(S, device=device)[:, None] < ns[None, :]
                    lp = lse_part.double().masked_fill(~live[:, :, None, None], -math.inf)
                    m = lp.amax(0)
                    ms = torch.where(torch.isinf(m), 0.0, m)
                    w = torch.exp(lp - ms)
                    den = w.sum(0)
                    num = torch.where(w[..., None] > 0, w[..., None] * o_part.double(), 0.0).sum(0)
                    ref_o = torch.where(den[..., None] > 0, num / den.clamp_min(1e-300)[..., None], 0.0)
                    ref_l = torch.where(den > 0, ms + torch.log(den), -math.inf)
                    r = err_stats(out, lse, ref_o.permute(0, 2, 1, 3), ref_l)
                    tol = 2.0 ** -7 * float(ref_o.abs().max()) + 1e-4  # one bf16 rounding of the output
                    r["ok"] = not r["nan"] and r["empty_ok"] and r["err_o"] <= tol and r["err_lse"] < 1e-4
                except Exception as e:
                    r = dict(ok=False, error=f"{type(e).__name__}: {e}")
                rows.append(dict(name=name, **r))
    return rows


def check_graph(device="cuda") -> dict:
    """Capture decode with a graph-safe plan, replay after changing lengths in place."""
    q, k, v, seqlens, bt, _, _ = make_inputs("bf16", 128, 32, 8, 1, [5000, 3000], page_size=16, device=device,
                                             lmax=8192)
    p = splitkv.plan(seqlens, 32, 8, 128, max_seqlen=8192, backend="cutlass", paged=bt is not None)
    out = torch.empty_like(q)
    kw = dict(block_table=bt, plan=p, out=out, backend="cutlass")
    splitkv.decode(q, k, v, seqlens, **kw)  # compile + module load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        splitkv.decode(q, k, v, seqlens, **kw)
    seqlens.copy_(torch.tensor([4000, 2500], dtype=torch.int32))  # shorter: pages already hold the keys
    g.replay()
    torch.cuda.synchronize()
    ref_o, _ = decode_reference(q, k, v, seqlens, block_table=bt)
    err = float((out.double() - ref_o).abs().max())
    return dict(name="graph replay, new lengths", err_o=err, ok=err < 2e-2 and not torch.isnan(out).any().item())
