"""Continuous batching on one request trace: splitkv's Engine against transformers' own continuous
batching (ContinuousBatchingManager, the engine behind `model.generate_batch`).

    python -m splitkv bench hf-serve --out results/hf_serve.json --plot results/   # H200, Llama-3-8B shape
    python -m splitkv bench hf-serve --out /tmp/serve.json --device cpu --tiny     # CPU smoke run

Trace (seeded): --requests prompts of random tokens, lengths uniform in --prompt-range, each asking
for a number of new tokens uniform in --output-range; greedy, no EOS, so every request runs to its
length in both engines. Two arrival patterns: "burst" (all at t = 0) and "poisson" (exponential
gaps at --rate requests/s). Both engines see the same requests at the same times; each is warmed up
first on a few short requests (compilation, CUDA-graph capture of the small batch buckets).

--time-limit S cuts each run S seconds after its first arrival (the full 256-request trace runs
for longer than one 10-minute GPU call): the requests still running are cancelled, and the row
counts what came out inside the window (output tokens / S; TTFT and TPOT of the requests that got
tokens; how many finished), so engines compare over the same window of the same trace.

Per engine and pattern: output tokens/s (all output tokens / time from the first arrival to the
last token, or to the cut), time to first token (first token - arrival) and time per output token
((last - first) / (n - 1)) at p50 / p99, and output tokens/s over time in 1 s bins (--plot draws them). splitkv
timestamps each token as its step returns; transformers' manager records them per token
(record_timestamps) where the installed version can, else at the moment its result is read; with
a cut its results stream (each token's result comes back as it is made), so the tokens of requests
unfinished at the cut count too.
Writes JSON (--out) and markdown (same path, .md).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import statistics
import time
from pathlib import Path

import torch

from splitkv.integrations.engine import Engine
from splitkv.pngs import save_png


def make_trace(a, vocab: int, pattern: str) -> list[dict]:
    rng = random.Random(a.seed)
    lo, hi = a.prompt_range
    olo, ohi = a.output_range
    t, out = 0.0, []
    for i in range(a.requests):
        if pattern == "poisson" and i:
            t += rng.expovariate(a.rate)
        n = rng.randint(lo, hi)
        out.append({"arrival": t, "prompt": [rng.randrange(3, vocab) for _ in range(n)],
                    "new": rng.randint(olo, ohi)})
    return out


def _due(trace, sent, now):
    while sent < len(trace) and trace[sent]["arrival"] <= now:
        yield sent
        sent += 1


def _window(times, limit):
    """Each request's token timestamps up to the cut (all of them without one)."""
    return [[t for t in ts if limit is None or t <= limit] for ts in times]


class SplitkvServer:
    """splitkv's Engine, made once (its CUDA graphs are kept across traces)."""

    def __init__(self, model, a):
        self.failed: dict[int, str] = {}  # the Engine reports no per-request failures (an error raises)
        self.eng = Engine(model, num_pages=a.num_pages, page_size=a.page_size, prefill_chunk=a.prefill_chunk,
                          cuda_graph=a.cuda_graph)

    def close(self):
        pass

    def run(self, trace, limit=None) -> list[list[float]]:
        """Token timestamps (s from the trace's start) per request, up to `limit` s."""
        return _run_splitkv(self.eng, trace, limit)


def _run_splitkv(eng, trace, limit=None) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in trace]
    index, sent = {}, 0
    t0 = time.perf_counter()
    while sent < len(trace) or eng.pending:
        now = time.perf_counter() - t0
        if limit is not None and now >= limit:
            for rid in index:  # the cut: what is still queued or running gives its pages back
                eng.cancel(rid)
            break
        for i in _due(trace, sent, now):
            r = trace[i]
            index[eng.add_request(torch.tensor(r["prompt"]), r["new"], eos_token_id=None)] = i
            sent = i + 1
        if not eng.pending:
            time.sleep(min(0.005, max(trace[sent]["arrival"] - now, 0.0)))
            continue
        for rid, _, _ in eng.step():
            times[index[rid]].append(time.perf_counter() - t0)
    return _window(times, limit)


