"""Drawing a simulated schedule: one row per stage (stage 0 on top), time along x.

Forward and backward boxes are coloured by microbatch (a qualitative palette of ten hues, so
neighbouring microbatches differ): a forward in the light shade, its backward in the dark shade
of the same hue. Updates are black boxes as wide as they take, the all-reduce before an update
(replicas of the pipeline) a white cross-hatched box (grey in a downsampled picture), a zero-cost action a thin line at
its time (not a box of made-up width); idle time is left white. A label (``F3``, or just ``3``) is
written inside a box when it fits at the picture's size, and left out when it does not. The
picture is at most ``MAX_WIDTH_IN`` inches wide: a long run is drawn narrower, not wider.

Past ``max_boxes`` actions a box per action would be slow to draw and unreadable, so the timeline
is downsampled instead: each stage's row becomes ``columns`` time columns, each painted with the
action running at its centre (no labels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..schedules import BACKWARD, FORWARD, INPUT, UPDATE, WEIGHT  # noqa: E402
from .clock import ALLREDUCE, SIGNAL  # noqa: E402

WORK = (FORWARD, BACKWARD, INPUT, WEIGHT)  # drawn as labelled boxes (I like B, W hatched)

MAX_BOXES = 6000
MAX_WIDTH_IN = 16  # inches at 100 dpi: a picture that fits a screen
COLUMNS = 2400
HUES = 10  # tab20 holds ten hues, each as a (dark, light) pair
BLACK = (0.0, 0.0, 0.0, 1.0)
GREY = (0.6, 0.6, 0.6, 1.0)  # the all-reduce across replicas
ROW = 0.8  # box height, in rows

Box = tuple  # (stage, kind, mb, step, start, end), as in SimResult.timeline


def _palette() -> list[tuple[float, ...]]:
    """tab20's colours, then black, then grey: index 2h is hue h dark, 2h + 1 the same hue light."""
    return [to_rgba(c) for c in plt.get_cmap("tab20").colors] + [BLACK, GREY]


def colour_index(kind: str, mb: int) -> int:
    """Palette index of an action: forward light, backward dark, update black."""
    if kind == UPDATE:
        return 2 * HUES
    if kind == ALLREDUCE:
        return 2 * HUES + 1
    return 2 * (mb % HUES) + (1 if kind == FORWARD else 0)


