"""Microbatches of a data source: microbatch ``i`` of step ``t`` is a fixed slice of step ``t``'s batch."""

from __future__ import annotations

from collections import OrderedDict

import torch


class Batches:
    """``batch(step, i)``: microbatch ``i`` of step ``step``, rows ``i*b/m .. (i+1)*b/m`` of the
    step's batch, on ``device`` (None: where the data makes them). Recent steps' batches are
    cached (the first stage reads inputs, the last targets, each once per microbatch)."""

    def __init__(self, data, batch_size: int, microbatches: int, keep: int = 8, device: torch.device | None = None):
        self.data, self.b, self.m = data, batch_size, microbatches
        self.device = None if device is None or device.type == "cpu" else device
        self.mb = batch_size // microbatches
        self.keep = keep
        self.cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def __call__(self, step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        xy = self.cache.get(step)
        if xy is None:
            xy = self.data.train_batch(step, self.b)
            if self.device is not None:
                xy = tuple(z.to(self.device) for z in xy)
            self.cache[step] = xy
            if len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        x, y = xy
        return x[i * self.mb:(i + 1) * self.mb], y[i * self.mb:(i + 1) * self.mb]
