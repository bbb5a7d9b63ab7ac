"""The sweep's plots, for the early target (``_late`` after the name for the late one):
``speedup.png`` (heatmap of one method's speedup in time to target over another, depth x batch
size, with its bootstrap interval), ``ttp.png`` (time-to-target bars per setting and method relative to the baseline's median,
seed spread as error bars) and ``curves_pP_bB.png`` (validation perplexity against time of one
setting, every method and seed). ``clock`` is the runs' clock, ``pipeline-profiled`` or ``wall``."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

from ..train.plots import log_ppl_axis, time_label  # noqa: E402
from .bootstrap import fmt_ci, speedup_ci  # noqa: E402
from .markdown import fmt_speedup  # noqa: E402
from .results import MethodStats, clock_label, speedup  # noqa: E402


def plot_speedup(stats: dict[tuple[int, int], dict[str, MethodStats]], compare: str, over: str, clock: str,
                 path: Path, target: str = "early") -> None:
    """Heatmap of median ttt(over) / median ttt(compare): rows depths, columns batch sizes; cells
    annotated with the bootstrap interval under the value, bounds with >= or <=, grey where neither
    reached the target."""
    depths = sorted({p for p, _ in stats})
    batches = sorted({b for _, b in stats})
    values = [[math.nan] * len(batches) for _ in depths]
    labels = [[""] * len(batches) for _ in depths]
    for (p, b), by_method in stats.items():
        a, x = by_method[compare].time, by_method[over].time
        s = speedup(a, x)
        values[depths.index(p)][batches.index(b)] = s[1] if s else math.nan
        labels[depths.index(p)][batches.index(b)] = (fmt_speedup(s) + "\n" + fmt_ci(speedup_ci(a.values, x.values))
                                                      if s else "–")
    finite = [v for row in values for v in row if math.isfinite(v)]
    span = max([abs(v - 1) for v in finite] + [0.05])
    fig, ax = plt.subplots(figsize=(1.4 * len(batches) + 2.4, 0.9 * len(depths) + 1.8))
    cmap = plt.get_cmap("RdBu").with_extremes(bad="#dddddd")
    im = ax.imshow(values, cmap=cmap, norm=TwoSlopeNorm(1.0, 1 - span, 1 + span), aspect="auto", origin="lower")
    for i in range(len(depths)):
        for j in range(len(batches)):
            ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(range(len(depths)), [str(p) for p in depths])
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("pipeline depth p")
    ax.set_title(f"speedup of {compare} over {over}\nmedian time to the {target} target,\n{clock_label(clock)}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, label=f"time to target of {over} / of {compare}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def whiskers(values: list[float]) -> tuple[float, float, int]:
    """The min and max of the seeds' times that are finite, and how many are not (unreached); at
    least one must be finite (the median is, where it is called)."""
    finite = [v for v in values if math.isfinite(v)]
    return min(finite), max(finite), len(values) - len(finite)


def plot_ttt(stats: dict[tuple[int, int], dict[str, MethodStats]], methods: list[str], baseline: str, clock: str,
             path: Path, target: str = "early") -> None:
    """Bars of each method's median time-to-target divided by the baseline's median in the same
    setting (baseline = 1, linear axis from 0, so bar heights compare as ratios), min-max over seeds
    as error bars (over the seeds that reached it; each that did not is counted in an arrow above
    the bar, ``+1 n.r.``: its time is unbounded); a method that did not reach the target at the
    median is a hatched bar up to the time it ran, labelled n.r. The baseline's own median time is
    written under each setting."""
    keys = [k for k in stats if stats[k][baseline].ok]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.45 * len(keys) * len(methods) + 2), 4.6))
    for k, method in enumerate(methods):
        color = f"C{k}"
        for i, key in enumerate(keys):
            s, ref = stats[key][method].time, stats[key][baseline].time.median
            x = i - 0.4 + width * (k + 0.5)
            if not s.values:
                continue
            if s.ok:
                low, high, unreached = whiskers(s.values)
                err = [[(s.median - low) / ref], [(high - s.median) / ref]]
                ax.bar(x, s.median / ref, width, color=color, yerr=err, capsize=2, label=method if i == 0 else None)
                if unreached:  # its time is unbounded: an arrow above the reached seeds' bar, with the count
                    ax.annotate(f"+{unreached} n.r.", (x, high / ref), xytext=(0, 14), textcoords="offset points",
                                ha="center", fontsize=6, arrowprops={"arrowstyle": "<-", "lw": 0.8})
            else:
                ax.bar(x, s.lower / ref, width, color="white", edgecolor=color, hatch="//",
                       label=method if i == 0 else None)
                ax.text(x, s.lower / ref, "n.r.", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)), [f"p{p} b{b}\n{baseline} {stats[(p, b)][baseline].time.median:.3g} s"
                                     for p, b in keys], fontsize=8)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the n.r. labels
    ax.set_xlabel(f"depth p, batch size b; {baseline}'s median time to target, {clock_label(clock)}", fontsize=9)
    ax.set_ylabel(f"time to target / {baseline}'s (lower is faster)")
    ax.set_title(f"time to the {target} target perplexity relative to {baseline}\nmedian over seeds, min–max bars "
                 f"over the seeds that reached it",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # outside: never on a bar
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_setting_curves(curves: dict[str, list[tuple[int, list[dict]]]], targets: list[float], clock: str, title: str,
                        path: Path, phases: dict[str, tuple[int, list[tuple[float, float]]]] | None = None) -> None:
    """Validation perplexity against time: ``curves`` maps each method (in the grid's order, which
    gives its colour, as in ``ttp.png``) to its (seed, eval records); ``phases`` maps a switching
    method to (seed, its async stretches' clock spans), shaded in the method's colour, one band per
    method under the curves."""
    fig, ax = plt.subplots(figsize=(7, 4.6 if phases else 4.2))
    order = list(curves)
    for n, (method, (seed, spans)) in enumerate((phases or {}).items()):
        k = order.index(method) if method in order else n
        band = ax.get_xaxis_transform()  # x in data, y in axes: a strip per method at the bottom
        for a, b in spans:
            ax.fill_between([a, b], 0.02 + 0.05 * n, 0.06 + 0.05 * n, color=f"C{k}", alpha=0.5, lw=0, transform=band,
                            label=f"{method} s{seed} in async" if (a, b) == spans[0] else None)
    for k, (method, runs) in enumerate(curves.items()):
        for n, (seed, records) in enumerate(runs):
            ax.plot([r["time_s"] for r in records], [r["val_ppl"] for r in records], color=f"C{k}", alpha=0.85,
                    lw=1.2, marker="o", ms=2, label=method if n == 0 else None)
    for target, name, ls in zip(targets, ("early", "late"), ("--", ":")):
        ax.axhline(target, color="grey", ls=ls, lw=1, label=f"{name} target {target:.4g}")
    ax.set_xlabel(time_label(clock))
    ax.set_ylabel("validation perplexity")
    log_ppl_axis(ax)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