class TransformersServer:
    """transformers' ContinuousBatchingManager, started once and fed every trace."""

    def __init__(self, model, a):
        self.model, self.a = model, a
        self.failed: dict[int, str] = {}  # the last run's failed requests (trace index -> transformers' error)
        self._stale = False  # restart the manager before the next run (set by a cut or a failure)
        self._start()

    def _start(self):
        import transformers

        gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=self.a.output_range[1], eos_token_id=None,
                                            pad_token_id=0)
        cb = self.a.tf_cb  # --tf-cb; empty: transformers' defaults
        kw = {"continuous_batching_config": transformers.ContinuousBatchingConfig(**cb)} if cb else {}
        self.manager = self.model.init_continuous_batching(generation_config=gen, **kw)
        self.manager.start()

    def close(self, hard=False):
        hard = hard or self._stale  # a cut or failed manager: nothing of its work is waited for
        kw = {"hard_stop": True} if hard and "hard_stop" in inspect.signature(self.manager.stop).parameters else {}
        self.manager.stop(block=True, **kw)

    def run(self, trace, limit=None) -> list[list[float]]:
        if self._stale:  # a fresh manager: the cut one may still hold cancelled requests, and after a failure
            # (e.g. CUDA out of memory in its generation loop) it fails every request. The old one's memory
            # (its KV cache, its CUDA graphs' pools) goes first, or the new one finds none to size its cache.
            self.close(hard=True)
            self.manager = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._start()
        times, cut, self.failed = _run_transformers(self.manager, trace, limit)
        self._stale = cut or bool(self.failed)
        return times


def _run_transformers(manager, trace, limit=None) -> tuple[list[list[float]], bool, dict[int, str]]:
    """Token timestamps per request, whether the run was cut at `limit`, and the requests that
    transformers returned failed (their `error`; a failure in its generation loop fails them all)."""
    stamps = "record_timestamps" in inspect.signature(manager.add_request).parameters
    tag = f"{time.monotonic_ns():x}"  # request ids unique across the traces one manager serves
    times: list[list[float]] = [[] for _ in trace]
    index, sent, done = {}, 0, 0
    t0 = time.perf_counter()
    finished: set[int] = set()
    failed: dict[int, str] = {}
    while done < len(trace):
        now = time.perf_counter() - t0
        if limit is not None and now >= limit:
            for rid, i in index.items():
                if i not in finished and hasattr(manager, "cancel_request"):
                    manager.cancel_request(rid)
            return _window(times, limit), True, failed
        for i in _due(trace, sent, now):
            r = trace[i]
            kw = {"record_timestamps": True} if stamps else {}
            if not stamps or limit is not None:  # results as tokens come: a cut counts unfinished ones' too
                kw["streaming"] = True
            rid = manager.add_request(r["prompt"], request_id=f"{tag}-{i}", max_new_tokens=r["new"], **kw)
            index[rid or f"{tag}-{i}"] = i
            sent = i + 1
        res = manager.get_result(timeout=0.005)
        if res is None:
            continue
        i = index[res.request_id]
        if stamps and res.timestamps is not None:
            times[i] = [s - t0 for s in res.timestamps]
        else:
            times[i] += [time.perf_counter() - t0] * (len(res.generated_tokens) - len(times[i]))
        if res.is_finished():
            finished.add(i)
            done += 1
            if getattr(res, "error", None):
                failed[i] = str(res.error)
    return times, False, failed


def metrics(trace, times, limit=None) -> dict:
    """Throughput over the run (to its last token, or to the cut at `limit` s), TTFT / TPOT
    percentiles of the requests that got tokens, and tokens per 1 s bin."""
    ttft = [ts[0] - r["arrival"] for r, ts in zip(trace, times, strict=True) if ts]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1]
    end = limit if limit is not None else max(t for ts in times for t in ts)
    total = sum(len(ts) for ts in times)

    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0] if xs else float("nan")

    bins = [0] * (int(end) + 1)
    for ts in times:
        for t in ts:
            bins[int(t)] += 1
    return {"output_tokens": total, "seconds": end, "tokens_per_s": total / end,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_ms": 1e3 * pct(tpot, 50),
            "tpot_p99_ms": 1e3 * pct(tpot, 99), "tokens_per_s_per_second": bins,
            "complete": all(len(ts) == r["new"] for r, ts in zip(trace, times, strict=True)),
            "finished_requests": sum(len(ts) == r["new"] for r, ts in zip(trace, times, strict=True)),
            "started_requests": len(ttft), "cut_at_s": limit}


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    patterns = sorted({r["pattern"] for r in rows})
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 4), squeeze=False)
    for ax, pat in zip(axes[0], patterns, strict=True):
        for r in rows:
            if r["pattern"] == pat:
                ax.plot(r["tokens_per_s_per_second"], label=f"{r['engine']} ({r['tokens_per_s']:.0f} tok/s)")
        ax.set_title(f"{pat} arrivals")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_png(fig, path / "hf_serve.png")
    plt.close(fig)


