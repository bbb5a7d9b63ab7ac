"""Pipeline schedules as per-stage action lists."""

from .actions import (ASYNC, BACKWARD, BACKWARDS, EVAL, FORWARD, INPUT, SYNC, UPDATE, WEIGHT, Action, Plan, PlanError,
                      lookahead)
from .program import ScheduleError, ScheduleSpec, StageProgram

__all__ = [
    "ASYNC", "BACKWARD", "BACKWARDS", "EVAL", "INPUT", "WEIGHT", "FORWARD", "SYNC", "UPDATE", "Action", "Plan", "PlanError",
    "lookahead", "ScheduleError", "ScheduleSpec", "StageProgram",
]
