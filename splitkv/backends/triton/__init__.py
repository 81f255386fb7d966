"""Triton backend: split kernel + merge kernel (portable path; runs under TRITON_INTERPRET=1)."""

from .launch import bind, extend, merge, run

__all__ = ["run", "bind", "merge", "extend"]
