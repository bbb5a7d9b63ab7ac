"""Running several stages' action lists in one process, in any order their dependencies allow."""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from .actions import Action
from .program import StageProgram


class Deadlock(RuntimeError):
    pass


def walk(
    programs: Sequence[StageProgram],
    stages: Sequence[int],
    done: Callable[[int], bool] | None,
    ready: Callable[[int, Action], bool],
    execute: Callable[[int, Action], Sequence[int]],
    lifo: bool = False,
) -> None:
    """Run stages until ``done(s)`` holds for each stage in ``stages`` (None: until every
    program has ended, the same as ``done(s)`` = ``programs[s].peek() is None``, checked with one
    peek per action: the simulator's whole run).

    A stage runs its next action while ``ready``; ``execute`` returns the stages its action may
    have unblocked, which are queued again. ``stages`` gives the first visiting order and ``lifo``
    the queue discipline: different choices give different interleavings of the same lists (the
    numbers must not depend on them).
    """
    if done is None:
        def unfinished(s: int) -> bool:
            return programs[s].peek() is not None

        def run(s: int) -> bool:  # (one peek per action)
            prog, progress = programs[s], False
            a = prog.peek()
            while a is not None and ready(s, a):
                prog.pop()
                progress = True
                for w in execute(s, a):
                    if w not in queued and programs[w].peek() is not None:
                        queued.add(w)
                        queue.append(w)
                a = prog.peek()
            return progress
    else:
        def unfinished(s: int) -> bool:
            return not done(s)

        def run(s: int) -> bool:
            prog, progress = programs[s], False
            while not done(s):
                a = prog.peek()
                if a is None:
                    raise Deadlock(f"stage {s} ran out of actions before finishing")
                if not ready(s, a):
                    break
                prog.pop()
                progress = True
                for w in execute(s, a):
                    if w not in queued and not done(w):
                        queued.add(w)
                        queue.append(w)
            return progress

    queue = deque(s for s in stages if unfinished(s))
    queued = set(queue)
    while True:
        progress = False
        while queue:
            s = queue.pop() if lifo else queue.popleft()
            queued.discard(s)
            progress = run(s) or progress
        stuck = [s for s in stages if unfinished(s)]
        if not stuck:
            return
        if not progress:
            waits = ", ".join(f"stage {s} at {programs[s].peek()}" for s in stuck)
            raise Deadlock(f"pipeline deadlock: {waits}")
        # a readiness check may have posted a share of a collective that others wait for: poll again
        queue.extend(stuck)
        queued.update(stuck)
