"""Plots of one run: validation perplexity against time, with the phases shaded."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # noqa: E402

PHASE_COLORS = {"sync": "#4c72b0", "async": "#dd8452"}


def time_label(clock: str) -> str:
    """The x-axis label of a clock: ``wall`` or ``pipeline``, with its mode after a dash
    (``pipeline-profiled``: the sweep's clock names)."""
    kind, _, mode = clock.partition("-")
    if kind == "wall":
        return "wall-clock time (s)"
    how = {"profiled": ", costs from the profile", "measured": ", costs as measured"}.get(mode, "")
    return f"time on the pipeline clock (s{how})"


def log_ppl_axis(ax) -> None:
    """A log perplexity axis labelled at 1, 2 and 5 of each decade (plain numbers): a log axis with a
    label per decade hides how far apart two curves are."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _evals(records: list[dict]) -> tuple[list[float], list[float]]:
    ev = [r for r in records if r.get("kind") == "eval" and r.get("val_ppl") is not None]
    return [r["time_s"] for r in ev], [r["val_ppl"] for r in ev]


def _target(ax, target: float | None) -> None:
    if target:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")


def plot_curves(records: list[dict], path: Path, target: float | None, clock: str, title: str = "") -> None:
    """``curves.png``: validation perplexity against the run's clock."""
    t, ppl = _evals(records)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(t, ppl, marker="o", ms=3)
    _target(ax, target)
    ax.set_xlabel(time_label(clock))
    ax.set_ylabel("validation perplexity")
    log_ppl_axis(ax)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if target:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def phase_spans(records: list[dict]) -> list[tuple[str, float, float]]:
    """(phase, start, end) intervals of the run's clock from its step records."""
    spans: list[tuple[str, float, float]] = []
    prev_t = 0.0
    for r in records:
        if r.get("kind") != "step":
            continue
        if spans and spans[-1][0] == r["phase"]:
            spans[-1] = (r["phase"], spans[-1][1], r["time_s"])
        else:
            spans.append((r["phase"], prev_t, r["time_s"]))
        prev_t = r["time_s"]
    return spans


def plot_phases(records: list[dict], path: Path, target: float | None, clock: str, title: str = "") -> None:
    """``phases.png``: validation perplexity against time with sync and async phases shaded."""
    t, ppl = _evals(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    seen = set()
    for phase, a, b in phase_spans(records):
        ax.axvspan(a, b, color=PHASE_COLORS[phase], alpha=0.18, lw=0, label=None if phase in seen else phase)
        seen.add(phase)
    ax.plot(t, ppl, marker="o", ms=3, color="black", label="validation ppl")
    _target(ax, target)
    ax.set_xlabel(time_label(clock))
    ax.set_ylabel("validation perplexity")
    log_ppl_axis(ax)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
