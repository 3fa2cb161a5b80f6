"""Reversible wrapping of one method of a vLLM class, for the plugin's hooks (`prefix_cache_guard` on the
scheduler's `__init__`, `piecewise` on the mode-3 backend's `__call__`).

`wrap_method(cls, name, make, mark)` replaces `cls.name` by `make(original)` (with the original's name and
docstring), marked with the attribute `mark` and keeping the original as `_uniprefill_original`; it does
nothing and returns False when the method already carries the mark (the plugin's `register()` may run more
than once in a process). `unwrap_method` puts the original back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def wrap_method(cls: Any, name: str, make: Callable[[Callable], Callable], mark: str) -> bool:
    original = getattr(cls, name)
    if getattr(original, mark, False):
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, mark, True)
    wrapper._uniprefill_original = original
    setattr(cls, name, wrapper)
    return True


def unwrap_method(cls: Any, name: str, mark: str) -> bool:
    current = getattr(cls, name)
    if not getattr(current, mark, False):
        return False
    setattr(cls, name, current._uniprefill_original)
    return True
