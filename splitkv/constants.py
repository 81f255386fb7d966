"""Names and numbers every layer shares (one definition each)."""

import math

BACKENDS = ("torch", "triton", "cutlass")  # the implementations; `auto` picks one of them
BACKEND_CHOICES = ("auto",) + BACKENDS  # what `backend=` accepts

HEAD_DIMS = (64, 128, 256)  # the head dims the CuTe DSL kernels are built for (prebuilt by `compile`)
HEAD_DIM_RANGE = (32, 256)  # torch and triton take every multiple of 8 in this range
LOW_DTYPE_NAMES = ("float16", "bfloat16")  # the GPU backends' input dtypes, as torch names them

UNBOUNDED = 1 << 30  # a key count or window reach past any cache: "no bound" (kernels take it as an int)

LOG2E = math.log2(math.e)  # kernels run the softmax in base 2: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # and turn a base-2 LSE back into natural log: lse = lse2 * LN2
