"""Pipeline schedules as per-stage action lists."""

from .actions import ASYNC, BACKWARD, EVAL, FORWARD, SYNC, UPDATE, Action, Plan, PlanError, lookahead
from .program import ScheduleError, ScheduleSpec, StageProgram

__all__ = [
    "ASYNC", "BACKWARD", "EVAL", "FORWARD", "SYNC", "UPDATE", "Action", "Plan", "PlanError",
    "lookahead", "ScheduleError", "ScheduleSpec", "StageProgram",
]
