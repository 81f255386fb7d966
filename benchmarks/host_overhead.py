"""Host (CPU) time per decode call and per stage: what eager small-shape latency is made of.

    python benchmarks/host_overhead.py [--out DIR] [--device cuda|cpu] [--calls N] [--shape B,L,Hq,Hkv,D]

Each entry runs N calls back to back without synchronising; wall time / N is its host cost (the
default problem is tiny, B=1 GQA 32/8 4K, so the host is the bottleneck and this is what is
measured): splitkv.bench.timing.time_host, the method of the bench's host column. A call that
synchronises inside (one that reads lengths on the host) pays its GPU time here too.

Measured, for each backend of triton / cutlass / auto (skipped when unavailable):
  decode() with no plan (what a new user calls), and with out=, and return_lse=True;
  decode(plan=p) with an eager plan, with out=, return_lse=True; with a graph-safe plan;
  splitkv.plan() (once per step) and plan.refresh() of a graph-safe plan;
peers: SDPA cuDNN and flash (views of the same tensors, GQA without expanding K/V);
stages: the bound launch of the lean path alone (per backend), splitkv.validate.check_keyed (the
signature lookup every call does), a bare torch.empty_like, torch.cuda.current_stream. Any entry
that raises is reported as "error: ..." and the script goes on. Prints a table; writes host_overhead.json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

import splitkv  # noqa: E402
from splitkv import backends, validate  # noqa: E402
from splitkv.bench.timing import time_host  # noqa: E402

SCHEMA = "splitkv.host_overhead/1"


def _short(exc: BaseException) -> str:
    return f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _available(backend: str, device: torch.device) -> str | None:
    """None if the backend can run on this device, else why not."""
    try:
        if backend == "cutlass" and not backends.cutlass_available():
            return "nvidia-cutlass-dsl / splitkv.backends.cutlass not available"
        if backend == "triton" and not backends.triton_available():
            return "triton not installed"
        backends.resolve(backend, device)
    except Exception as exc:  # noqa: BLE001
        return _short(exc)
    return None


def measure(entries, device: torch.device, calls: int | None) -> dict:
    """{name: µs per call, or 'error: ...' / 'skipped: ...'} for (name, fn | (fn, context) | reason)
    entries; a context is held around the timing of its fn (SDPA's sdpa_kernel)."""
    res = {}
    for name, fn in entries:
        if isinstance(fn, str):
            res[name] = fn
        else:
            fn, ctx = fn if isinstance(fn, tuple) else (fn, contextlib.nullcontext())
            try:
                with ctx:
                    res[name] = time_host(fn, device, calls)[0]
            except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
                res[name] = _short(exc)
                if device.type == "cuda":
                    try:
                        torch.cuda.synchronize(device)
                    except Exception:  # noqa: BLE001
                        pass
        value = res[name]
        text = f"{value:10.1f} us/call" if isinstance(value, float) else value
        print(f"HOST {name:44s} {text}", flush=True)
    return res


def entries_for(q, k, v, sl, device, backends_to_run):
    """(name, zero-arg callable | 'skipped: why') in the order they are printed."""
    _, _, Hq, D = q.shape
    Hkv = k.shape[2]
    out = torch.empty_like(q)
    entries = []

    def guarded(name, make):
        """make() builds the callable (plans etc., outside timing); a failure there is the entry's error."""
        try:
            entries.append((name, make()))
        except Exception as exc:  # noqa: BLE001
            entries.append((name, _short(exc)))

    for be in backends_to_run:
        why = _available(be, device)
        if why is not None:
            entries.append((f"[{be}] (all entries)", f"skipped: {why}"))
            continue
        guarded(f"[{be}] decode() no plan", lambda be=be: lambda: splitkv.decode(q, k, v, sl, backend=be))
        guarded(f"[{be}] decode(out=) no plan",
                lambda be=be: lambda: splitkv.decode(q, k, v, sl, backend=be, out=out))
        guarded(f"[{be}] decode(return_lse=True) no plan",
                lambda be=be: lambda: splitkv.decode(q, k, v, sl, backend=be, return_lse=True))

        def with_plan(be=be, **kw):
            p = splitkv.plan(sl, Hq, Hkv, D, backend=be)
            splitkv.decode(q, k, v, sl, plan=p, backend=be, **kw)  # compile / warm outside timing
            return lambda: splitkv.decode(q, k, v, sl, plan=p, backend=be, **kw)

        def graph_plan(be=be):
            p = splitkv.plan(sl, Hq, Hkv, D, backend=be, max_seqlen=int(k.shape[1]))
            p.refresh(sl)
            return p

        def with_graph_plan(be=be):
            p = graph_plan(be)
            return lambda: splitkv.decode(q, k, v, sl, plan=p, backend=be)

        def refresh(be=be):
            p = graph_plan(be)
            return lambda: p.refresh(sl)

        guarded(f"[{be}] decode(plan=p)", with_plan)
        guarded(f"[{be}] decode(plan=p, out=)", lambda be=be: with_plan(be, out=out))
        guarded(f"[{be}] decode(plan=p, return_lse=True)", lambda be=be: with_plan(be, return_lse=True))
        guarded(f"[{be}] decode(plan=p, out=, return_lse=True)",
                lambda be=be: with_plan(be, out=out, return_lse=True))
        def bound_launch(be=be):
            """The lean path's launch alone: the plan's bound launcher with this call's pointers."""
            p = splitkv.plan(sl, Hq, Hkv, D, backend=be)
            for _ in range(2):
                splitkv.decode(q, k, v, sl, plan=p, backend=be)  # the second call is the lean one
            hit = validate.check_keyed(q, k, v, sl, None, None, None, be, True)[1].memo.get(p)
            if hit is None:
                raise RuntimeError("no bound launch: the lean path is not taken for this call")
            launch, stream, o = hit[1], torch.cuda.current_stream(device).cuda_stream, torch.empty_like(q)
            ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), sl.data_ptr(), o.data_ptr(),
                    p.lse_scratch.data_ptr())
            return lambda: launch(stream, *ptrs) or o  # o: alive while the launches write it

        guarded(f"[{be}] decode(plan=graph-safe p)", with_graph_plan)
        if device.type == "cuda":
            guarded(f"[{be}] bound launch only (lean path's launch)", bound_launch)
        guarded(f"[{be}] splitkv.plan() eager", lambda be=be: lambda: splitkv.plan(sl, Hq, Hkv, D, backend=be))
        guarded(f"[{be}] graph-safe p.refresh(lens)", refresh)

    # peers: SDPA on views in its [B, H, L, D] layout (no copy; GQA kernels take Hq != Hkv)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for which, label in (("cudnn", "cuDNN"), ("flash", "flash")):
        if which == "cudnn" and device.type != "cuda":
            entries.append(("[peer] SDPA cuDNN", "skipped: needs CUDA"))
            continue

        def sdpa(which=which):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[which]

            def call():
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            with sdpa_kernel([kind]):
                call()  # a backend that rejects the problem raises here, before timing
            return call, sdpa_kernel([kind])  # the context is held around the timed loop, as the bench does

        guarded(f"[peer] SDPA {label}", sdpa)

    # stages reachable from outside
    guarded("[stage] validate.check_keyed (signature lookup)",
            lambda: lambda: validate.check_keyed(q, k, v, sl, None, None, None, "auto", True))
    guarded("[stage] torch.empty_like(q)", lambda: lambda: torch.empty_like(q))
    if device.type == "cuda":
        guarded("[stage] torch.cuda.current_stream()", lambda: lambda: torch.cuda.current_stream(device))
    return entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for host_overhead.json")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--calls", type=int, default=None,
                    help="calls per timed loop (default: sized to ~20 ms, 10..100 on a GPU)")
    ap.add_argument("--shape", default="1,4096,32,8,128", help="B,L,Hq,Hkv,D (default 1,4096,32,8,128)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated splitkv backends (default: triton,cutlass,auto on CUDA; torch,auto on CPU)")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    B, L, Hq, Hkv, D = (int(x) for x in a.shape.split(","))
    names = (a.backends.split(",") if a.backends else
             (["triton", "cutlass", "auto"] if device.type == "cuda" else ["torch", "auto"]))
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, 1, Hq, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, L, Hkv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, L, Hkv, D, device=device, dtype=dtype, generator=gen)
    sl = torch.full((B,), L, dtype=torch.int32, device=device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"host µs per call on {where}: B={B} L={L} Hq/Hkv={Hq}/{Hkv} D={D} bf16 "
          "(calls back to back, no sync; wall / calls, median of 3 loops)", flush=True)
    res = measure(entries_for(q, k, v, sl, device, names), device, a.calls)
    if a.out:
        doc = {"schema": SCHEMA,
               "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "device": where, "torch": torch.__version__, "python": platform.python_version(),
                        "splitkv": splitkv.__version__, "shape": {"B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D},
                        "dtype": "bf16", "calls": a.calls, "backends": names,
                        "command": "python benchmarks/host_overhead.py " + " ".join(argv or sys.argv[1:]),
                        "method": "splitkv.bench.timing.time_host: N calls without sync, wall / N, median of 3"},
               "results": res}
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "host_overhead.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
