"""splitkv: split-KV (flash-decoding) attention for long-context LLM decoding on PyTorch."""

from . import debug, reference
from .api import decode
from .plan import DecodePlan, plan

__version__ = "0.1.0"
__all__ = ["decode", "plan", "DecodePlan", "reference", "debug", "__version__"]
