"""Argument parsers of the `python -m splitkv` commands that import torch (demo, bench, heatmap),
in a module that does not: `python -m splitkv CMD --help` answers without loading torch, and each
command parses with the same parser (help and behaviour cannot drift apart)."""

from __future__ import annotations

import argparse

# heatmap defaults (splitkv.viz uses them too)
OUTLIER_NATS = 8.0  # e^8 ~ 3000x more softmax mass per key than the neighbouring splits
MIN_SHOWN_SPLITS = 4  # heatmap CLI: a planner's pick below this is a strip, not a map...
SHOW_SPLITS = 8  # ...so it forces this many (bounded by one 64-key tile per split)
# bench --flush: how eager timing evicts the L2 (splitkv.bench.timing uses them too): do_bench's memset, or a read
FLUSHES = ("write", "read")


def demo_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m splitkv demo",
        description="Long-context decode per backend, timed (eager without a plan, and under CUDA-graph replay, "
                    "next to cuDNN on a GPU) and checked against the fp64 reference; then a small Llama decoded "
                    "through splitkv vs transformers' generate (needs the hf extra).")
    ap.add_argument("--tf-compile", action="store_true",
                    help="GPU: also time transformers' generate with a StaticCache and its automatic torch.compile "
                         "(its fastest configuration; it compiles at its first call, timed)")
    return ap


def bench_parser() -> argparse.ArgumentParser:
    from .bench import shapes  # light: the shape tables, no torch

    ap = argparse.ArgumentParser(
        prog="python -m splitkv bench",
        description="Decode attention benchmark: splitkv vs peers (see benchmarks/README.md).",
        epilog="Model benchmarks (transformers needed): `python -m splitkv bench hf-step --help` (decode step "
               "time of a Llama vs transformers' configurations), `python -m splitkv bench hf-serve --help` "
               "(continuous batching on a request trace vs transformers' manager).")
    ap.add_argument("--suite", choices=tuple(shapes.SUITES), default="full",
                    help="shape suite (default: full)")
    ap.add_argument("--quick", action="store_true", help="same as --suite quick (tiny, CPU-friendly)")
    ap.add_argument("--shapes", help="comma-separated globs on shape names, e.g. 'b1-*,*-paged16'")
    ap.add_argument("--list", action="store_true", help="list the selected shapes and providers, then exit")
    ap.add_argument("--providers", help="names or groups (splitkv, peers, all); default: splitkv,peers. "
                                        "splitkv-<backend>: plan reused (eager + graph rows); "
                                        "splitkv-<backend>-noplan: decode(q, k, v, lens) with no plan")
    ap.add_argument("--backends", help="splitkv backends for the 'splitkv' group (default: triton,cutlass on "
                                       "CUDA, torch on CPU)")
    ap.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16 (default: bf16)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    ap.add_argument("--reps", type=_int_at_least(1), default=None, help="cap on graph replays, and on eager repetitions "
                                                           "/ 10 (default 20; 3 for --suite quick)")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timing")
    ap.add_argument("--no-host", action="store_true",
                    help="skip host timing (CPU µs per call of a launch loop without synchronising)")
    ap.add_argument("--flush", choices=FLUSHES, default="write",
                    help="how eager timing evicts the L2 before each call: write (default, do_bench's 256 MB "
                         "memset; the call also pays the write-back of the dirty lines it leaves) or read (a "
                         "read of the same buffer: clean lines, the call's own time)")
    ap.add_argument("--num-splits", default="auto",
                    help="auto (planner), N (force N splits in splitkv rows), or sweep "
                         "(add the planner's report card)")
    ap.add_argument("--sweep-range", help="num_splits range LO:HI for the sweep (default 1:64; quick 1:8)")
    ap.add_argument("--sweep-shapes",
                    help="globs of shapes to sweep (default: a built-in subset of the suite)")
    ap.add_argument("--sweep-tiles", nargs="?", const="default", metavar="TILES",
                    help="time the planner's kernel tile against forced BLOCK_NxWARPSxSTAGES tiles, e.g. "
                         "64x4x3,128x4x2 (no value: each backend's default list; a :fused or :merge suffix forces "
                         "the split kernel's own merge or the merge kernel), on the sweep shapes")
    ap.add_argument("--sweep-only", action="store_true",
                    help="with --num-splits sweep or --sweep-tiles: skip the main table")
    ap.add_argument("--host-breakdown", action="store_true",
                    help="instead of the table: host µs per call of each decode entry point and stage (plan or "
                         "not, out=, return_lse, bound launch, signature lookup) next to SDPA, on --host-shape")
    ap.add_argument("--host-shape", default="1,4096,32,8,128", metavar="B,L,Hq,Hkv,D",
                    help="the --host-breakdown problem (default 1,4096,32,8,128: B=1 GQA 32/8 4K, host-bound)")
    ap.add_argument("--explain", action="store_true",
                    help="print each splitkv row's plan (DecodePlan.describe())")
    ap.add_argument("--json", metavar="PATH", help="write rows + metadata as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write a markdown report")
    ap.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    ap.add_argument("--sol-tbps", type=_positive_float, default=None,
                    help="speed of light, TB/s, for %% of SOL (default: the spec bandwidth of the GPU used, "
                         "e.g. H200 4.8; none on a CPU or an unlisted GPU)")
    ap.add_argument("--wide", action="store_true",
                    help="terminal table with dtype, graph columns and each row's note (--json / --markdown "
                         "always have every column)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
    return ap


def heatmap_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m splitkv heatmap",
                                 description="Per-split partial-LSE heat map of one real decode call.")
    ap.add_argument("--out", required=True, help="PNG path to write")
    ap.add_argument("--inputs", help="torch.save'd dict with q, k_cache, v_cache, cache_seqlens "
                                     "[, block_table, causal, softmax_scale]; random inputs when omitted")
    ap.add_argument("--batch", type=_int_at_least(1), default=2)
    ap.add_argument("--seqlen", type=_int_at_least(0), default=4096)
    ap.add_argument("--heads", type=_heads, default="32/8", help="Hq/Hkv")
    ap.add_argument("--head-dim", type=_head_dim, default=128)
    ap.add_argument("--q-len", type=_q_len, default=1)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--num-splits", type=_num_splits, metavar="N|auto",
                    help=f"force N splits; auto: the planner's count. Default: the planner's, or "
                         f"{SHOW_SPLITS} forced (said on stdout) when the planner would split into fewer "
                         f"than {MIN_SHOWN_SPLITS}, which would draw a strip instead of a map")
    ap.add_argument("--requests", type=_int_list, help="comma-separated requests to draw (default: first 4 + flagged)")
    ap.add_argument("--plant-nan", metavar="REQ:SPLIT", type=_req_split,
                    help="write a NaN key into that split (demo of the flags)")
    ap.add_argument("--outlier-nats", type=_positive_float, default=OUTLIER_NATS)
    ap.add_argument("--strict", action="store_true", help="exit 1 when an anomaly is found")
    return ap


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {text!r}") from None
        if val < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {text!r}")
        return val
    return parse


