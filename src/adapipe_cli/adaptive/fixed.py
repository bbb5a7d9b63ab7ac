"""``heuristic=fixed``: a plan of phases and step counts, e.g. ``[[sync, 200], [async, null]]``
(null: until the end). Covers sync-only, async-only and warm-up-then-async baselines."""

from __future__ import annotations

from .base import ASYNC, SYNC, Context, Decision, Heuristic


def parse_plan(plan) -> list[tuple[str, int | None]]:
    """``heuristic.plan`` as (phase, steps) pairs; raises ValueError saying what to change."""
    out: list[tuple[str, int | None]] = []
    for item in plan:
        phase, steps = (item[0], item[1]) if len(item) == 2 else (item[0], None)
        if phase not in (SYNC, ASYNC):
            raise ValueError(f"heuristic.plan: unknown phase {phase!r}: use sync or async")
        if steps is not None and int(steps) < 1:
            raise ValueError(f"heuristic.plan: step count of {phase} must be positive or null")
        out.append((phase, None if steps is None else int(steps)))
    if not out:
        raise ValueError("heuristic.plan is empty: give e.g. [[sync,200],[async,null]]")
    return out


class Fixed(Heuristic):
    name = "fixed"

    def __init__(self, cfg, ctx: Context):
        super().__init__(cfg, ctx)
        self.plan = parse_plan(cfg.plan)

    def decide(self, step: int) -> Decision:
        start = 0
        for phase, steps in self.plan:
            if steps is None or step < start + steps:
                return Decision(phase, f"plan: {phase} from step {start}")
            start += steps
        return Decision(self.plan[-1][0], "plan ended: last phase continues")
