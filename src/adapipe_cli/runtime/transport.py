"""How stages exchange tensors. Stages never reach into each other: activations, gradients and the
values of a collective travel only through a transport.

Channels: ``act`` (forward activations, stage s -> s+1), ``grad`` (input gradients, s -> s-1),
``eval`` (validation activations, s -> s+1). A message is addressed by (channel, destination
stage, microbatch or step).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Transport(Protocol):
    def send(self, channel: str, src: int, dst: int, key, tensor: torch.Tensor) -> None: ...

    def ready(self, channel: str, src: int, dst: int, key) -> bool:
        """Whether ``recv`` would return without waiting (the local runtime's scheduling test)."""
        ...

    def recv(self, channel: str, src: int, dst: int, key, like: torch.Tensor | None = None) -> torch.Tensor: ...

    def release(self, channel: str, tensor: torch.Tensor) -> None:
        """The receiver is done with ``tensor`` (from ``recv``): its buffer may be reused."""
        ...

    def post_reduce(self, key: tuple, stage: int, group: tuple[int, ...], tensors: list[torch.Tensor]) -> None: ...

    def reduce_ready(self, key: tuple, group: tuple[int, ...]) -> bool: ...

    def reduce(self, key: tuple, stage: int, group: tuple[int, ...], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Element-wise sum of ``tensors`` over the stages of ``group`` (every member calls it)."""
        ...


class LocalTransport:
    """In-process mailboxes for the local runtime. A reduction sums contributions in stage order,
    so its result does not depend on the order in which stages arrive."""

    def __init__(self) -> None:
        self.box: dict[tuple, torch.Tensor] = {}
        self.reductions: dict[tuple, dict[int, list[torch.Tensor]]] = {}
        self.taken: dict[tuple, int] = {}

    def send(self, channel: str, src: int, dst: int, key, tensor: torch.Tensor) -> None:
        self.box[(channel, dst, key)] = tensor

    def ready(self, channel: str, src: int, dst: int, key) -> bool:
        return (channel, dst, key) in self.box

    def recv(self, channel: str, src: int, dst: int, key, like: torch.Tensor | None = None) -> torch.Tensor:
        return self.box.pop((channel, dst, key))

    def release(self, channel: str, tensor: torch.Tensor) -> None:
        pass  # the received tensor is the sender's own: nothing to reuse

    def post_reduce(self, key: tuple, stage: int, group: tuple[int, ...], tensors: list[torch.Tensor]) -> None:
        self.reductions.setdefault(key, {})[stage] = tensors

    def reduce_ready(self, key: tuple, group: tuple[int, ...]) -> bool:
        return len(self.reductions.get(key, ())) == len(group)

    def reduce(self, key: tuple, stage: int, group: tuple[int, ...], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = self.reductions[key]
        out = [t.clone() for t in parts[group[0]]]
        for s in group[1:]:
            for acc, t in zip(out, parts[s]):
                acc.add_(t)
        self.taken[key] = self.taken.get(key, 0) + 1
        if self.taken[key] == len(group):
            del self.reductions[key], self.taken[key]
        return out

    def pending(self) -> int:
        return len(self.box)