def draw_timeline(boxes: Sequence[Box], stages: int, path: str | Path, title: str = "",
                  max_boxes: int = MAX_BOXES, columns: int = COLUMNS) -> str:
    """Draw ``boxes`` to ``path``; returns one line saying what was drawn."""
    span = max((b[5] for b in boxes), default=0.0) or 1.0
    per_stage = len(boxes) / max(1, stages)
    width = float(np.clip(per_stage * 0.16, 8, MAX_WIDTH_IN))
    height = float(np.clip(0.4 * stages + 1.6, 2.6, 22))
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, span * 1.01)  # limits first: the labels are fitted to the boxes' size in pixels
    ax.set_ylim(stages - 0.5, -0.5)  # stage 0 on top
    if len(boxes) <= max_boxes:
        _draw_boxes(ax, boxes)
        note = f"{len(boxes)} actions, one box each"
    else:
        _draw_raster(ax, boxes, stages, span, columns)
        note = f"downsampled: {len(boxes)} actions drawn as {columns} time columns per stage, without labels"
    step = max(1, stages // 16)
    ax.set_yticks(range(0, stages, step))
    ax.set_ylabel("stage")
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=_legend(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return note


def _legend() -> list[Patch]:
    pal = _palette()
    return [Patch(facecolor=pal[1], label="F (light)"), Patch(facecolor=pal[0], label="B or I (dark)"),
            Patch(facecolor=pal[0], hatch="///", edgecolor="white", label="W (hatched)"),
            Patch(facecolor=BLACK, label="U (a line if free)"), Patch(facecolor="white", edgecolor=GREY, hatch="xxx", label="A (all-reduce)"),
            Patch(facecolor=GREY, label="S (held-out signal)"),
            Patch(facecolor="white", edgecolor="grey", label="idle")]


def shapes(boxes: Sequence[Box]) -> tuple[list, list, list, list, list]:
    """(forward and backward boxes, their colours, update boxes, lines, the indices of the work
    boxes that are weight gradients): each box the corners of its true extent; an action that
    costs nothing (an update at ``update=0``) a line at its time."""
    pal = _palette()
    work, work_colours, updates, instants, hatched = [], [], [], [], []
    for s, kind, mb, _step, start, end in boxes:
        y0, y1 = s - ROW / 2, s + ROW / 2
        if end <= start:
            instants.append([(start, y0), (start, y1)])
        elif kind == UPDATE:
            updates.append([(start, y0), (start, y1), (end, y1), (end, y0)])
        elif kind in WORK:
            if kind == WEIGHT:
                hatched.append(len(work))
            work.append([(start, y0), (start, y1), (end, y1), (end, y0)])
            work_colours.append(pal[colour_index(kind, mb)])
    return work, work_colours, updates, instants, hatched


def _draw_boxes(ax, boxes: Sequence[Box]) -> None:
    work, work_colours, updates, instants, hatched = shapes(boxes)
    ax.add_collection(PolyCollection(work, facecolors=work_colours, edgecolors="white", linewidths=0.4))
    if hatched:
        ax.add_collection(PolyCollection([work[i] for i in hatched], facecolors="none", edgecolors="white",
                                         hatch="///", linewidths=0.0))
    ax.add_collection(PolyCollection(updates, facecolors=BLACK, edgecolors="none", zorder=3))
    allreduce = [[(a, s - ROW / 2), (a, s + ROW / 2), (b, s + ROW / 2), (b, s - ROW / 2)]
                 for s, kind, _mb, _step, a, b in boxes if kind == ALLREDUCE and b > a]
    if allreduce:  # white, cross-hatched: unlike any microbatch's colour
        ax.add_collection(PolyCollection(allreduce, facecolors="white", edgecolors=GREY, hatch="xxx", linewidths=0.6))
    signal = [[(a, s - ROW / 2), (a, s + ROW / 2), (b, s + ROW / 2), (b, s - ROW / 2)]
              for s, kind, _mb, _step, a, b in boxes if kind == SIGNAL and b > a]
    if signal:  # the held-out signal's forward after an update: solid grey
        ax.add_collection(PolyCollection(signal, facecolors=GREY, edgecolors="white", linewidths=0.4))
    ax.add_collection(LineCollection(instants, colors=BLACK, linewidths=1.0, zorder=3))
    _labels(ax, boxes)


def _labels(ax, boxes: Sequence[Box]) -> None:
    """Write ``F3`` (or ``3``) inside each forward and backward box wide enough for it at the
    picture's size; narrower boxes get none."""
    fontsize = 7
    fig = ax.figure
    px_per_s = ax.get_position().width * fig.get_figwidth() * fig.dpi / ax.get_xlim()[1]
    char_px = fontsize * 0.65 * fig.dpi / 72
    for s, kind, mb, _step, start, end in boxes:
        if kind not in WORK:
            continue
        room = (end - start) * px_per_s
        for text in (f"{kind}{mb}", f"{mb}"):
            if len(text) * char_px + 4 <= room:
                ax.text((start + end) / 2, s, text, ha="center", va="center", fontsize=fontsize,
                        color="black" if kind == FORWARD else "white")
                break


def _draw_raster(ax, boxes: Sequence[Box], stages: int, span: float, columns: int) -> None:
    """Each stage's row as ``columns`` pixels: the colour of the action at the pixel's centre."""
    pal = np.array(_palette())
    stage, kind, mb, _step, start, end = (np.asarray(c) for c in zip(*boxes))
    kind = np.select([kind == FORWARD, np.isin(kind, (BACKWARD, INPUT, WEIGHT)), kind == UPDATE,
                      np.isin(kind, (ALLREDUCE, SIGNAL))], [0, 1, 2, 3], 4)  # (A and S both grey here)
    order = np.argsort(stage, kind="stable")  # by stage, each stage's actions in the order they ran
    bounds = np.searchsorted(stage[order], np.arange(stages + 1))
    img = np.ones((stages, columns, 4))
    centres = (np.arange(columns) + 0.5) * span / columns
    for s in range(stages):
        rows = order[bounds[s]:bounds[s + 1]]
        rows = rows[kind[rows] < 4]
        if not len(rows):
            continue
        kinds, mbs, starts, ends = kind[rows], mb[rows].astype(int), start[rows], end[rows]
        idx = np.where(kinds == 2, 2 * HUES, np.where(kinds == 3, 2 * HUES + 1, 2 * (mbs % HUES) + (kinds == 0)))
        at = np.searchsorted(starts, centres, side="right") - 1  # a stage's actions run in order
        hit = (at >= 0) & (centres < ends[np.maximum(at, 0)])
        img[s, hit] = pal[idx[at[hit]]]
        # updates are often shorter than a column: paint the column they start in
        upd = starts[kinds == 2]
        img[s, np.minimum((upd / span * columns).astype(int), columns - 1)] = BLACK
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=(0, span, stages - 0.5, -0.5))
