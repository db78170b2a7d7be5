"""Operator tools: `kvstore info`, `kvstore fsck`, `kvstore warmup`.

Each tool is a library function returning a JSON-able result (used by the CLI in
`kvstore/cli.py` and by the tests) plus a text formatter. Tools go through the engine
API (`DiskStore`, `RankIO`, `WriterLock`, `Index`), never around it: no raw LMDB access,
no hand-parsed slot files. Read-only tools (`info`, `fsck` without `--repair`) take no
lock, so they are safe next to running engines; `warmup` attaches as one more engine; a
repair takes the store exclusively (`WriterLock`) and is refused while engines are
attached.

This module holds what they share: a progress reporter that draws a tqdm bar on a
terminal and prints plain lines (at most every few seconds) when stderr is not a TTY.
"""
from __future__ import annotations

import sys
import time

from kvstore.format.layout import format_size

__all__ = ["Progress"]


class Progress:
    """A progress reporter: tqdm on a TTY, plain lines otherwise, nothing when disabled.

    `update(n, **postfix)` advances by n; postfix values are shown as `key=value`. With
    `unit="B"` amounts are shown as sizes and a rate is added. Plain lines go out at most
    every `interval` seconds (the first one after `interval`, so a short run prints none).
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "", *, enabled: bool = True,
                 stream=None, interval: float = 5.0, tty: bool | None = None):
        self.desc = desc
        self.total = total
        self.unit = unit
        self.n = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.t0 = self._last = time.monotonic()
        self._postfix: dict = {}
        self._bar = None
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        if enabled and tty:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit=unit or "it", file=self.stream,
                             unit_scale=(unit == "B"), unit_divisor=1024 if unit == "B" else 1000,
                             dynamic_ncols=True, leave=False, mininterval=min(0.1, interval))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_total(self, total: int | None) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if postfix:
            self._postfix.update(postfix)
        if not self.enabled:
            return
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix({k: str(v) for k, v in self._postfix.items()}, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def _amount(self, n: int) -> str:
        return format_size(n) if self.unit == "B" else f"{n:,}"

    def line(self) -> str:
        """The plain-text progress line (also used for the last line on a non-TTY)."""
        done = self._amount(self.n)
        if self.total:
            s = f"{self.desc}: {done} of {self._amount(self.total)}"
            if self.unit and self.unit != "B":
                s += f" {self.unit}"
            s += f" ({100.0 * self.n / self.total:.0f}%)"
        else:
            s = f"{self.desc}: {done}" + (f" {self.unit}" if self.unit and self.unit != "B" else "")
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        if self.unit == "B":
            s += f", {self.n / elapsed / 1e9:.2f} GB/s"
        if self._postfix:
            s += ", " + ", ".join(f"{k}={v}" for k, v in self._postfix.items())
        return s

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
