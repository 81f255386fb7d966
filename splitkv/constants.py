"""Names and numbers every layer shares (one definition each)."""

import math

BACKENDS = ("torch", "triton", "cutlass")  # the implementations; `auto` picks one of them
BACKEND_CHOICES = ("auto",) + BACKENDS  # what `backend=` accepts

HEAD_DIMS = (64, 80, 96, 128, 192, 256)  # the head dims the CuTe DSL kernels are built for (prebuilt by `compile`)
FP8_HEAD_DIMS = (128, 256)  # ... and those its fp8-cache kernels take (others: Triton)
SMEM_COLS = 64  # the CuTe kernels hold D in 64-column swizzled smem atoms: 80 and 96 run padded to 128


def padded_head_dim(head_dim: int) -> int:
    """The head dim the CuTe split kernel computes on (smem tiles, MMA): D rounded up to SMEM_COLS;
    the padding columns are zeros in shared memory and never read from or written to global memory."""
    return -(-head_dim // SMEM_COLS) * SMEM_COLS
HEAD_DIM_RANGE = (32, 256)  # torch and triton take every multiple of 8 in this range
# Most query tokens per request (Sq, q_len) decode takes: Sq > 1 is speculative verify (causal
# drafts). The kernels pack group x Sq rows into m-tiles (heuristics.MAX_BLOCK_M), so this is not a
# kernel cap; it is the decode range the backends are tested over (Sq 1..16), longer blocks are prefill.
MAX_Q_LEN = 16
LOW_DTYPE_NAMES = ("float16", "bfloat16")  # the GPU backends' input dtypes, as torch names them

UNBOUNDED = 1 << 30  # a key count or window reach past any cache: "no bound" (kernels take it as an int)

LOG2E = math.log2(math.e)  # kernels run the softmax in base 2: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # and turn a base-2 LSE back into natural log: lse = lse2 * LN2
