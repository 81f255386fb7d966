#!/usr/bin/env bash
# One H200 call: GPU tests, demo, benchmarks; everything lands under $OUT.
#   run: [".whl"] carried;  command: bash benchmarks/gpu_run.sh [tests|sanitizer|demo|bench|host|tune|variants|hf|serve|fp8|all ...]
#   BENCH_ARGS overrides the bench's suite/providers (default: $BENCH_DEFAULT below); GPU_CARD=H200: only on that card
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# GPU_CARD=H200: run nothing unless the card's name holds that text (a lent machine may be another
# card than the one asked for, and numbers meant for the H200 are wasted device time on it)
if [[ -n "${GPU_CARD:-}" ]]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [[ "$card" != *"$GPU_CARD"* ]]; then echo "GPU_CARD=$GPU_CARD: this card is '$card', nothing run"; exit 0; fi
fi
[ -f .whl/env.sh ] && . .whl/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
what=${*:-all}
has() { [[ " $what " == *" $1 "* || " $what " == *" all "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)";
  python -c "import cutlass;print('cutlass-dsl ok')" 2>&1 | tail -1; date -u; } | tee "$OUT/env.txt"
if has tests; then  # GPU_TEST_JOBS=n (default 12): n pytest processes over contiguous slices (tests/conftest.py),
  # compiling at once (compiles are CPU-bound: on 16 cores, 14 processes ran 109 items in 36 s with warm caches, where 4
  # outlasted a 575 s call cold); GPU_TEST_SHARDS="0 1": only those slices; each process stops at GPU_TEST_TIMEOUT s
  # (default 480), so the summary below is written even when a slice runs out of time. The compute-sanitizer tests
  # (minutes each) run only in "sanitizer" or when GPU_TEST_PATHS names them.
  jobs=${GPU_TEST_JOBS:-12}
  shards=${GPU_TEST_SHARDS:-$(seq 0 $((jobs - 1)))}
  sel=(-m gpu); [ -z "${GPU_TEST_PATHS:-}" ] && sel+=(-k "not sanitizer")
  for i in $shards; do
    SPLITKV_TEST_SHARD=$i/$jobs timeout "${GPU_TEST_TIMEOUT:-480}" python -m pytest "${sel[@]}" ${GPU_TEST_PATHS:-tests} \
      -v -rfEs -p no:cacheprovider --durations=5 >"$OUT/gpu_tests_$i.log" 2>&1 &
  done
  wait
  # one summary: items per test and outcome, each slice's last line, failures (the per-slice logs go into the archive)
  { cat "$OUT"/gpu_tests_*.log | grep -oE "^tests/[^[ ]+(\[.*\])? (PASSED|FAILED|ERROR|SKIPPED)" \
      | sed -E 's/\[.*\]//' | sort | uniq -c
    for i in $shards; do echo "slice $i/$jobs: $(tail -1 "$OUT/gpu_tests_$i.log")"; done
    grep -hE "^(FAILED|ERROR) " "$OUT"/gpu_tests_*.log; } | tee "$OUT/gpu_tests.log"
fi
if [[ " $what " == *" sanitizer "* ]]; then  # not in "all": compute-sanitizer over every CuTe config (tests/test_sanitizer.py):
  # every kernel into the disk cache first (parallel compiles), then one process per (tool, part) side by side;
  # SANITIZER_TOOLS="memcheck" / SANITIZER_PARTS="fp16 work_list" pick some (parts: fp16 bf16 fp8 merge work_list)
  python -c "import sys; sys.path[:0] = ['tests']; import test_sanitizer as t; print('compiled', t.fill_disk_cache(t.configs()))" \
    2>&1 | tail -2 | tee "$OUT/sanitizer_compile.log"
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    for part in ${SANITIZER_PARTS:-fp16 bf16 fp8 merge work_list}; do
      timeout "${GPU_TEST_TIMEOUT:-560}" python -m pytest -m gpu tests/test_sanitizer.py -k "$tool and $part" -v -rfEsP \
        -p no:cacheprovider --durations=3 >"$OUT/sanitizer_${tool}_$part.log" 2>&1 &
    done
  done
  wait
  grep -hE "^tests/.*(PASSED|FAILED|ERROR|SKIPPED)|^ok |passed|failed" "$OUT"/sanitizer_*_*.log | tee "$OUT/sanitizer.log"
fi
if has demo; then python -m splitkv demo ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log"; fi  # DEMO_ARGS=--tf-compile
# tile sweep: each backend's planner tile vs forced (block_n x warps x stages) tiles, graph replay,
# on split shapes (B=1 GQA 4K / 32K) and unsplit ones (B=16 MHA 4K / 32K, B=64 GQA 32K, paged 16)
TUNE_DEFAULT="b1-l4k-h32x8-d128,b1-l32k-h32x8-d128,b16-l4k-h32x32-d128,b16-l32k-h32x32-d128,b64-l32k-h32x8-d128,b16-l32k-h32x32-d128-paged16"
if has tune; then
  python -m splitkv bench --suite headline --providers splitkv-triton,splitkv-cutlass --sweep-tiles ${TILES:-} \
    --sweep-only --sweep-shapes "${TUNE_SHAPES:-$TUNE_DEFAULT}" --reps ${TUNE_REPS:-10} \
    --json "$OUT/tiles.json" --markdown "$OUT/tiles.md" 2>&1 | tee "$OUT/tune.log" | tail -40
fi
# default bench: every PEERS.md shape + the ragged B=16 1K..128K paged batch; splitkv as a user calls it
# (no plan, eager), with a reused plan (eager) and under CUDA-graph replay, next to the peers, in one run
BENCH_DEFAULT="--suite headline --providers splitkv-auto-noplan,splitkv-auto,sdpa-cudnn,sdpa-flash,flashinfer"
if has bench; then
  python -m splitkv bench ${BENCH_ARGS:-$BENCH_DEFAULT} --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
if has host; then
  python -m splitkv bench --host-breakdown --json "$OUT/host.json" --markdown "$OUT/host.md" 2>&1 | tee "$OUT/host.log" | tail -40
fi
if has variants; then  # attention variants and head dims next to plain decode and FlashInfer
  python -m splitkv bench --suite variants --providers splitkv-auto-noplan,splitkv-auto,splitkv-triton,splitkv-cutlass,flashinfer \
    --json "$OUT/variants.json" --markdown "$OUT/variants.md" 2>&1 | tee "$OUT/variants.log" | tail -60
fi
if [[ " $what " == *" fp8 "* ]]; then  # not in "all": fp8 KV (auto, and each GPU backend) next to bf16 and
  # FlashInfer; FP8_SWEEP=1 adds the split-count sweep of the B=16 fp8 rows (heuristics.blocks_per_sm);
  # FP8_ARGS adds flags, e.g. FP8_ARGS="--flush read" (eager timing without the memset's write-back)
  python -m splitkv bench --suite fp8 --providers splitkv-auto,splitkv-triton,splitkv-cutlass,flashinfer --no-host \
    --reps 10 ${FP8_ARGS:-} --json "$OUT/fp8.json" --markdown "$OUT/fp8.md" 2>&1 | tee "$OUT/fp8.log" | tail -30
  if [ "${FP8_SWEEP:-0}" = 1 ]; then
    python -m splitkv bench --suite fp8 --providers splitkv-triton --num-splits sweep --sweep-range 1:6 --sweep-only \
      --sweep-shapes "${FP8_SWEEP_SHAPES:-b16-*-fp8e4m3}" --reps 10 --json "$OUT/fp8_splits.json" \
      --markdown "$OUT/fp8_splits.md" 2>&1 | tee "$OUT/fp8_splits.log" | tail -20
  fi
fi
# not in "all": the full 256-request trace runs for many minutes; cut every run at one window, e.g.
# SERVE_ARGS="--patterns burst --time-limit 200" (both engines, one pattern per call)
if [[ " $what " == *" serve "* ]]; then
  python -m splitkv bench hf-serve --out "$OUT/hf_serve.json" --plot "$OUT" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve.log" | tail -8; fi
if has hf; then python -m splitkv bench hf-step --out "$OUT/hf_step.json" ${HF_ARGS:-} 2>&1 | tee "$OUT/hf.log" | tail -45; fi
# at most 8 files come back: up to 7 results (the JSON files, then bench.md) stay as they are,
# everything else (logs, plots, env.txt) goes into one archive
(cd "$OUT" && keep=$(mktemp -d) && n=0
 for f in *.json bench.md; do
   if [ -f "$f" ] && [ "$n" -lt 7 ]; then mv "$f" "$keep/" && n=$((n + 1)); fi
 done
 tar czf /tmp/logs_and_plots.tgz . && find . -mindepth 1 -delete && mv /tmp/logs_and_plots.tgz .
 mv "$keep"/* . 2>/dev/null; rmdir "$keep")
