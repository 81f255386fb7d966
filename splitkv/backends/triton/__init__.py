"""Triton backend: split kernel + combine kernel (portable path; runs under TRITON_INTERPRET=1)."""

from .launch import bind, combine, run

__all__ = ["run", "bind", "combine"]
