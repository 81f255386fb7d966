"""`python -m splitkv demo`: a long-context decode per backend, checked against the reference.

GPU: B=1, Hq 32 / Hkv 8, D 128, bf16 at 32K and 128K keys, every backend available, timed with
triton.testing.do_bench (median, L2 flushed). CPU: the same head layout at sizes that finish in
seconds (torch backend; the Triton kernels interpreted at a small size when TRITON_INTERPRET=1).
Then a random-weight Llama decodes through PagedKVCache + splitkv (demo_llama.py).
"""

from __future__ import annotations

import os
import time

import torch
from rich.console import Console
from rich.table import Table

import splitkv
from splitkv import backends
from splitkv.reference import decode_reference


def _time_us(fn, device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    fn()
    t0 = time.perf_counter()
    reps = 3
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def _cases(device):
    if device.type == "cuda":
        names = ["triton"] + (["cutlass"] if backends.cutlass_available() else [])
        return [(1, 32, 8, 128, L, torch.bfloat16, names) for L in (32768, 131072)]
    cases = [(1, 32, 8, 128, L, torch.bfloat16, ["torch"]) for L in (4096, 16384)]
    if os.environ.get("TRITON_INTERPRET") == "1" and backends.triton_available():
        cases.append((1, 8, 2, 64, 512, torch.bfloat16, ["triton"]))
    return cases


def main(argv: list[str] | None = None) -> int:
    console = Console(width=None if Console().is_terminal else 120)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(f"[bold]splitkv {splitkv.__version__}[/] demo on {where}: single-token decode, "
                  "bf16, every result checked against splitkv.reference (fp64)")
    table = Table("backend", "B", "Hq/Hkv", "D", "keys", "splits", "time µs", "KV GB/s", "max |err|", "check")
    ok_all = True
    gen = torch.Generator(device=device).manual_seed(0)
    for B, Hq, Hkv, D, L, dt, names in _cases(device):
        q = torch.randn(B, 1, Hq, D, device=device, dtype=dt, generator=gen)
        k = torch.randn(B, L, Hkv, D, device=device, dtype=dt, generator=gen)
        v = torch.randn(B, L, Hkv, D, device=device, dtype=dt, generator=gen)
        sl = torch.full((B,), L, dtype=torch.int32, device=device)
        ref, _ = decode_reference(q, k, v, sl, dtype=torch.float32 if device.type == "cuda" else torch.float64)
        kv_bytes = 2 * B * L * Hkv * D * k.element_size()
        for name in names:
            plan = splitkv.plan(sl, Hq, Hkv, D, backend=name)  # split count sized for this backend
            o = splitkv.decode(q, k, v, sl, plan=plan, backend=name)
            err = (o.double() - ref.double()).abs().max().item()
            good = err < 2e-2 and not torch.isnan(o).any()
            ok_all &= good
            us = _time_us(lambda n=name: splitkv.decode(q, k, v, sl, plan=plan, backend=n), device)
            splits = plan.num_splits_host[0] if plan.num_splits_host else "-"
            table.add_row(name, str(B), f"{Hq}/{Hkv}", str(D), str(L), str(splits), f"{us:,.1f}",
                          f"{kv_bytes / us / 1e3:,.1f}", f"{err:.1e}", "[green]ok[/]" if good else "[red]FAIL[/]")
    console.print(table)
    if device.type != "cuda":
        console.print("No GPU here: the CPU runs the torch backend (the same split/combine algorithm). "
                      "On a CUDA GPU the demo times the Triton (and CUTLASS) kernels at 32K and 128K keys.")
    console.print("[green]all results match the reference[/]" if ok_all else "[red]mismatch against the reference[/]")
    from .demo_llama import run as run_llama

    ok_all &= run_llama(console, device)
    return 0 if ok_all else 1
