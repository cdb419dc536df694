# Copyright 2026 The dion3_jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Helpers shared by the examples: argument types, a progress display and output folders.

Nothing here imports JAX, so ``--help`` and argument errors come back at once.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections.abc import Callable, Sequence


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` that shows defaults and refuses abbreviated flags."""
    return argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )


def _number(kind: type, lo: float, hi: float, lo_open: bool, hi_open: bool) -> Callable:
    lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n' if kind is int else ''} "
                                             f"{kind.__name__}: {text!r}") from None
        low_ok = value > lo if lo_open else value >= lo
        high_ok = value < hi if hi_open else value <= hi
        if math.isnan(value) or not (low_ok and high_ok):
            raise argparse.ArgumentTypeError(f"{text} is outside {lb}{lo:g}, {hi:g}{rb}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(int, 1, math.inf, False, True)(text)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _number(int, 0, math.inf, False, True)(text)


def positive_float(text: str) -> float:
    """A float > 0."""
    return _number(float, 0.0, math.inf, True, True)(text)


def nonnegative_float(text: str) -> float:
    """A float >= 0."""
    return _number(float, 0.0, math.inf, False, True)(text)


def fraction(text: str) -> float:
    """A float in (0, 1], e.g. Dion3's row fraction."""
    return _number(float, 0.0, 1.0, True, False)(text)


def decay(text: str) -> float:
    """A float in [0, 1), e.g. a momentum or an EMA coefficient."""
    return _number(float, 0.0, 1.0, False, True)(text)


def percent(text: str) -> float:
    """A float in (0, 100)."""
    return _number(float, 0.0, 100.0, True, True)(text)


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argument type for comma-separated names, each one of ``choices``."""

    def convert(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {', '.join(map(repr, bad)) or repr(text)} "
                f"(choose from {', '.join(choices)})")
        return items

    convert.__name__ = "name list"
    return convert


def new_run_dir(root: str, now: datetime.datetime | None = None) -> str:
    """Creates and returns ``root/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``... if it exists."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    os.makedirs(root, exist_ok=True)
    for i in range(1, 1000):
        path = os.path.join(root, stamp if i == 1 else f"{stamp}-{i}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


class Progress:
    """A tqdm bar on a terminal; periodic plain lines otherwise; nothing when disabled.

    Args:
      total: number of steps.
      desc: label printed before the bar or on every line.
      enabled: ``False`` prints nothing at all.
      lines: how many plain lines to print over the run when stdout is not a terminal.
      stream: where to write (default ``sys.stdout``); a terminal gets the bar.
    """

    def __init__(self, total: int, desc: str, enabled: bool = True, lines: int = 10,
                 stream=None):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = stream or sys.stdout
        self.every = max(1, total // max(1, lines))
        self.n, self.postfix, self.t0 = 0, {}, time.perf_counter()
        self.bar = None
        if enabled and _isatty(self.stream):
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=f"{desc:>8}", dynamic_ncols=True,
                                file=self.stream)

    def set_postfix(self, **values) -> None:
        self.postfix.update(values)
        if self.bar is not None:
            self.bar.set_postfix(**self.postfix)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (self.n % self.every == 0 or self.n == self.total):
            extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            secs = time.perf_counter() - self.t0
            print(f"{self.desc}: step {self.n}/{self.total} ({secs:.0f} s) {extra}".rstrip(),
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
