"""Continuous depth: the autonomous vector field F(x) = Mixer(LN1(x)) + MLP(LN2(x)) and its flow.

`VectorField` counts evaluations (NFE) and watches the state, so that a solver failure surfaces as
an `IntegrationError` carrying t, NFE and the state norm instead of a bare assertion. `integrate`
is the one call into torchdiffeq; `ODEFlow` is the thin module the ODE ViT uses.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torchdiffeq
from torchdiffeq._impl.odeint import SOLVERS as _TORCHDIFFEQ_SOLVERS

SOLVERS = tuple(sorted(_TORCHDIFFEQ_SOLVERS))
FIXED_STEP = ("euler", "midpoint", "heun3", "rk4", "explicit_adams", "implicit_adams")


class IntegrationError(RuntimeError):
    """An ODE solve failed: step-size underflow, too many steps or a non-finite state."""

    def __init__(self, message: str, *, t: float, nfe: int, state_norm: float):
        super().__init__(f"{message} (t={t:.6g}, nfe={nfe}, |x|={state_norm:.6g})")
        self.t, self.nfe, self.state_norm = t, nfe, state_norm


class VectorField(nn.Module):
    """F(t, x) = block.vector_field(x) on (B, H, W, C); autonomous (t is ignored), NFE counted."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.nfe = 0
        self.last_t, self.last_norm = 0.0, 0.0

    def forward(self, t, x: torch.Tensor) -> torch.Tensor:
        self.nfe += 1
        self.last_t = float(t.detach()) if torch.is_tensor(t) else float(t)
        self.last_norm = float(x.detach().norm())
        if not math.isfinite(self.last_norm):
            raise IntegrationError("non-finite state", t=self.last_t, nfe=self.nfe, state_norm=self.last_norm)
        return self.block.vector_field(x)


def per_sample_rms_norm(batch_size: int):
    """Error norm for torchdiffeq: the worst per-sample RMS, so no sample hides behind the batch mean."""
    def norm(e):
        if isinstance(e, tuple):  # adjoint passes tuples
            return max(norm(x) for x in e) if e else torch.tensor(0.0)
        if e.dim() == 0 or e.shape[0] != batch_size:
            return e.pow(2).mean().sqrt()
        return e.reshape(batch_size, -1).pow(2).mean(1).sqrt().max()
    return norm


def check_solver_args(method: str, rtol: float, atol: float) -> None:
    if method not in SOLVERS:
        raise ValueError(f"unknown solver method {method!r}; choose one of {SOLVERS}")
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
            raise ValueError(f"{name} must be a positive finite number, got {tol!r}")


def integrate(field: VectorField, x0: torch.Tensor, t: torch.Tensor, *, method: str = "dopri5",
              rtol: float = 1e-7, atol: float = 1e-9, options: dict | None = None, adjoint: bool = False,
              per_sample_norm: bool = True) -> torch.Tensor:
    """Solve x' = F(x) from x0 at times t (1-D, increasing); returns (len(t), *x0.shape).

    Raises IntegrationError (t, NFE, state norm) on step-size underflow, too many steps or a
    non-finite state; ValueError on unknown methods and non-positive tolerances.
    """
    check_solver_args(method, rtol, atol)
    if not torch.isfinite(x0).all():
        raise ValueError("x0 must be finite (got NaN or inf in the initial state)")
    options = dict(options or {})
    if per_sample_norm and method not in FIXED_STEP and "norm" not in options:
        options["norm"] = per_sample_rms_norm(x0.shape[0])
    solve = torchdiffeq.odeint_adjoint if adjoint else torchdiffeq.odeint
    kwargs = dict(rtol=rtol, atol=atol, method=method, options=options)
    if adjoint:
        kwargs["adjoint_options"] = {"norm": "seminorm"}
    try:
        return solve(field, x0, t, **kwargs)
    except IntegrationError:
        raise
    except (AssertionError, RuntimeError) as e:
        msg = str(e)
        if "underflow" in msg:
            reason = "step-size underflow"
        elif "max_num_steps" in msg:
            reason = "too many steps"
        else:
            raise
        raise IntegrationError(f"{reason}: {msg}", t=field.last_t, nfe=field.nfe, state_norm=field.last_norm) from e


class ODEFlow(nn.Module):
    """x0 -> x(t1), the solver settings held as attributes so experiments can change them."""

    def __init__(self, field: VectorField, *, t1: float = 1.0, method: str = "dopri5", rtol: float = 1e-3,
                 atol: float = 1e-3, options: dict | None = None, adjoint: bool = False):
        super().__init__()
        check_solver_args(method, rtol, atol)
        if not t1 > 0:
            raise ValueError(f"t1 must be positive, got {t1}")
        self.field, self.t1 = field, float(t1)
        self.method, self.rtol, self.atol, self.options, self.adjoint = method, rtol, atol, options, adjoint
        self.last_nfe = 0

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        self.field.nfe = 0
        t = torch.tensor([0.0, self.t1], dtype=x0.dtype, device=x0.device)
        out = integrate(self.field, x0, t, method=self.method, rtol=self.rtol, atol=self.atol,
                        options=self.options, adjoint=self.adjoint)[-1]
        self.last_nfe = self.field.nfe
        return out
