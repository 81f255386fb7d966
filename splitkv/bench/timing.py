"""Timers: eager (L2 flushed) and CUDA-graph replay (launch gaps removed). Times in microseconds.

Eager follows triton.testing.do_bench's method, with the repetition count capped explicitly: a
256 MB memset evicts the L2 before every repetition, CUDA events bracket only the call, and the
median is reported. The memset leaves the L2 full of dirty lines, whose write-back to HBM the timed
call pays for (about L2 size / bandwidth; 7-14 us measured on an H100, every provider alike,
benchmarks/results/2026-12-06-h100-flush); flush="read" evicts with a read of the buffer instead,
leaving clean lines, which isolates the call's own time. The count adapts so one measurement takes about TARGET_MS (at least
MIN_REPS, at most EAGER_CAP_FACTOR x the caller's cap). On a CPU the same loop runs with perf_counter and no flush.

Graph: N calls are captured in one CUDA graph (on the stream that ran the warm-up calls), cycling
over rotating tensor sets whose total size exceeds the L2 several times (inputs.ROTATION_BYTES),
so each call reads cold K/V without a flush;
the graph is replayed and timed with CUDA events; per call = median replay time / N.

Host: the CPU cost of issuing one call, as `bench --host-breakdown` measures it: N calls back to
back without synchronising (the GPU queue absorbs their work), wall time of the loop / N, median of
HOST_LOOPS loops. A call that synchronises internally (e.g. reads lengths on the host) shows up
here as its full latency: that is what the caller's thread pays.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..cli_args import FLUSHES  # how time_eager evicts the L2: do_bench's memset, or a read

L2_FLUSH_BYTES = 256 * 2**20  # do_bench's cache-clearing buffer: 5x the H200's 50 MB L2
TARGET_MS = 30.0  # time one measurement aims for; keeps the default suite within ~4 minutes
MIN_REPS = 3
# Eager repetitions may run to this many times the caller's cap (TARGET_MS still bounds them): a
# small shape's call plus its flush takes ~0.1 ms, so 20 repetitions left its median ~0.5 us noisy
# on 15-18 us rows (H200, 2026-12-04: B=1 GQA 32/8 4K no plan 16.6 us in one run, 15.3 at 200 reps).
EAGER_CAP_FACTOR = 10
MIN_GRAPH_CALLS = 4  # calls per graph when one rotation set alone exceeds ROTATION_BYTES
HOST_TARGET_MS = 20.0  # wall time one host loop aims for
HOST_MIN_CALLS = 10
# Queued calls are capped: past ~1000 pending kernel launches the CUDA queue blocks the host, and
# the loop would measure GPU time instead of launch cost (a call is 1-4 launches here).
HOST_MAX_CALLS = 100
HOST_LOOPS = 3

_FLUSH: dict[int | None, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = device.index
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return _FLUSH[key]


def _reps(est_ms: float, cap: int) -> int:
    n = int(TARGET_MS / max(est_ms, 1e-3))
    return max(min(n, cap), min(MIN_REPS, cap), 1)


def _flusher(device: torch.device, flush: str):
    cache = _flush_buffer(device)
    return cache.zero_ if flush == "write" else (lambda: torch.amax(cache))


def time_eager(fn, device: torch.device, reps: int, flush: str = "write") -> tuple[float, int]:
    """(median us, repetitions) of fn() with the L2 flushed before each call (flush: FLUSHES, see the
    module docstring); at most EAGER_CAP_FACTOR x reps repetitions."""
    if flush not in FLUSHES:
        raise ValueError(f"flush: expected one of {FLUSHES}, got {flush!r}")
    reps *= EAGER_CAP_FACTOR
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        n = _reps((time.perf_counter() - t0) * 1e3, reps)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times), n
    evict = _flusher(device, flush)
    fn()
    torch.cuda.synchronize(device)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(2):
        evict()
        fn()
    t1.record()
    torch.cuda.synchronize(device)
    n = _reps(t0.elapsed_time(t1) / 2, reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        evict()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3, n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_host(fn, device: torch.device, calls: int | None = None, loops: int = HOST_LOOPS) -> tuple[float, int]:
    """(median host us per call, calls per loop): wall time of `calls` back-to-back fn() without a
    synchronisation in between, / calls. The queue is drained (synchronised) before each loop and
    after the last one, outside the timed region. calls=None: sized so one loop takes about
    HOST_TARGET_MS, within [HOST_MIN_CALLS, HOST_MAX_CALLS] (on a CPU, where the call is the
    work, at least 2)."""
    fn()
    _sync(device)
    if calls is None:
        t0 = time.perf_counter()
        fn()
        fn()
        est_ms = (time.perf_counter() - t0) / 2 * 1e3
        _sync(device)
        lo = HOST_MIN_CALLS if device.type == "cuda" else 2
        calls = max(lo, min(HOST_MAX_CALLS, int(HOST_TARGET_MS / max(est_ms, 1e-3))))
    samples = []
    for _ in range(max(loops, 1)):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    _sync(device)
    return statistics.median(samples), calls


def graph_calls(rotation: int) -> int:
    """Calls per graph: every rotation set at least once, and at least MIN_GRAPH_CALLS."""
    per = -(-MIN_GRAPH_CALLS // rotation)
    return rotation * per


def time_graph(fns, device: torch.device, reps: int):
    """(median us per call, calls per graph, replays, output of the first captured call) of a CUDA
    graph of calls over fns (one per rotation set). The output lives in the graph's memory pool and
    holds the result of the last replay (the caller checks it). Raises if capture fails."""
    calls = graph_calls(len(fns))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    # warm-up on a side stream, as torch.cuda.graph requires, and capture on that same stream: a
    # plain splitkv.decode (no plan) keeps one plan per stream, made by a call outside capture
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side):
            first = fns[0]()
            for i in range(1, calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize(device)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        torch.cuda.synchronize(device)
        n = _reps(t0.elapsed_time(t1), reps)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize(device)
        per_replay = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        return per_replay * 1e3 / calls, calls, n, first
    finally:
        del graph
