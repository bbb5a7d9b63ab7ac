"""The progress bar: step, loss, validation perplexity, phase and tokens/s; quiet off a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, mode: str = "auto"):
        enabled = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, disable=not enabled, unit="step")
        self.val_ppl: float | None = None

    def update(self, res, ev: dict | None, tokens_per_s: float) -> None:
        if ev is not None:
            self.val_ppl = ev["val_ppl"]
        post = {"loss": f"{res.loss:.3f}", "phase": res.phase, "tok/s": f"{tokens_per_s:,.0f}"}
        if self.val_ppl is not None:
            post["val_ppl"] = f"{self.val_ppl:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
