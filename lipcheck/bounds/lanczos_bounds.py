"""Lanczos on T^T T inside a certification: the guide vector the deflated bound's token functions follow, the
certified lower bound ||T v|| / ||v|| at a Ritz vector (a symbol-guided start on grids of many tokens), the run
continued for the dense Gram's guess, and the probabilistic upper bound (Kuczynski-Wozniakowski, which needs a start
uniform on the sphere). Every function reads and updates a `certify_run._Run`."""
from __future__ import annotations

import math
from typing import Callable

import torch

from . import spectral as sp
from .certify_run import _Run


def check_schedule(steps_cap: int) -> list[int]:
    """The Lanczos steps at which the stopping rule may look at the bound: every CHECK_EVERY steps, and the
    last step. Fixed before the run, so a union bound over it covers whichever check stops the run."""
    return sorted(set(range(sp.CHECK_EVERY, steps_cap + 1, sp.CHECK_EVERY)) | {steps_cap})


# the deflated bound's guide below the symbol-start grids: Lanczos steps from a Gaussian start of this seed (a Ritz
# vector after 40 steps already puts T's top singular vector nearly inside U: C = 192 frozen at 64 x 64, k = 24, half
# of them its token profiles, left Theorem D4 2.2e-7 above ||T|| instead of 3.5e-4)
GUIDE_STEPS = 40
GUIDE_SEED = 0
# the dense Gram's guess: Lanczos on T^T T continued from the guide for up to this many steps, stopped once theta
# moved by at most 1e-12 (relative) over 10 steps (the Ritz value must be within its first pad, 1e-7, of lambda_max)
DENSE_LANCZOS_STEPS = 300
# the probabilistic Lanczos run stops where its bound cannot beat the deterministic one by the last planned check and
# theta grew by at most STALL x target_gap (relative) since the check before (the lower bound moved by half that)
STALL = 1e-3
def _continued_lanczos(run: _Run) -> float:
    """theta: Lanczos on T^T T from the guide for up to DENSE_LANCZOS_STEPS steps, stopped once theta moved by at
    most 1e-12 relative over 10 steps; the guide and its lower bound replaced where v's is larger."""
    hist = []

    def stop(theta: float, j: int) -> bool:
        hist.append(theta)
        return j >= 20 and abs(theta - hist[-10]) <= 1e-12 * abs(theta)

    theta, v, _ = sp.lanczos(_operator(run), run.guide, max(2, min(_steps_cap(run), DENSE_LANCZOS_STEPS)), stop=stop)
    lower = _lower_of(run, v)
    if lower > (run.guide_lower or 0.0):
        run.guide, run.guide_lower = v, lower
    return theta






