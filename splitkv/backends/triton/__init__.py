"""Triton backend: split kernel + combine kernel (portable path; runs under TRITON_INTERPRET=1)."""

from .launch import combine, run

__all__ = ["run", "combine"]
