"""`python -m splitkv bench --host-breakdown`: host (CPU) time per decode call and per stage, what
eager small-shape latency is made of.

    python -m splitkv bench --host-breakdown [--device cuda|cpu] [--reps N] [--host-shape B,L,Hq,Hkv,D]
                            [--backends triton,cutlass,auto] [--json PATH] [--markdown PATH]

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
that raises is reported as "error: ..." and the run goes on.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

import splitkv
from splitkv import backends, validate

from .timing import time_host

SCHEMA = "splitkv.host_breakdown/1"


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


def measure(entries, device: torch.device, calls: int | None, say=print) -> dict:
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
        say(f"HOST {name:44s} {text}")
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


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        B, L, Hq, Hkv, D = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--host-shape: expected B,L,Hq,Hkv,D (e.g. 1,4096,32,8,128), got {text!r}") from None
    if min(B, L, Hq, Hkv, D) < 1 or Hq % Hkv:
        raise ValueError(f"--host-shape: expected positive sizes with Hq a multiple of Hkv, got {text!r}")
    return B, L, Hq, Hkv, D


def run(device: torch.device, shape: str, backend_names: tuple[str, ...] | None, calls: int | None,
        meta: dict, json_path: str | None, markdown_path: str | None, say=print) -> dict:
    """Measure every entry, print one line each, write JSON / markdown; returns {entry: µs | text}."""
    B, L, Hq, Hkv, D = parse_shape(shape)
    names = list(backend_names or (("triton", "cutlass", "auto") if device.type == "cuda" else ("torch", "auto")))
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, 1, Hq, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, L, Hkv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, L, Hkv, D, device=device, dtype=dtype, generator=gen)
    sl = torch.full((B,), L, dtype=torch.int32, device=device)
    say(f"host µs per call on {meta['device']}: B={B} L={L} Hq/Hkv={Hq}/{Hkv} D={D} bf16 "
        "(calls back to back, no sync; wall / calls, median of 3 loops)")
    res = measure(entries_for(q, k, v, sl, device, names), device, calls, say)
    meta = dict(meta, shape={"B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D}, dtype="bf16", calls=calls,
                backends=names, method="splitkv.bench.timing.time_host: N calls without sync, wall / N, median of 3")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"schema": SCHEMA, "meta": meta, "results": res}, indent=1))
    if markdown_path:
        lines = [f"# splitkv host µs per call — {meta['device']}", "",
                 f"{meta['date']} · torch {meta['torch']} · triton {meta['triton']} · cutlass-dsl {meta['cutlass']} · "
                 f"splitkv {meta['splitkv']}", "", f"Command: `{meta['command']}`", "",
                 f"Problem: B={B} L={L} Hq/Hkv={Hq}/{Hkv} D={D} bf16. Method: {meta['method']}.", "",
                 "| entry | host µs per call |", "|---|---|"]
        lines += [f"| {name} | {f'{v:.1f}' if isinstance(v, float) else v} |" for name, v in res.items()]
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_path).write_text("\n".join(lines) + "\n")
    return res
