"""Diagnostics: heat maps of the per-split partial LSE of a real decode call.

    rep = splitkv.viz.lse_heatmap(q, k_cache, v_cache, cache_seqlens, out="lse.png")
    rep.anomalies            # [Anomaly(request, split, head, query, kind, value, detail)]

The partials come from the documented debug hook `splitkv.debug.capture_partials()` around an
ordinary `splitkv.decode` call (no second code path). One panel per request: rows are splits,
columns are query heads (x Sq for speculative verify); splits past the request's num_splits are
grey. Anomalies are flagged in the figure and on stdout:
  nan           NaN partial LSE in a used split
  inf           +inf partial LSE
  -inf          -inf in a split that has visible keys (it should have a finite LSE)
  empty-finite  a finite LSE in a split with no visible key (empty splits must write -inf)
  outlier       a split whose per-key LSE, lse - log(visible keys), exceeds the mean of its
                neighbouring splits' by more than `outlier_nats` (an attention sink can do this
                legitimately; corrupt K or a wrong scale does it too)

CLI: `python -m splitkv heatmap --out PATH [--inputs FILE]` (see heatmap_main). Where the planner
would split into fewer than MIN_SHOWN_SPLITS (a CPU, a short context, a big batch), the CLI forces
SHOW_SPLITS so the figure shows the split structure, and says so; `--num-splits auto` keeps the
planner's count, `--num-splits N` forces N.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import debug
from .api import decode
from .cli_args import MIN_SHOWN_SPLITS, OUTLIER_NATS, SHOW_SPLITS, heatmap_parser  # the CLI shares these defaults
from .plan import DecodePlan
from .plan import plan as make_plan
from .pngs import save_png

MAX_PANELS = 8


@dataclass
class Anomaly:
    request: int
    split: int
    head: int
    query: int
    kind: str
    value: float
    detail: str = ""

    def __str__(self) -> str:
        return (f"request {self.request} split {self.split} head {self.head} query {self.query}: "
                f"{self.kind} (lse={self.value:.4g}) {self.detail}".rstrip())


@dataclass
class LseReport:
    lse: torch.Tensor  # [S, B, Hq, Sq] fp32 partial LSE (natural log)
    num_splits: torch.Tensor  # [B]
    keys: torch.Tensor  # [S, B, Sq] visible keys of each split for each query
    plan: str
    anomalies: list[Anomaly] = field(default_factory=list)
    path: Path | None = None


def split_keys(cache_seqlens, num_splits, chunk_lens, num_splits_dim: int, q_len: int, causal: bool):
    """[S, B, Sq] keys each split shows each query (the plan's split rule, see splitkv/plan.py)."""
    L = cache_seqlens.long()[None, :, None]
    n = num_splits.long()[None, :, None]
    c = chunk_lens.long()[None, :, None]
    s = torch.arange(num_splits_dim)[:, None, None]
    start = s * c
    end = torch.where(s == n - 1, L, torch.minimum(start + c, L))
    if causal:
        end = torch.minimum(end, L - q_len + torch.arange(q_len)[None, None, :] + 1)
    keys = (end - start).clamp_(min=0)
    return torch.where(s < n, keys, torch.zeros_like(keys))


def find_anomalies(lse, keys, num_splits, outlier_nats: float = OUTLIER_NATS) -> list[Anomaly]:
    """Anomalies of partial LSE [S, B, Hq, Sq] given visible keys [S, B, Sq] (see module doc)."""
    S, B, H, T = lse.shape
    used = torch.arange(S)[:, None] < num_splits.long()[None, :]  # [S, B]
    k = keys[:, :, None, :].expand(S, B, H, T)
    u = used[:, :, None, None].expand(S, B, H, T)
    out: list[Anomaly] = []

    def add(mask, kind, detail_fn):
        for s, b, h, t in mask.nonzero().tolist():
            out.append(Anomaly(b, s, h, t, kind, float(lse[s, b, h, t]), detail_fn(s, b, h, t)))

    add(u & torch.isnan(lse), "nan", lambda s, b, h, t: f"({int(k[s, b, h, t])} keys)")
    add(u & torch.isposinf(lse), "inf", lambda *i: "")
    add(u & torch.isneginf(lse) & (k > 0), "-inf",
        lambda s, b, h, t: f"with {int(k[s, b, h, t])} visible keys")
    add(u & torch.isfinite(lse) & (k == 0), "empty-finite", lambda *i: "split has no visible key")
    # per-key LSE, so a short last split is not "below" its neighbours just for being short
    ok = u & torch.isfinite(lse) & (k > 0)
    z = torch.where(ok, lse - torch.log(k.clamp(min=1).float()), torch.nan)
    prev = torch.cat([torch.full_like(z[:1], torch.nan), z[:-1]])
    nxt = torch.cat([z[1:], torch.full_like(z[:1], torch.nan)])
    ref = torch.stack([prev, nxt]).nanmean(dim=0)  # nan where no neighbour is usable
    gap = z - ref
    add(ok & (gap > outlier_nats), "outlier",
        lambda s, b, h, t: f"{float(gap[s, b, h, t]):.1f} nats/key above its neighbours")
    return sorted(out, key=lambda a: (a.request, a.split, a.head, a.query))


def collect(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=True, softmax_scale=None,
            num_splits=None, plan=None, backend="auto") -> LseReport:
    """Run one real decode under splitkv.debug.capture_partials() and return its partial LSE."""
    with debug.capture_partials() as records:
        decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, causal=causal,
               softmax_scale=softmax_scale, num_splits=None if plan is not None else num_splits,
               plan=plan, backend=backend)
    rec = records[-1]
    lse = rec.lse_part.float()
    S, T = lse.shape[0], lse.shape[3]
    if rec.o_part is None:  # nothing split: the record holds the final lse as split 0
        lengths = rec.cache_seqlens
        chunks = lengths.clamp(min=1)
    else:
        chunks = rec.plan.chunk_lens.detach().cpu()
    keys = split_keys(rec.cache_seqlens, rec.num_splits, chunks, S, T, causal)
    return LseReport(lse, rec.num_splits, keys, rec.plan.describe())


