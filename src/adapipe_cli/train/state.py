"""The run's state at a step boundary: what the loop knows (:class:`RunState`), and the whole of
it that a checkpoint saves and a guard snapshot keeps (the pipeline's part is the runtime's)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .. import checkpoint


@dataclass
class RunState:
    """What the loop knows about the run so far (saved with every checkpoint)."""

    steps: int = 0  # steps completed
    tokens: int = 0
    time_s: float = 0.0  # the run's clock, rollbacks' lost time included
    offset: float = 0.0  # time lost to rollbacks, added to the runtime's clock
    stopped: str = "max_steps"
    forced_until: int = 0  # the guard's sync cooldown: steps before this are decided sync
    wall_before: float = 0.0  # wall time of earlier sessions of a resumed run
    evals: list = field(default_factory=list)
    step_time: dict = field(default_factory=lambda: {0: 0.0})  # version -> time_s when it existed


class RunStates:
    """The Trainer's state as data (a mixin of :class:`.loop.Trainer`: ``st``, ``plan``,
    ``heuristic``, ``guard``, ``log`` and ``runtime`` are the Trainer's)."""

    def _full_state(self) -> dict:
        """The run at the current step boundary: the pipeline and everything the loop knows."""
        return {"pipeline": self.runtime.state_dict(), "trainer": self._trainer_state()}

    def _trainer_state(self) -> dict:
        run = copy.deepcopy(self.st.__dict__)
        run["wall_before"] = self.wall()
        return {"run": run, "phases": list(self.plan.phases),
                "heuristic": copy.deepcopy(self.heuristic.state_dict()), "guard": self.guard.state_dict(),
                "lines": len(self.log.records), "rng": torch.get_rng_state()}

    def _load_state(self, state: dict, heuristic: bool = True) -> None:
        """Restore ``state``; with ``heuristic=False`` the heuristic keeps what it knows now (an
        undone probe)."""
        tr = state["trainer"]
        self.plan.phases[:] = tr["phases"]
        if heuristic:
            self.heuristic.load_state_dict(copy.deepcopy(tr["heuristic"]))
        self.guard.load_state_dict(tr["guard"])
        torch.set_rng_state(tr["rng"])
        if "pipeline" in state:  # a guard snapshot (a checkpoint's pipeline parts are the runtime's to read)
            self.runtime.load_state_dict(state["pipeline"])

    def save_checkpoint(self) -> Path:
        steps = self.st.steps
        trainer = self._trainer_state()
        folder = checkpoint.begin(self.dir, steps)
        # the runtime writes the pipeline's parts (the dist runtime's workers one per stage) and
        # refuses weights that are not finite
        parts = self.runtime.write_checkpoint_parts(folder, steps)
        parts["trainer"] = checkpoint.write_part(folder, "trainer", trainer)
        meta = {"config": OmegaConf.to_container(self.cfg, resolve=True), "trainer_lines": trainer["lines"],
                "runtime": self.runtime.name, "fingerprints": self.fingerprints}
        return checkpoint.commit(self.dir, folder, steps, parts, meta, self.cfg.train.keep_checkpoints)

    def _restore(self, folder: Path, manifest: dict) -> None:
        state = {"trainer": checkpoint.read_part(folder, manifest, "trainer")}
        self._load_state(state)  # the phases first: the runtime regenerates its programs from them
        self.runtime.restore_checkpoint(folder, manifest, state["trainer"]["run"])
        self.st = RunState(**state["trainer"]["run"])
