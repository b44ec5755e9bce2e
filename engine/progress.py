"""A dependency-free progress bar on stderr, for loads, conversions and graph capture."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "loading") as p: p.update(n)``. Silent when ``enabled`` is False."""

    def __init__(self, total: float, desc: str, unit: str = "", enabled: bool = True,
                 scale: float = 1.0) -> None:
        self.total = max(float(total), 1e-9)
        self.desc, self.unit, self.scale = desc, unit, scale
        self.enabled = enabled
        self.done = 0.0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def update(self, n: float = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        el = now - self.t0
        d, t = self.done / self.scale, self.total / self.scale
        sys.stderr.write(f"\r{self.desc} [{bar:<30}] {frac * 100:5.1f}% {d:.1f}/{t:.1f}{self.unit}"
                         f" {el:.1f}s")
        sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.done = max(self.done, self.total) if exc[0] is None else self.done
            self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