def draw(rep: LseReport, path, requests=None, title: str = "") -> Path:
    """Write the heat map PNG (Agg canvas; no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    S, B, H, T = rep.lse.shape
    flagged = sorted({a.request for a in rep.anomalies})
    if requests is None:
        requests = sorted(set(list(range(min(B, 4))) + flagged))[:MAX_PANELS]
    requests = list(requests)
    if not requests or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < B for b in requests):
        raise ValueError(f"requests: expected a non-empty list of request indices in [0, {B}), got {requests!r}"
                         + (" (the batch is empty: nothing to draw)" if B == 0 else ""))
    rows = max(int(rep.num_splits[requests].max()), 1)
    width = min(max(6.5, 3 + 0.22 * H * T), 14)
    fig = Figure(figsize=(width, 2.0 + min(0.25 * rows, 5) * len(requests)), layout="constrained")
    axes = fig.subplots(len(requests), 1, squeeze=False)[:, 0]
    finite = rep.lse[torch.isfinite(rep.lse)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    cmap = _cmap()
    for ax, b in zip(axes, requests, strict=True):
        n = int(rep.num_splits[b])
        img = rep.lse[:rows, b].reshape(rows, H * T).clone()  # columns: head-major, then query
        img[n:] = torch.nan
        data = img.masked_fill(~torch.isfinite(img), torch.nan).numpy()
        im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        for a in rep.anomalies:
            if a.request == b and a.split < rows:
                x = a.head * T + a.query
                outlier = a.kind == "outlier"
                style = dict(marker="s", facecolors="none", s=60) if outlier else dict(marker="x", s=40)
                ax.scatter([x], [a.split], color="red", linewidths=1.5, **style)
        count = sum(a.request == b for a in rep.anomalies)
        ax.set_title(f"request {b}: {n} splits" + (f" — {count} anomalies" if count else ""),
                     fontsize=9, color="red" if count else "black")
        ax.set_ylabel("split")
        ax.set_xlabel("query head" + (" x query" if T > 1 else ""))
        fig.colorbar(im, ax=ax, label="partial LSE")
    head = title or "splitkv partial LSE per split"
    if rep.anomalies:
        head += f"\nANOMALIES: {len(rep.anomalies)} (x = NaN/inf, square = outlier)"
    fig.suptitle(head, color="red" if rep.anomalies else "black", fontsize=10)
    FigureCanvasAgg(fig)
    return save_png(fig, path, colors=256)  # the colour map's gradient


def _cmap():
    import matplotlib

    # grey: unused splits, and NaN/inf cells (marked with a red x on top)
    return matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")


def lse_heatmap(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                block_table: torch.Tensor | None = None, causal: bool = True, softmax_scale: float | None = None,
                num_splits: int | None = None, plan: DecodePlan | None = None, backend: str = "auto",
                out: str | os.PathLike | None = None, requests: Sequence[int] | None = None,
                outlier_nats: float = OUTLIER_NATS, echo: bool = True, title: str = "") -> LseReport:
    """Decode once, collect the per-split partial LSE (split x head) through the debug hook, flag
    anomalies (module doc), print them when echo, and draw the heat map to `out` (a PNG path) when
    given, under `title`. Inputs as for splitkv.decode."""
    rep = collect(q, k_cache, v_cache, cache_seqlens, block_table=block_table, causal=causal,
                  softmax_scale=softmax_scale, num_splits=num_splits, plan=plan, backend=backend)
    rep.anomalies = find_anomalies(rep.lse, rep.keys, rep.num_splits, outlier_nats)
    if echo:
        print(rep.plan)
        print(f"{len(rep.anomalies)} anomalies" + (":" if rep.anomalies else ""))
        for a in rep.anomalies[:20]:
            print("  " + str(a))
        if len(rep.anomalies) > 20:
            print(f"  ... and {len(rep.anomalies) - 20} more")
    if out is not None:
        rep.path = draw(rep, out, requests, title)
        if echo:
            print(f"wrote {rep.path}")
    return rep


def plant_nan(k_cache, cache_seqlens, block_table, plan, request: int, split: int) -> int:
    """Write NaN into K at the first key of `split` of `request` (per `plan`); returns the position.
    For demonstrating / testing the anomaly flags."""
    c = int(plan.chunk_lens[request])
    pos = split * c
    L = int(cache_seqlens[request])
    if split >= int(plan.num_splits[request]) or pos >= L:
        raise ValueError(f"split: request {request} has no keys in split {split} under this plan")
    if block_table is None:
        k_cache[request, pos] = float("nan")
    else:
        ps = k_cache.shape[1]
        k_cache[int(block_table[request, pos // ps]), pos % ps] = float("nan")
    return pos


def _random_inputs(args, device):
    hq, hkv = (int(x) for x in args.heads.split("/"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    B, L, D = args.batch, args.seqlen, args.head_dim

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    return {"q": randn(B, args.q_len, hq, D), "k_cache": randn(B, L, hkv, D), "v_cache": randn(B, L, hkv, D),
            "cache_seqlens": torch.full((B,), L, dtype=torch.int32, device=device)}


def heatmap_main(argv: list[str] | None = None) -> int:
    ap = heatmap_parser()
    args = ap.parse_args(argv)
    try:
        return _heatmap(ap, args)
    except (ValueError, TypeError, OSError, RuntimeError, pickle.UnpicklingError) as e:
        ap.error(f"{type(e).__name__}: {e}")  # bad inputs or backend: one line, exit code 2, no traceback


def _heatmap(ap, args) -> int:
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(auto if args.device == "auto" else args.device)
    except RuntimeError as e:
        ap.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device: no CUDA GPU is available here")
    if args.inputs:
        if not os.path.isfile(args.inputs):
            ap.error(f"--inputs: no such file: {args.inputs}")
        data = torch.load(args.inputs, map_location=device, weights_only=True)
        missing = [k for k in ("q", "k_cache", "v_cache", "cache_seqlens") if k not in data]
        if missing:
            raise SystemExit(f"--inputs: {args.inputs} lacks {missing} "
                             "(expected a dict saved with torch.save)")
    else:
        data = _random_inputs(args, device)
    q, k, v, seqlens = data["q"], data["k_cache"], data["v_cache"], data["cache_seqlens"]
    bt = data.get("block_table")
    causal = bool(data.get("causal", True))
    shape = (seqlens, q.shape[2], k.shape[2], q.shape[3])
    forced = args.num_splits if isinstance(args.num_splits, int) else None
    paged = bt is not None
    p = make_plan(*shape, q_len=q.shape[1], num_splits=forced, backend=args.backend, paged=paged)
    title = ""
    if args.num_splits is None:
        planned = int(p.num_splits.max())
        if planned < MIN_SHOWN_SPLITS:
            shown = make_plan(*shape, q_len=q.shape[1], num_splits=SHOW_SPLITS, backend=args.backend, paged=paged)
            if int(shown.num_splits.max()) > planned:
                n = int(shown.num_splits.max())
                print(f"the planner splits these inputs into {planned} on {device} (a {planned}-row strip); "
                      f"drawing {n} forced splits to show the split structure "
                      "(--num-splits auto: the planner's count; --num-splits N: N)")
                title = f"splitkv partial LSE per split ({n} forced; the planner picks {planned} here)"
                p = shown
    B = q.shape[0]
    if args.plant_nan:
        req, split = args.plant_nan
        if req >= B:
            ap.error(f"--plant-nan: request {req} is not in the batch of {B}")
        try:
            pos = plant_nan(k, seqlens, bt, p, req, split)
        except ValueError as e:
            ap.error(f"--plant-nan: {e}")
        print(f"planted NaN at request {req}, key {pos} (split {split})")
    requests = args.requests
    if requests and max(requests) >= B:
        ap.error(f"--requests: request {max(requests)} is not in the batch of {B}")
    rep = lse_heatmap(q, k, v, seqlens, block_table=bt, causal=causal,
                      softmax_scale=data.get("softmax_scale"), plan=p, backend=args.backend,
                      out=args.out, requests=requests, outlier_nats=args.outlier_nats, title=title)
    return 1 if (args.strict and rep.anomalies) else 0

