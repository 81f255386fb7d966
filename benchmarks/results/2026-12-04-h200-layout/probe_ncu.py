"""Probe for Nsight Compute: one splitkv call (a reused plan) and one SDPA cuDNN call on the same bytes,
B=64 MHA 4K and B=16 GQA 32/8 128K, each library on both cache layouts ([B, L, H, D] and head-major
[B, H, L, D]), between torch.cuda.profiler.start() / stop().

Run from the repository root:
  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
      python benchmarks/results/2026-12-04-h200-layout/probe_ncu.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitkv

dev = torch.device("cuda")
for B, L, Hq, Hkv in ((64, 4096, 32, 32), (16, 131072, 32, 8)):
    q = torch.randn(B, 1, Hq, 128, dtype=torch.bfloat16, device=dev)
    k_blhd = torch.randn(B, L, Hkv, 128, dtype=torch.bfloat16, device=dev)
    v_blhd = torch.randn_like(k_blhd)
    k_bhld, v_bhld = k_blhd.transpose(1, 2).contiguous(), v_blhd.transpose(1, 2).contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    p = splitkv.plan(lens, Hq, Hkv, 128, max_seqlen=L)
    calls = [
        lambda: splitkv.decode(q, k_blhd, v_blhd, lens, plan=p),
        lambda: splitkv.decode(q, k_bhld.transpose(1, 2), v_bhld.transpose(1, 2), lens, plan=p),
        lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k_bhld, v_bhld, enable_gqa=Hq != Hkv),
        lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k_blhd.transpose(1, 2), v_blhd.transpose(1, 2),
                                               enable_gqa=Hq != Hkv),
    ]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for f in calls:  # warm: compile, plan, cuDNN graph build
            f()
            f()
        torch.cuda.synchronize()
        for f in calls:
            torch.cuda.profiler.start()
            f()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    print(f"done B={B} L={L} {Hq}/{Hkv}", flush=True)