def _steps_cap(run: _Run) -> int:
    return int(max(2, min(run.o.max_steps, run.o.memory_bytes // (8 * run.n))))


def _symbol_start(run: _Run) -> bool:
    return run.o.symbol_start and run.H * run.W >= run.o.symbol_start_tokens


def _guide(run: _Run) -> torch.Tensor:
    """An approximate top right singular vector of T for the deflated bound's token functions (any vector keeps it
    sound): the symbol-guided Lanczos Ritz vector on grids of many tokens (the lower bound reuses it), else
    GUIDE_STEPS Lanczos steps from a Gaussian start of a fixed seed (the same call, the same vector)."""
    if run.guide is None:
        if _symbol_start(run):
            symbol_start_lower(run, _steps_cap(run))
        else:
            gen = torch.Generator(device="cpu").manual_seed(GUIDE_SEED)
            v0 = torch.randn(1, run.H, run.W, run.q.dim, generator=gen, dtype=run.o.dtype).to(run.q.WV.device)
            _, v, _ = sp.lanczos(_operator(run), v0, max(2, min(_steps_cap(run), GUIDE_STEPS)))
            run.guide, run.guide_lower = v, _lower_of(run, v)
    return run.guide


def _lower_of(run: _Run, v: torch.Tensor) -> float:
    """||T v|| / ||v|| (normalised units) less its rounding: a certified lower bound on ||T||."""
    q = run.q
    r = float(sp.apply_T(v, q).norm() / v.norm())
    sp._finite(r, "Lanczos Rayleigh quotient")
    return max(0.0, r * (1 - q.gamma(2 * run.n + 4)) - run.apply_err)


def _operator(run: _Run) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda v: sp.apply_T_adjoint(sp.apply_T(v, run.q), run.q)


def symbol_start_lower(run: _Run, steps_cap: int) -> float:
    """Lanczos from a plane wave at the circulant argmax times the top singular direction of S there, under a sine
    window: a lower bound (normalised units) on grids of many tokens, where a random start needs many steps."""
    q, H, W, o, circ = run.q, run.H, run.W, run.o, run.circ
    dtype, dev = o.dtype, q.WV.device
    cs = sp.symbol_coefficients(q, torch.tensor([circ.argmax[0]], dtype=dtype, device=dev),
                                torch.tensor([circ.argmax[1]], dtype=dtype, device=dev))
    with sp.single_thread():
        U = torch.linalg.svd(run.sn.matrix(cs)).U[0, :, 0]
    iy = torch.arange(H, dtype=dtype, device=dev)
    ix = torch.arange(W, dtype=dtype, device=dev)
    win = torch.sin(math.pi * (iy[:, None] + 1) / (H + 1)) * torch.sin(math.pi * (ix[None, :] + 1) / (W + 1))
    phase = torch.exp(1j * (circ.argmax[0] * iy[:, None] + circ.argmax[1] * ix[None, :]))
    s0 = (win * phase)[..., None] * U.conj()[None, None, :]
    s0 = s0.real if float(s0.real.norm()) > float(s0.imag.norm()) else s0.imag
    s0 = s0[None].to(dtype)
    theta2, v2, k2 = sp.lanczos(_operator(run), s0, max(2, min(steps_cap, o.symbol_steps)), progress=o.progress)
    lower = _lower_of(run, v2)
    run.guide, run.guide_lower = v2, lower
    run.info["lanczos_symbol_start"] = dict(steps=k2, theta=theta2,
                                            lower=sp._scale_back(lower, run.q.log2_scale, up=False))
    return lower


def probabilistic_upper(run: _Run, steps_cap: int, seed: int) -> tuple[float, float]:
    """(upper bound holding with probability >= 1 - failure_probability in the layer's units, the lower bound of
    its Ritz vector in normalised units): Lanczos from a Gaussian start, stopped at a planned check once both are
    within the target gap of the best lower bound known (this run's or the symbol start's), or once theta has
    stalled where no planned check can bring the probabilistic bound below the deterministic one (`STALL`); the
    failure probability is split over the checks planned (a union bound), so any such rule keeps it."""
    q, o, n, e2 = run.q, run.o, run.n, run.q.log2_scale
    upper_n = math.ldexp(run.upper, -e2)  # the deterministic bound in normalised units, for the stopping rule
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    v0 = torch.randn(1, run.H, run.W, q.dim, generator=gen, dtype=o.dtype).to(q.WV.device)
    schedule = set(check_schedule(min(steps_cap, n)))
    delta_each = o.failure_probability / len(schedule)
    # theta is a verified upper bound on the top eigenvalue of the stored tridiagonal (Cholesky); the
    # tridiagonal's own entries carry the rounding of the recurrence, <= gamma_(4n+8) B^2 (proofs/S2.md)
    theta_err = q.gamma(4 * n + 8) * run.B ** 2
    # where the dense value closed the upper bound, run Lanczos until the lower bound meets it too
    gap_goal = o.target_gap if run.exact is None else min(o.target_gap, 1e-8)
    eps_last = sp.kw_epsilon(n, max(schedule), delta_each)
    known = run.guide_lower or 0.0  # the symbol start's (or the guide's) certified lower bound, normalised units
    checks, thetas, stalled = [], [], []

    def stop(theta, j):
        if j not in schedule:
            return False
        checks.append(j)
        thetas.append(theta)
        if run.late("upper_probabilistic"):  # at a planned check only: the union bound stays as planned
            return True
        if hopeless(theta):
            stalled.append(j)
            return True
        eps = sp.kw_epsilon(n, j, delta_each)
        up = math.sqrt(max(theta + theta_err, 0.0) / (1 - eps)) if eps < 1 else math.inf
        # the gap to the best lower bound known: where the symbol start's already meets the goal, a few steps do
        return (min(up, upper_n) / max(math.sqrt(max(theta, 1e-300)), known) - 1) <= gap_goal * 0.9

    def hopeless(theta):
        # theta only grows, so where even the last planned check's epsilon leaves the probabilistic bound above the
        # deterministic one, the run can only still raise the lower bound: stop once theta has stalled (C = 384
        # frozen kernels at 64 x 64: 158 steps, 67 s, for a lower bound 7e-11 above the symbol start's)
        if eps_last < 1 and math.sqrt(theta / (1 - eps_last)) < upper_n:
            return False
        # (the floor: the verified theta creeps by ~1e-14 relative per check once converged)
        return len(thetas) >= 2 and theta - thetas[-2] <= STALL * max(gap_goal, 1e-9) * theta

    theta, v, steps = sp.lanczos(_operator(run), v0, steps_cap, stop=stop, progress=o.progress, verified=True)
    sp._finite(theta, "Lanczos Ritz value")
    eps = sp.kw_epsilon(n, steps, delta_each)
    up_prob_n = math.sqrt(max(theta + theta_err, 0.0) / (1 - eps)) if eps < 1 else math.inf
    up_prob = sp._scale_back(up_prob_n, e2, up=True) if math.isfinite(up_prob_n) else math.inf
    run.info["lanczos"] = dict(steps=steps, theta=theta, kw_epsilon=eps, n=n, checks=checks, stalled=bool(stalled),
                               schedule_size=len(schedule), failure_probability_per_check=delta_each)
    run.method["upper_probabilistic"] = (f"Lanczos, {steps} steps from a Gaussian start (seed {seed}), "
                                         f"Kuczynski-Wozniakowski bound (relative eigenvalue error {eps:.3g}), "
                                         f"failure probability split over {len(schedule)} planned checks")
    return up_prob, _lower_of(run, v)
