"""The model benchmarks' CPU smoke runs (python -m splitkv bench hf-step / hf-serve --tiny):
they run end to end and write what their results READMEs read. Skips without transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _run(command, tmp_path, *args):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "splitkv", "bench", command, "--out", str(out), "--device", "cpu",
                    "--tiny", *args], check=True, cwd=ROOT, capture_output=True, timeout=600)
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_hf_step_smoke(tmp_path):
    doc, md = _run("hf-step", tmp_path, "--providers", "splitkv-eager,transformers-sdpa-dynamic")
    assert {(r["provider"], r["batch"]) for r in doc["rows"]} == {(p, b) for p in ("splitkv-eager",
                                                                                     "transformers-sdpa-dynamic")
                                                                  for b in (1, 2)}
    assert all(r["ms_per_step"] > 0 and r["x_floor"] > 0 for r in doc["rows"])
    # the first step (plans made; on a GPU the graph captured) is timed apart, for splitkv rows only
    assert all((r["first_step_ms"] > 0) == r["provider"].startswith("splitkv") for r in doc["rows"]
               if "first_step_ms" in r)
    assert all("first_step_ms" in r for r in doc["rows"] if r["provider"].startswith("splitkv"))
    assert "| 1 | 256 | splitkv-eager |" in md and md.count("| — |") >= 2  # transformers rows: no first step
    assert doc["meta"]["command"].startswith("python -m splitkv bench hf-step --out")


def test_hf_serve_smoke(tmp_path):
    doc, md = _run("hf-serve", tmp_path, "--patterns", "burst,poisson", "--plot", str(tmp_path))
    rows = {(r["engine"], r["pattern"]): r for r in doc["rows"]}
    assert set(rows) == {(e, p) for e in ("splitkv", "transformers") for p in ("burst", "poisson")}
    for r in rows.values():  # every request got all its tokens; the metrics are there
        assert r["complete"] and r["output_tokens"] > 0 and r["ttft_p50_s"] >= 0 and r["tpot_p99_ms"] > 0
    assert (tmp_path / "hf_serve.png").stat().st_size > 0
    assert "| splitkv | burst |" in md


def test_hf_serve_passes_a_continuous_batching_config_to_transformers(tmp_path):
    doc, md = _run("hf-serve", tmp_path, "--engines", "transformers", "--patterns", "burst",
                   "--tf-cb", "max_batch_tokens=128,use_cuda_graph=false")
    assert doc["config"]["tf_cb"] == {"max_batch_tokens": 128, "use_cuda_graph": False}
    (row,) = doc["rows"]
    assert row["complete"] and row["output_tokens"] > 0
    bad = subprocess.run([sys.executable, "-m", "splitkv", "bench", "hf-serve", "--out", str(tmp_path / "x.json"),
                          "--device", "cpu", "--tiny", "--tf-cb", "max_batch_tokenz=128"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "max_batch_tokenz is not a field" in bad.stderr


def _tiny_model():
    import argparse

    from splitkv.bench import hf_step

    a = argparse.Namespace(**hf_step.TINY, dtype="float32", contexts=[512], steps=0, warmup=0)
    return hf_step.build_model(a, torch.device("cpu"))


def _trace_args(requests, new):
    import argparse

    return argparse.Namespace(seed=0, prompt_range=(16, 32), output_range=(new, new), requests=requests, rate=1.0,
                              num_pages=256, page_size=16, prefill_chunk=64, cuda_graph=False, tf_cb={})


def test_hf_serve_cut_cancels_splitkv_requests_at_the_limit(monkeypatch):
    """--time-limit on splitkv's side, on a fake clock (one second per reading): the run stops at the
    limit, its tokens stop there, the running requests are cancelled with every page back, and the
    engine serves the next trace to the end."""
    from splitkv.bench import hf_serve

    server = hf_serve.SplitkvServer(_tiny_model(), _trace_args(0, 0))
    clock = iter(range(10**6))
    monkeypatch.setattr(hf_serve.time, "perf_counter", lambda: float(next(clock)))
    trace = hf_serve.make_trace(_trace_args(5, 40), 256, "burst")
    times = server.run(trace, limit=30.0)
    m = hf_serve.metrics(trace, times, limit=30.0)
    assert 0 < m["output_tokens"] < 5 * 40 and not m["complete"] and m["cut_at_s"] == 30.0
    assert max(t for ts in times for t in ts) <= 30.0 and m["tokens_per_s"] == m["output_tokens"] / 30.0
    eng = server.eng
    assert not eng.pending and eng.cache.num_free_pages == eng.cache.num_pages
    again = hf_serve.make_trace(_trace_args(3, 4), 256, "burst")
    assert hf_serve.metrics(again, server.run(again))["complete"]


def test_hf_serve_cut_restarts_the_transformers_manager():
    """--time-limit on transformers' side (real clock), after a warm-up trace as the bench runs one:
    24 requests of 400 tokens do not finish in 1 s on the CPU; the cut row says so, and a fresh
    manager then serves a short trace to the end."""
    from splitkv.bench import hf_serve

    server = hf_serve.TransformersServer(_tiny_model(), _trace_args(0, 400))
    short = hf_serve.make_trace(_trace_args(3, 4), 256, "burst")
    try:
        assert hf_serve.metrics(short, server.run(short))["complete"]
        trace = hf_serve.make_trace(_trace_args(24, 400), 256, "burst")
        times = server.run(trace, limit=1.0)
        m = hf_serve.metrics(trace, times, limit=1.0)
        assert not m["complete"] and m["cut_at_s"] == 1.0 and m["finished_requests"] < 24
        assert all(t <= 1.0 for ts in times for t in ts)
        assert hf_serve.metrics(short, server.run(short))["complete"]
    finally:
        server.close(hard=True)


class _FakeManager:
    """transformers' manager as _run_transformers sees it: one token per get_result, round robin
    over the unfinished requests, timestamped on the (fake) clock; streaming results carry the
    timestamps so far."""

    def __init__(self, clock, fail_after=None):
        self.clock, self.reqs, self.cancelled, self.fail_after, self.results = clock, {}, [], fail_after, 0

    def add_request(self, prompt, request_id=None, max_new_tokens=1, streaming=False, record_timestamps=False):
        assert streaming and record_timestamps
        self.reqs[request_id] = [max_new_tokens, []]
        return request_id

    def get_result(self, timeout=None):
        import types

        live = [(rid, r) for rid, r in self.reqs.items() if len(r[1]) < r[0]]
        if not live:
            return None
        rid, (n, ts) = live[0]
        self.results += 1
        if self.fail_after is not None and self.results > self.fail_after:  # its loop died: every request fails
            r = self.reqs[rid]
            r[0] = len(ts)
            return types.SimpleNamespace(request_id=rid, timestamps=list(ts), generated_tokens=[0] * len(ts),
                                         is_finished=lambda: True, error="CUDA out of memory")
        ts.append(self.clock())
        return types.SimpleNamespace(request_id=rid, timestamps=list(ts), generated_tokens=[0] * len(ts),
                                     is_finished=lambda: len(ts) == n, error=None)

    def cancel_request(self, rid):
        self.cancelled.append(rid)


def test_hf_serve_cut_counts_the_tokens_of_unfinished_transformers_requests(monkeypatch):
    """With a cut, transformers' results stream, so a request still running at the cut counts the
    tokens it made inside the window; the unfinished ones are cancelled."""
    from splitkv.bench import hf_serve

    clock = iter(range(10**6))
    monkeypatch.setattr(hf_serve.time, "perf_counter", lambda: float(next(clock)))
    man = _FakeManager(hf_serve.time.perf_counter)
    trace = hf_serve.make_trace(_trace_args(3, 50), 256, "burst")
    times, cut, failed = hf_serve._run_transformers(man, trace, limit=40.0)
    assert cut and not failed and 0 < len(times[0]) < 50 and all(t <= 40.0 for ts in times for t in ts)
    assert len(man.cancelled) == 3  # none had finished


def test_hf_serve_reports_failed_transformers_requests(monkeypatch):
    """A failure in transformers' generation loop (CUDA out of memory) returns every request
    finished with an error: the run reports them failed, by trace index, instead of a throughput."""
    from splitkv.bench import hf_serve

    clock = iter(range(10**6))
    monkeypatch.setattr(hf_serve.time, "perf_counter", lambda: float(next(clock)))
    man = _FakeManager(hf_serve.time.perf_counter, fail_after=5)
    trace = hf_serve.make_trace(_trace_args(3, 50), 256, "burst")
    times, cut, failed = hf_serve._run_transformers(man, trace, limit=400.0)
    assert not cut and sorted(failed) == [0, 1, 2] and set(failed.values()) == {"CUDA out of memory"}
    assert sum(map(len, times)) == 5
    row = hf_serve.result_row("transformers", "burst", trace, times, 400.0, failed)
    assert row["failed_requests"] == 3 and row["error"] == "CUDA out of memory"
    ok = hf_serve.result_row("splitkv", "burst", trace, times, 400.0, {})
    assert "failed_requests" not in ok and "error" not in ok
    text = "\n".join(hf_serve.table([row, ok]))
    assert "| transformers | burst | failed: 3 requests |" in text and "burst failed: CUDA out of memory" in text
    assert f"| splitkv | burst | {row['tokens_per_s']:.1f} |" in text and "splitkv burst failed" not in text