def _heads(text: str) -> str:
    parts = text.split("/")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) % int(parts[1]):
        raise argparse.ArgumentTypeError(f"expected Hq/Hkv (positive ints, Hq a multiple of Hkv, e.g. 32/8), "
                                         f"got {text!r}")
    return text


def _head_dim(text: str) -> int:
    from .constants import HEAD_DIM_RANGE

    lo, hi = HEAD_DIM_RANGE
    if not text.isdigit() or not lo <= int(text) <= hi or int(text) % 8:
        raise argparse.ArgumentTypeError(f"expected a multiple of 8 in [{lo}, {hi}], got {text!r}")
    return int(text)


def _q_len(text: str) -> int:
    from .constants import MAX_Q_LEN

    if not text.isdigit() or not 1 <= int(text) <= MAX_Q_LEN:
        raise argparse.ArgumentTypeError(f"expected an int in [1, {MAX_Q_LEN}] (queries per request), got {text!r}")
    return int(text)


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0, got {text!r}") from None
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0, got {text!r}")
    return vals


def _req_split(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected REQ:SPLIT (two ints >= 0, e.g. 0:3), got {text!r}")
    return int(parts[0]), int(parts[1])


def _positive_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        val = float("nan")
    if not 0 < val < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return val


def _num_splits(text: str):
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or an int >= 1, got {text!r}")
    return int(text)
