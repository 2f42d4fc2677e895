"""Progress of an encode run: a tqdm bar with rows/s, tokens/s and ETA, and the closing summary line."""

from __future__ import annotations

import time


class Progress:
    """Counts rows and tokens of this run; the bar's total is the scan's exact count of valid rows."""

    def __init__(self, total: int, done: int, show: bool, desc: str = "encode") -> None:
        from tqdm.auto import tqdm

        from ..console import terminal

        self.rows = 0
        self.tokens = 0
        self.tokens_known = True
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total, initial=done, unit="row", desc=desc, disable=not show, smoothing=0.05,
                        dynamic_ncols=True, file=terminal())  # on the terminal even while Ray's output is captured

    def update(self, rows: int, tokens: int | None) -> None:
        self.rows += rows
        if tokens is None:
            self.tokens_known = False
        else:
            self.tokens += tokens
        if self.tokens_known:
            self.bar.set_postfix_str(f"{self.tokens / max(self.elapsed, 1e-9):,.0f} tokens/s", refresh=False)
        self.bar.update(rows)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def close(self) -> None:
        self.bar.close()
