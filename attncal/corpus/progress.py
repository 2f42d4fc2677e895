"""Progress of an encode run: a tqdm bar with rows/s, tokens/s and ETA, and the closing summary line."""

from __future__ import annotations

import time


class Progress:
    """Counts rows and tokens of this run.

    The bar counts rows against the exact number of valid rows when a scan gave it (local and triton
    engines), else bytes of input against the input's size (ray: no process reads the whole input
    before encoding starts, so the row count is known only at the end), with rows and rows/s beside.
    """

    def __init__(self, total: int, done: int, show: bool, desc: str = "encode", unit: str = "row") -> None:
        from tqdm.auto import tqdm

        self.rows = 0
        self.tokens = 0
        self.tokens_known = True
        self.unit = unit
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total, initial=done, unit=unit, unit_scale=unit == "B", desc=desc, disable=not show,
                        smoothing=0.05, dynamic_ncols=True)

    def update(self, rows: int, tokens: int | None, nbytes: int = 0) -> None:
        self.rows += rows
        if tokens is None:
            self.tokens_known = False
        else:
            self.tokens += tokens
        elapsed = max(self.elapsed, 1e-9)
        postfix = [f"{self.rows:,} rows, {self.rows / elapsed:,.0f} rows/s"] if self.unit == "B" else []
        if self.tokens_known:
            postfix.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        if postfix:
            self.bar.set_postfix_str(", ".join(postfix), refresh=False)
        self.bar.update(nbytes if self.unit == "B" else rows)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def close(self) -> None:
        self.bar.close()
