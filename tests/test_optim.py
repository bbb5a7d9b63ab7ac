"""Muon's Newton-Schulz iteration in a dtype that is fast on the device, against torch.optim.Muon;
the learning rates whose first step overflows float32."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

from adapipe_cli import optim
from adapipe_cli.optim import Muon, StageOptimizer, ns_dtype, overflowing_lr, zeropower_newton_schulz
from helpers import optim_cfg

COEF = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
SHAPES = [(16, 32), (32, 16), (24, 24)]
# fp32 against torch's bf16 iteration: bf16 keeps 8 bits of mantissa, so the two orthogonalized
# matrices differ by about 1.5% (relative Frobenius norm) on these shapes; 3% is the bound we state
REL_TOL = 0.03


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_matches_torch(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ref = _zeropower_via_newtonschulz(g, COEF, 5, 1e-7)
    assert torch.equal(zeropower_newton_schulz(g, COEF, 5, 1e-7, torch.bfloat16), ref)  # bf16: torch's, exactly
    f32 = zeropower_newton_schulz(g, COEF, 5, 1e-7, torch.float32)
    assert f32.dtype == torch.float32 and _rel(f32, ref) < REL_TOL


def test_newton_schulz_leaves_its_input_alone():
    g = torch.randn(8, 16)
    before = g.clone()
    zeropower_newton_schulz(g, COEF, 5, 1e-7, torch.float32)
    assert torch.equal(g, before)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_match_torch_muon(nesterov):
    """Three steps on fixed gradients: bf16 gives torch.optim.Muon's weights bit for bit, fp32 the
    same updates within REL_TOL."""
    kw = dict(lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=nesterov)
    ref_p, bf_p, f32_p = _params(1), _params(1), _params(1)
    start = [p.detach().clone() for p in ref_p]
    opts = [torch.optim.Muon(ref_p, **kw), Muon(bf_p, ns_dtype="bfloat16", **kw), Muon(f32_p, ns_dtype="float32", **kw)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in ref_p]
        for ps, opt in zip((ref_p, bf_p, f32_p), opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for r, b, f, s in zip(ref_p, bf_p, f32_p, start):
        assert torch.equal(r, b)
        assert _rel(f - s, r - s) < REL_TOL  # the weights' change, not the weights, carries the difference


def test_ns_dtype_is_fp32_on_a_cpu_without_fast_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert ns_dtype(torch.device("cpu")) == torch.float32
    assert ns_dtype(torch.device("cuda")) == torch.bfloat16
    assert ns_dtype(torch.device("cpu"), "bfloat16") == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert ns_dtype(torch.device("cpu")) == torch.bfloat16


def test_optim_muon_iterates_in_fp32_on_such_a_cpu(monkeypatch):
    """What a run's Muon (optim=muon, muon_ns_dtype=auto) computes in on a CPU without fast bf16."""
    monkeypatch.setattr(optim, "fast_bf16", lambda device: False)
    seen = []
    real = optim.zeropower_newton_schulz
    monkeypatch.setattr(optim, "zeropower_newton_schulz", lambda g, c, n, e, dtype: seen.append(dtype) or real(g, c, n, e, dtype))
    layer = torch.nn.Linear(8, 8)
    opt = StageOptimizer([("blocks.0.fc.weight", layer.weight), ("blocks.0.fc.bias", layer.bias)], optim_cfg(name="muon"))
    layer(torch.randn(4, 8)).sum().backward()
    opt.step(1.0)
    assert seen == [torch.float32]


FLOAT32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("name", ["adamw", "nadamw", "muon"])
def test_a_first_step_beyond_float32_is_found_at_each_optimizers_closed_form(name):
    """AdamW's first step is lr / (1 - beta1) (beta1 = 0.9: 10 lr), NAdamW's lr (its look-ahead
    moment is corrected by 1 - beta1^2), Muon's muon_lr sqrt(rows/cols) (an MLP's up projection:
    2 muon_lr); just below each bound no key, just above it the key of that rate."""
    key, bound = {"adamw": ("lr", FLOAT32_MAX * (1 - 0.9)), "nadamw": ("lr", FLOAT32_MAX),
                  "muon": ("muon_lr", FLOAT32_MAX / 2)}[name]
    assert overflowing_lr(optim_cfg(name=name, **{key: 0.9 * bound})) is None
    assert overflowing_lr(optim_cfg(name=name, **{key: 1.1 * bound})) == f"optim.{key}"
    quarter = optim_cfg(name=name, **{key: 0.9 * bound / 4})  # times the largest scale a step uses
    assert overflowing_lr(quarter, scale=4) is None and overflowing_lr(quarter, scale=5) == f"optim.{key}"
