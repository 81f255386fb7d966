"""splitkv: split-KV (flash-decoding) attention for long-context LLM decoding on PyTorch."""

from . import debug, reference
from .api import decode
from .cache import CacheFullError, PagedKVCache
from .cascade import cascade_decode
from .execute import clear_plans
from .merge import merge_states, merge_states_n
from .plan import DecodePlan, plan
from .rope import RopeConfig, apply_rope
from .warmup import warmup

__version__ = "0.1.0"
__all__ = [
    "decode", "plan", "DecodePlan", "merge_states", "merge_states_n", "cascade_decode",
    "PagedKVCache", "CacheFullError", "clear_plans", "RopeConfig", "apply_rope", "reference", "debug", "warmup",
    "__version__",
]