def _fields(text: str) -> dict:
    """"a=1,b=true,c=x" -> {"a": 1, "b": True, "c": "x"} (ints, floats, true/false/none, else strings)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {item!r}")
        low = raw.strip().lower()
        value = {"true": True, "false": False, "none": None}.get(low, raw.strip())
        if isinstance(value, str):
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
        out[key.strip()] = value
    return out


def result_row(engine: str, pattern: str, trace, times, limit, failed: dict[int, str]) -> dict:
    """One run's row: its metrics, and where requests failed, how many and the first error (its
    throughput is then not a result)."""
    row = {"engine": engine, "pattern": pattern, **metrics(trace, times, limit)}
    if failed:
        row.update(failed_requests=len(failed), error=next(iter(failed.values())))
    return row


def table(rows: list[dict]) -> list[str]:
    """The markdown table of the rows; a row with failed requests shows that, and its error, instead
    of a throughput."""
    lines = ["| engine | arrivals | output tokens/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | requests started / "
             "finished | complete |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = f"failed: {r['failed_requests']} requests" if r.get("failed_requests") else f"{r['tokens_per_s']:.1f}"
        lines.append(f"| {r['engine']} | {r['pattern']} | {tps} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                     f"{r['started_requests']} / {r['finished_requests']} | {r['complete']} |")
    return lines + [f"\n{r['engine']} {r['pattern']} failed: {r['error'][:300]}" for r in rows
                    if r.get("failed_requests")]


def main(argv=None):
    from .hf_step import TINY, add_model_args, build_model, run_meta  # the same random Llama

    ap = argparse.ArgumentParser(prog="python -m splitkv bench hf-serve",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out", required=True, help="JSON path (markdown goes next to it as .md)")
    ap.add_argument("--plot", help="directory for hf_serve.png (tokens/s over time)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--engines", default="splitkv,transformers")
    ap.add_argument("--patterns", default="burst,poisson")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-range", default="1024:32768")
    ap.add_argument("--output-range", default="64:512")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--num-pages", type=int, default=6144, help="splitkv's KV pool (pages of --page-size tokens)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--no-graph", dest="cuda_graph", action="store_false", help="splitkv without CUDA graphs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="cut each run this many seconds after its first arrival (module docstring)")
    add_model_args(ap, ("bfloat16", "float16", "float32"))
    ap.add_argument("--tf-cb", type=_fields, default={}, metavar="FIELD=VALUE,...",
                    help="transformers' ContinuousBatchingConfig (default: its defaults), e.g. "
                         "use_cuda_graph=true,max_batch_tokens=8192")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke settings (2 layers, fp32, 6 short requests)")
    a = ap.parse_args(argv)
    if a.tf_cb:
        import dataclasses

        import transformers

        known = {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}
        if unknown := sorted(set(a.tf_cb) - known):
            ap.error(f"--tf-cb: {', '.join(unknown)} is not a field of transformers.ContinuousBatchingConfig")
    if a.tiny:
        vars(a).update(TINY)
        a.requests, a.prompt_range, a.output_range, a.rate, a.num_pages, a.page_size = 6, "16:64", "4:12", 20.0, 64, 16
        a.dtype = "float32"
    a.prompt_range = tuple(int(x) for x in a.prompt_range.split(":"))
    a.output_range = tuple(int(x) for x in a.output_range.split(":"))
    a.contexts, a.steps, a.warmup = [a.prompt_range[1] + a.output_range[1]], 0, 0  # for build_model
    device = torch.device(a.device)
    model = build_model(a, device)
    servers = {"splitkv": SplitkvServer, "transformers": TransformersServer}
    rows = []
    for engine in a.engines.split(","):
        server = servers[engine](model, a)
        warm = argparse.Namespace(**{**vars(a), "requests": 8, "prompt_range": (8, 64), "output_range": (4, 8)})
        server.run(make_trace(warm, a.vocab, "burst"))
        for pattern in a.patterns.split(","):
            trace = make_trace(a, a.vocab, pattern)
            times = server.run(trace, a.time_limit)
            rows.append(result_row(engine, pattern, trace, times, a.time_limit, server.failed))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens_per_s_per_second"}), flush=True)
        server.close()
        del server
    meta = run_meta(device, "hf-serve", argv)
    config = {k: getattr(a, k) for k in ("requests", "prompt_range", "output_range", "rate", "num_pages", "page_size",
                                         "prefill_chunk", "cuda_graph", "time_limit", "layers", "hidden", "vocab",
                                         "dtype", "tf_cb")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": "splitkv.hf_serve/1", "meta": meta, "config": config, "rows": rows}, indent=1))
    lines = [f"# Continuous batching: splitkv Engine vs transformers ({meta['device']})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}", "",
             "Config: " + ", ".join(f"{k} {v}" for k, v in config.items()) + ".", ""]
    lines += table(rows)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if a.plot:
        Path(a.plot).mkdir(parents=True, exist_ok=True)
        plot(Path(a.plot), rows)
    print(f"wrote {out} and {out.with_suffix('.md')}")
