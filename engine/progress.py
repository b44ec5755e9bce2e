"""Progress bars on stderr (tqdm) for loads, compiles and graph capture.

``progress(iterable_or_total, desc, enable)`` is a tqdm bar that draws only when asked and when
stderr is a terminal (tqdm's ``disable=None``): logs and pipes get no carriage-return lines.
Iterate it (an iterable) or ``update(n)`` it (a total); use it as a context manager to close it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(iterable_or_total: Iterable[T] | float | None = None, desc: str = "",
             enable: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar over an iterable, or over a total to ``update()`` towards. Silent when
    ``enable`` is False or stderr is not a terminal. ``kwargs`` go to tqdm (``unit="B",
    unit_scale=True`` for a byte count)."""
    if isinstance(iterable_or_total, int | float):
        kwargs["total"] = iterable_or_total
        iterable_or_total = None
    return tqdm(iterable_or_total, desc=desc, file=sys.stderr, disable=None if enable else True,
                dynamic_ncols=True, **kwargs)
