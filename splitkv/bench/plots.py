"""--plot DIR: PNGs from bench rows (matplotlib's Agg canvas directly: no pyplot, no global backend).

  bandwidth_h{Hq}x{Hkv}_d{D}_{dtype}.png  effective TB/s vs context length, one panel per batch
                                          size, one line per provider, the SOL line dashed
                                          (when the device has one); GB/s below 0.5 TB/s
  speedup_{mode}.png                       best peer time / splitkv time per shape (> 1 = faster)
  sweep.png                                time vs num_splits per swept shape, planner's pick marked
Only contiguous, uniform, Sq = 1 rows (the PEERS.md grid) go into the bandwidth plots.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..pngs import save_png
from .report import headline_mode


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    return save_png(fig, path)


def _grid_rows(rows):
    return [r for r in rows if r["page_size"] is None and r["q_len"] == 1
            and r["seqlen_total"] == r["batch"] * r["seqlen_max"]]


def _fmt_len(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def bandwidth_plots(rows, out_dir: Path, sol_tbps: float | None, mode: str) -> list[Path]:
    groups: dict[tuple, list[dict]] = {}
    for r in _grid_rows(rows):
        if r[f"{mode}_tbps"]:
            groups.setdefault((r["num_q_heads"], r["num_kv_heads"], r["head_dim"], r["dtype"]), []).append(r)
    paths = []
    for (hq, hkv, d, dtype), group in sorted(groups.items()):
        batches = sorted({r["batch"] for r in group})
        fig = Figure(figsize=(4.2 * len(batches), 3.8), layout="constrained")
        axes = fig.subplots(1, len(batches), squeeze=False, sharey=True)[0]
        providers = sorted({r["provider"] for r in group}, key=lambda p: (not p.startswith("splitkv"), p))
        lengths = sorted({r["seqlen_max"] for r in group})
        top = max(r[f"{mode}_tbps"] for r in group)
        # GB/s below 0.5 TB/s (a CPU run), so the axis does not read 0.0000x
        unit, scale = ("TB/s", 1.0) if max(top, sol_tbps or 0) >= 0.5 else ("GB/s", 1e3)
        for ax, B in zip(axes, batches, strict=True):
            for prov in providers:
                pts = sorted((r["seqlen_max"], r[f"{mode}_tbps"] * scale) for r in group
                             if r["batch"] == B and r["provider"] == prov)
                if pts:
                    lw = 2.2 if prov.startswith("splitkv") else 1.2
                    ax.plot(*zip(*pts, strict=True), marker="o", lw=lw, label=prov)
            if sol_tbps:  # only the device's own peak (or --sol-tbps)
                ax.axhline(sol_tbps * scale, ls="--", color="gray", lw=1)
                ax.text(lengths[0], sol_tbps * scale, f" SOL {sol_tbps * scale:g} {unit}", va="bottom",
                        fontsize=8, color="gray")
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [_fmt_len(L) for L in lengths])
            ax.set_ylim(0, max(sol_tbps or 0, top) * scale * 1.12)
            ax.set_title(f"B={B}")
            ax.set_xlabel("context length (keys)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(f"effective {unit} ({mode})")
        axes[-1].legend(fontsize=8, loc="lower right")
        fig.suptitle(f"decode Hq/Hkv={hq}/{hkv} D={d} {dtype}")
        paths.append(_save(fig, out_dir / f"bandwidth_h{hq}x{hkv}_d{d}_{dtype}.png"))
    return paths


def speedup_plot(rows, out_dir: Path, mode: str) -> Path:
    ours = [r for r in rows if r["kind"] == "splitkv" and r[f"{mode}_vs_best_peer"]]
    labels = [f"{r['shape']} {r['dtype']} ({r['provider'][8:]})" for r in ours]
    values = [r[f"{mode}_vs_best_peer"] for r in ours]
    fig = Figure(figsize=(9, 1.2 + 0.24 * max(len(ours), 1)), layout="constrained")
    ax = fig.subplots()
    if ours:
        ax.barh(range(len(ours)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
        ax.set_yticks(range(len(ours)), labels, fontsize=7)
        ax.invert_yaxis()
        for i, r in enumerate(ours):
            ax.text(values[i], i, f" {values[i]:.2f} vs {r[f'best_peer_{mode}']}", va="center", fontsize=6)
    else:
        ax.text(0.5, 0.5, "no row has both splitkv and a peer", ha="center", transform=ax.transAxes)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel(f"speedup vs best peer in the same run ({mode}; > 1 = splitkv faster)")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, out_dir / f"speedup_{mode}.png")


def sweep_plot(sweep, out_dir: Path) -> Path:
    n = len(sweep)
    cols = min(n, 3)
    fig = Figure(figsize=(4.5 * cols, 3.4 * -(-n // cols)), layout="constrained")
    axes = fig.subplots(-(-n // cols), cols, squeeze=False).ravel()
    for ax, s in zip(axes, sweep, strict=False):  # extra axes are hidden
        pts = sorted((c["splits"], c["us"]) for c in s["curve"])
        ax.plot(*zip(*pts, strict=True), marker=".", label="forced num_splits")
        ax.scatter([s["planner_splits"]], [s["planner_us"]], color="red", zorder=3,
                   label=f"planner ({s['regret_pct']:+.1f}%)")
        ax.set_title(s["shape"], fontsize=9)
        ax.set_xlabel("splits")
        ax.set_ylabel(f"µs per call ({s['mode']})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[n:]:
        ax.set_visible(False)
    return _save(fig, out_dir / "sweep.png")


def write_plots(rows, out_dir, sol_tbps: float | None, sweep=None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if rows:  # --sweep-only runs have none
        mode = headline_mode(rows)
        paths += bandwidth_plots(rows, out, sol_tbps, mode)
        paths.append(speedup_plot(rows, out, mode))
    splits = [s for s in sweep or () if s.get("sweep") != "tiles"]  # tile sweeps: the markdown table
    if splits:
        paths.append(sweep_plot(splits, out))
    return paths
