"""splitkv.warmup: compile ahead, at start-up, the kernels a model will use.

The first decode of each kernel variant compiles it: a CuTe DSL (cutlass) variant takes seconds
(reported ~20 s for D 256, Sq 16 on an H200), a Triton specialisation about 1-2 s. warmup() makes
those first calls itself, on tiny dummy tensors, through the public API only
(`splitkv.decode(..., num_splits=..., backend=...)`), so it stays right whatever the planner and
the backends become: for every combination of head dim x dtype x (Hq, Hkv) x Sq x cache layout x
backend it runs a decode that does not split (num_splits=1), one that splits in two (the fused
merge), one with MANY_SPLITS splits (more than any fused-merge limit: the separate merge
kernel) and one the planner splits itself (num_splits=None). Then the batches a server runs,
planned by decode itself: SERVING_BATCHES requests at a long context (LONG_KEYS), whose plans
stream chunks of 16K+ keys in grids they fill in full or in part (tiles of their own), and a
batch that fills the GPU on its own (more requests x KV heads than two per SM, FULL_BATCH_KEYS
each), streaming whole sequences in several waves (heuristics.WAVES_TILE). Their caches are views
of one key row (stride 0 along the sequence; paged: every table entry names one page), so a long
context costs no memory. Together these hit the kernels a model with those shapes launches,
whatever batch and split count the planner meets later. Compiled CuTe kernels also land in the
disk cache (SPLITKV_CACHE_DIR) and Triton's in its own (~/.triton/cache), so a later process loads
them instead of compiling.

On a CPU device (or without CUDA) there is nothing to compile: the same calls run on the torch
backend, cheaply, so the code path is exercised (and tested) anywhere.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from . import heuristics as H
from . import validate

# Split counts each combination decodes with: 1 = the unsplit tile; 2 = the split tile and the
# merge fused into the split kernel; MANY_SPLITS = past the fused merge's split limit, so the
# separate merge kernel compiles too (Triton fuses up to 8 splits today); None = the planner
# decides (its own code path, on the longest dummy length).
MANY_SPLITS = 16
SPLIT_COUNTS = (1, 2, MANY_SPLITS, None)
KEYS_PER_SPLIT = 256  # cache length per split of the dummy decodes (one chunk of the planner's minimum)
FULL_BATCH_KEYS = 2 * KEYS_PER_SPLIT  # the full batch's lengths: long enough for a plan that may split
LONG_KEYS = 131072  # the serving batches' context
SERVING_BATCHES = (2, 4, 8, 16)

_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def _seq(name: str, value, kind) -> tuple:
    """A single value or a sequence of them -> tuple; anything else names the argument."""
    if isinstance(value, kind):
        values = (value,)
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}: expected {kind.__name__} or a sequence of them, got {value!r}")
    else:
        values = tuple(value)
    if not values:
        raise ValueError(f"{name}: expected at least one value, got an empty sequence")
    return values


def _ints(name: str, value) -> tuple[int, ...]:
    values = _seq(name, value, int)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name}: expected ints, got {v!r}")
    return values


def _dtype(v) -> torch.dtype:
    if isinstance(v, torch.dtype) and v in _DTYPE_NAMES.values():
        return v
    if isinstance(v, str) and v.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[v.lower().removeprefix("torch.")]
    raise ValueError(f"dtypes: expected torch.float16 / torch.bfloat16 (float32: torch backend only) or their "
                     f"names, got {v!r}")


def check_args(head_dims, dtypes, num_q_heads, num_kv_heads, q_lens, paged, page_size, backends, on_cpu):
    """Validated, deduplicated tuples of every argument (ValueError naming the argument)."""
    head_dims = _ints("head_dims", head_dims)
    bad = [d for d in head_dims if not validate.head_dim_ok(d)]
    if bad:
        raise ValueError(f"head_dims: {bad[0]} not supported, expected entries {validate.HEAD_DIM_RULE}")
    if isinstance(dtypes, (torch.dtype, str)):
        dtypes = (dtypes,)
    dtypes = tuple(_dtype(v) for v in _seq("dtypes", dtypes, torch.dtype))
    hq, hkv = _ints("num_q_heads", num_q_heads), _ints("num_kv_heads", num_kv_heads)
    if len(hq) > 1 and len(hkv) > 1 and len(hq) != len(hkv):
        raise ValueError(f"num_kv_heads: {len(hkv)} values do not pair with num_q_heads' {len(hq)} "
                         "(give equal-length sequences, or one int for either)")
    n = max(len(hq), len(hkv))
    heads = tuple(zip(hq * n if len(hq) == 1 else hq, hkv * n if len(hkv) == 1 else hkv))
    for q_heads, kv_heads in heads:
        if q_heads < 1:
            raise ValueError(f"num_q_heads: expected positive ints, got {q_heads}")
        if kv_heads < 1:
            raise ValueError(f"num_kv_heads: expected positive ints, got {kv_heads}")
        if q_heads % kv_heads:
            raise ValueError(f"num_q_heads: {q_heads} must be a multiple of num_kv_heads {kv_heads}")
    q_lens = _ints("q_lens", q_lens)
    bad = [s for s in q_lens if not 1 <= s <= validate.MAX_Q_LEN]
    if bad:
        raise ValueError(f"q_lens: expected entries in 1..{validate.MAX_Q_LEN}, got {bad[0]}")
    paged = _seq("paged", paged, bool)
    if not all(isinstance(p, bool) for p in paged):
        raise ValueError(f"paged: expected bools (False = contiguous cache, True = paged), got {paged!r}")
    page_sizes = _ints("page_size", page_size)
    if any(p < 1 for p in page_sizes):
        raise ValueError(f"page_size: expected positive ints, got {page_sizes!r}")
    backends = _seq("backends", backends, str)
    bad = [b for b in backends if b not in validate.BACKENDS]
    if bad:
        raise ValueError(f"backends: expected entries in {validate.BACKENDS}, got {bad[0]!r}")
    if on_cpu:
        backends = ("torch",)  # nothing to compile: exercise the path on the torch backend
    elif torch.float32 in dtypes and any(b != "torch" for b in backends):
        raise ValueError("dtypes: float32 runs only on the torch backend; on CUDA warm float16 / bfloat16")
    uniq = lambda xs: tuple(dict.fromkeys(xs))
    return (uniq(head_dims), uniq(dtypes), uniq(heads), uniq(q_lens), uniq(paged), uniq(page_sizes),
            uniq(backends))


_VARIANT_KEYS = ("window_size", "softcap", "sinks", "alibi_slopes")


def _variants(variants) -> tuple[dict, ...]:
    variants = _seq("variants", variants, dict)  # one dict, or a sequence of them
    for var in variants:
        if not isinstance(var, dict) or set(var) - set(_VARIANT_KEYS):
            raise ValueError(f"variants: expected dicts with keys from {_VARIANT_KEYS}, got {var!r}")
    return tuple(variants)


def _describe_variant(var: dict) -> str:
    return ",".join(f"{k}={'yes' if v is True else v}" for k, v in var.items()) or "plain"


def _decodes(head_dim, dtype, heads, q_len, is_paged, page_size, backend, device, variant=None) -> None:
    """The dummy decodes of one combination (zero-filled inputs): batch 1, then a full batch."""
    from .api import decode
    from .plan import device_num_sms

    q_heads, kv_heads = heads
    kw = {k: (torch.zeros(q_heads, device=device) if v is True and k in ("sinks", "alibi_slopes") else v)
          for k, v in (variant or {}).items()}

    def inputs(batch: int, max_len: int, one_row: bool = False):
        """q and a zero cache of `max_len` keys per request; one_row: a view of a single key row
        (contiguous) or of a single page (paged), whatever max_len."""
        q = torch.zeros(batch, q_len, q_heads, head_dim, dtype=dtype, device=device)
        per = -(-max_len // page_size) if is_paged else 0
        if not is_paged:
            k = torch.zeros(batch, 1 if one_row else max_len, kv_heads, head_dim, dtype=dtype, device=device)
            return q, k.expand(batch, max_len, kv_heads, head_dim), None
        k = torch.zeros(1 if one_row else batch * per, page_size, kv_heads, head_dim, dtype=dtype, device=device)
        table = torch.zeros(batch, per, dtype=torch.int32, device=device) if one_row else \
            torch.arange(batch * per, dtype=torch.int32, device=device).view(batch, per)
        return q, k, table

    max_len = MANY_SPLITS * KEYS_PER_SPLIT
    q, k, block_table = inputs(1, max_len)
    for splits in SPLIT_COUNTS:
        keys = max_len if splits is None else max(2, splits) * KEYS_PER_SPLIT
        lens = torch.full((1,), keys, dtype=torch.int32, device=device)
        decode(q, k, k, lens, block_table=block_table, num_splits=splits, backend=backend, **kw)
    dev = torch.device(device)
    full = H.WAVES_MIN_CTAS_PER_SM * device_num_sms(dev) // kv_heads + 1  # several waves
    # on a CPU device nothing compiles: one short serving batch exercises the path
    serving = [(b, LONG_KEYS) for b in SERVING_BATCHES] if dev.type == "cuda" else [(SERVING_BATCHES[0], FULL_BATCH_KEYS)]
    for batch, keys in serving + [(full, FULL_BATCH_KEYS)]:
        q, k, block_table = inputs(batch, keys, one_row=True)
        lens = torch.full((batch,), keys, dtype=torch.int32, device=device)
        decode(q, k, k, lens, block_table=block_table, backend=backend, **kw)


def warmup(*, head_dims: int | Sequence[int] = (128,), dtypes: torch.dtype | Sequence[torch.dtype] = (torch.bfloat16,),
           num_q_heads: int | Sequence[int] = 32, num_kv_heads: int | Sequence[int] = 8,
           q_lens: int | Sequence[int] = (1,), paged: bool | Sequence[bool] = (False,),
           page_size: int | Sequence[int] = 16, backends: str | Sequence[str] = ("auto",),
           device: torch.device | str = "cuda", verbose: bool = False, variants: Sequence[dict] = ({},)) -> dict:
    """Compile ahead every kernel a model with these shapes will launch; returns a summary.

    Each argument takes one value or a sequence; every combination of head_dims x dtypes x
    (Hq, Hkv) heads x q_lens x paged x page_size (paged only) x backends x variants is warmed. num_q_heads
    and num_kv_heads pair up element-wise (an int pairs with every entry of the other):
    num_q_heads=(32, 64), num_kv_heads=8 warms (32, 8) and (64, 8). Use the backend(s) the model
    will call decode with ("auto" = what decode's auto picks on this GPU, cutlass for split plans
    on sm90 and Triton otherwise). On a CPU device, or without CUDA, the same calls run on the
    torch backend (nothing compiles).

    variants: the attention variants the model's calls pass, each a dict of decode's keywords
    (window_size, softcap, sinks, alibi_slopes); sinks / alibi_slopes may be True (a per-head
    dummy is made: the kernels depend on their presence, not their values). Default ({},): plain.
    A Gemma-2-like model: variants=({"softcap": 50.0}, {"softcap": 50.0, "window_size": (4095, -1)}).

    Returns {"device", "total_s", "combinations": [{"backend", "head_dim", "dtype", "num_q_heads",
    "num_kv_heads", "q_len", "paged", "page_size", "variant", "seconds"}, ...]}: seconds per combination, the
    first calls' compile time included (a combination whose kernels are already compiled or on
    disk takes far less).
    """
    dev = torch.device(device)
    on_cpu = dev.type != "cuda" or not torch.cuda.is_available()
    if on_cpu:
        dev = torch.device("cpu")
    head_dims, dtypes, heads, q_lens, paged, page_sizes, backends = check_args(
        head_dims, dtypes, num_q_heads, num_kv_heads, q_lens, paged, page_size, backends, on_cpu)
    variants = _variants(variants)
    combos = [(d, dt, h, s, p, ps if p else None, b, var)
              for d, dt, h, s, p, b, var in itertools.product(head_dims, dtypes, heads, q_lens, paged, backends,
                                                              variants)
              for ps in (page_sizes if p else (None,))]
    rows: list[dict] = []
    progress = _Progress(len(combos), dev) if verbose else None
    t_all = time.perf_counter()
    try:
        for d, dt, (hq, hkv), s, p, ps, b, var in combos:
            row = dict(backend=b, head_dim=d, dtype=str(dt).removeprefix("torch."), num_q_heads=hq,
                       num_kv_heads=hkv, q_len=s, paged=p, page_size=ps, variant=_describe_variant(var))
            if progress:
                progress.start(row)
            t0 = time.perf_counter()
            try:
                _decodes(d, dt, (hq, hkv), s, p, ps, b, dev, var)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as e:
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"splitkv.warmup: while warming {row}")
                raise
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
            if progress:
                progress.done(row)
    finally:
        if progress:
            progress.close()
    return {"device": str(dev), "total_s": round(time.perf_counter() - t_all, 3), "combinations": rows}


def describe(row: dict) -> str:
    layout = f"paged{row['page_size']}" if row["paged"] else "dense"
    return (f"{row['backend']} D{row['head_dim']} {row['dtype']} Hq/Hkv {row['num_q_heads']}/{row['num_kv_heads']} "
            f"Sq {row['q_len']} {layout} {row.get('variant', 'plain')}")


class _Progress:
    """verbose=True: a rich progress bar plus one line per finished combination."""

    def __init__(self, total: int, device):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]warmup[/] {task.description}"), BarColumn(),
                            TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                            console=self.console, transient=True)
        self.console.print(f"splitkv warmup: {total} combination(s) on {device}")
        self.task = self.bar.add_task("", total=total)
        self.bar.start()

    def start(self, row: dict) -> None:
        self.bar.update(self.task, description=describe(row))

    def done(self, row: dict) -> None:
        self.bar.console.print(f"  {describe(row):60s} {row['seconds']:8.2f} s")
        self.bar.advance(self.task)

    def close(self) -> None:
        self.bar.stop()
