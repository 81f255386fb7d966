"""splitkv.bench: the decode benchmark suite (`python -m splitkv bench`, entry point cli.main).

Modules: shapes (suites, byte model), inputs (tensors, rotation), providers / external / registry
(splitkv backends and peers), check (error vs the fp64 reference), timing (eager, host and
CUDA-graph timers), runner (the loop), sweep (num_splits report card), report (table, JSON, markdown), plots.

Row schema (JSON "rows"; one row per shape x dtype x provider; null where not measured):

  shape            str    suite shape name (reproduce with --shapes NAME)
  provider         str    splitkv-<backend> (plan reused: eager and graph rows),
                          splitkv-<backend>-noplan (decode(q, k, v, lens) with no plan, eager and
                          captured as it is), sdpa-flash, sdpa-cudnn, sdpa-efficient, flashinfer,
                          flash-attn2, flash-attn3, flex
  kind             str    "splitkv" or "peer"
  status           str    "ok"; "n/a" (the provider cannot take this layout/shape: not emulated);
                          "error" (it raised; the message is in note)
  note             str    how the provider was called, why n/a, graph-capture failures, NaN output
  dtype            str    "bf16" or "fp16"
  batch, num_q_heads, num_kv_heads, head_dim, q_len      int   the problem (q_len = Sq)
  causal           bool   bottom-right causal (only matters for q_len > 1)
  page_size        int    keys per page for paged rows; null for a contiguous cache
  seqlen_max       int    longest request (keys)
  seqlen_total     int    keys summed over the batch
  bytes            int    byte model: K + V of valid positions + q + o (shapes.byte_model), bytes
  eager_us         float  median µs per call, L2 flushed before each repetition (do_bench method);
                          splitkv-<backend> plans once outside the timed region (plan reuse across
                          layers), splitkv-<backend>-noplan plans inside every call
  eager_reps       int    repetitions behind eager_us
  graph_us         float  µs per call under CUDA-graph replay (graph_calls calls over rotating
                          buffers > 256 MB, median of graph_replays replays); null on CPU, with
                          --no-graph, or when capture failed (see note)
  graph_calls      int    calls captured in one graph
  graph_replays    int    replays behind graph_us
  graph_captures_us  list  µs per call of each fresh capture (graph_us is the least)
  host_us          float  host (CPU) µs per call: host_calls calls issued back to back without
                          synchronising, wall time / host_calls, median of 3 loops (what
                          bench --host-breakdown measures); a call that syncs internally pays
                          its GPU time here too; null with --no-host
  host_calls       int    calls per host loop
  eager_tbps, graph_tbps          float  bytes / time, TB/s (1e12 B/s)
  eager_pct_sol, graph_pct_sol    float  TB/s as % of meta.sol_tbps: the spec bandwidth of the GPU used
                          (report.DEVICE_SOL_TBPS: 4.8 TB/s on H200) or --sol-tbps; null when
                          there is none (a CPU, an unlisted GPU)
  eager_vs_best_peer, graph_vs_best_peer   float  best peer's µs / this row's µs (same shape,
                          dtype and mode; > 1 = faster than the best peer; 1.0 for that peer)
  best_peer_eager, best_peer_graph         str    which peer was the best
  max_abs_err      float  max |o - o_ref| vs splitkv.reference.decode_reference in fp64 (every
                          provider is checked); null when the output had NaN (note says so)
  rel_err          float  max_abs_err / max |o_ref|
  graph_max_abs_err, graph_rel_err   float  the same for the output of the first call captured in the
                          graph, after the timed replays (checks the graph-safe path)
  err_scope        str    "all", or the requests x KV heads the reference covered (big shapes)
  plan             str    DecodePlan.describe() of a splitkv eager row (--explain prints it)
  graph_plan       str    the graph-safe plan used under graph replay
  cmd              str    command that reproduces the row

JSON document: {"schema": "splitkv.bench/1", "meta": {date, device, num_sms, driver, cuda, cudnn,
python, torch, triton, cutlass, flashinfer, flash_attn, splitkv, git_commit, sol_tbps (null: none), command,
timing, byte_model, suite, reps, graph, host, num_splits[, incomplete: why the run stopped early, the rows
measured until then kept]}, "skipped_providers": [{provider, reason}],
"rows": [...], "sweep": [{shape, mode, backend, dtype, planner_splits, planner_us, planner_plan,
best_splits, best_num_splits, best_us, regret_pct (%), curve: [{num_splits, splits, us}], cmd}]}.
"""

__all__ = ["main", "byte_model"]


def __getattr__(name: str):
    """Lazy, so that `splitkv.bench.shapes` (the shape tables, no torch) imports alone."""
    if name == "main":
        from .cli import main

        return main
    if name == "byte_model":
        from .shapes import byte_model

        return byte_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
