"""DistTransport's bookkeeping without processes: torch.distributed replaced by a recorder whose
sends, like gloo's, are complete only once waited for. Pending sends stay bounded (the oldest
is waited for beyond the window, all after a collective over every stage), receive buffers given
back are reused, and the driver's link is the mean of the measured pairs."""

from __future__ import annotations

import pytest
import torch

from adapipe_cli.runtime import dist_transport
from adapipe_cli.runtime.dist import link_model
from adapipe_cli.runtime.dist_transport import DistTransport

SHAPE = (2, 3)


class Work:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def is_completed(self) -> bool:
        return False  # gloo: a send is complete only once it is waited for

    def wait(self) -> None:
        self.log.append(self.name)


class Recorder:
    """The few torch.distributed calls the transport makes, recorded."""

    def __init__(self):
        self.waited: list[str] = []
        self.sent = 0

    def isend(self, tensor, dst, group=None):
        self.sent += 1
        return Work(self.waited, f"send{self.sent}")

    def irecv(self, buf, src, group=None):
        buf.fill_(7.0)
        return Work([], "recv")

    def all_gather(self, parts, flat, group=None):
        for p in parts:
            p.copy_(flat)


@pytest.fixture
def fake(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(dist_transport, "dist", rec)
    return rec


def transport(stage=0, stages=2, **kw) -> DistTransport:
    groups = {(c, 0): None for c in dist_transport.CHANNELS}
    return DistTransport(stage, stages, groups, lambda channel, key: SHAPE, torch.device("cpu"), **kw)


def test_pending_sends_are_bounded_by_the_window_oldest_first(fake):
    tr = transport(window=3)
    for mb in range(5):
        tr.send("act", 0, 1, mb, torch.ones(SHAPE))
    assert fake.waited == ["send1", "send2"]  # the 4th and 5th sends wait for the two oldest
    assert tr.pending_sends() == 3
    tr.send("grad", 0, 1, 0, torch.ones(SHAPE))  # each channel has its own window
    assert fake.waited == ["send1", "send2"] and tr.pending_sends() == 4


def test_a_collective_over_every_stage_completes_every_send(fake):
    tr = transport(window=10)
    for mb in range(3):
        tr.send("act", 0, 1, mb, torch.ones(SHAPE))
    (total,) = tr.reduce(("norm", 0), 0, (0, 1), [torch.tensor([1.0, 2.0])])
    assert total.tolist() == [2.0, 4.0]
    assert fake.waited == ["send1", "send2", "send3"] and tr.pending_sends() == 0


def test_released_receive_buffers_are_reused_and_others_are_not(fake):
    tr = transport(stage=1, ahead=True)
    a = tr.recv("act", 0, 1, 0)  # and the next receive is posted at once, into a fresh buffer
    a.requires_grad_(True)  # (the executor makes it a leaf of the stage's graph)
    b = tr.recv("act", 0, 1, 1)
    assert b.data_ptr() != a.data_ptr()
    tr.release("act", a)
    c = tr.recv("act", 0, 1, 2)  # posted before a came back: fresh
    d = tr.recv("act", 0, 1, 3)  # posted after: a's buffer again
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert d.data_ptr() == a.data_ptr() and not d.requires_grad and d.eq(7.0).all()
    g = tr.recv("grad", 0, 1, 0)
    assert g.data_ptr() != a.data_ptr()  # pools are per channel


def test_the_link_of_a_pipeline_is_the_mean_of_its_pairs():
    pairs = [{"latency_s": 1e-4, "bandwidth": 1e9, "bytes": 100, "rounds": 20},
             {"latency_s": 3e-4, "bandwidth": 3e9, "bytes": 100, "rounds": 20}]
    link = link_model(pairs)
    assert link["latency_s"] == pytest.approx(2e-4) and link["bandwidth"] == pytest.approx(2e9)
    assert link["pairs"] == pairs
    assert link["thread_cpu_s"] == 0.0  # (pairs from before it was measured)
    pairs[0]["thread_cpu_s"], pairs[1]["thread_cpu_s"] = 1e-5, 3e-5
    assert link_model(pairs)["thread_cpu_s"] == pytest.approx(2e-5)
