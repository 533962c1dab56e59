"""Stiffer fields and tighter tolerances for the proven enclosure (proofs/S5.md, Theorem 6): the reference solve is
aimed at a tube the curvature allows, cut where its own defect is large, and refused where float64 cannot reach.

The models are the tiny ones of tests/test_enclosure_tightness.py (gain g: the block's Linear weights drawn
N(0, g^2 / fan_in)); the truth is scipy's DOP853 at rtol = atol = 1e-13, independent of lipcheck's solvers.
"""
import math

import pytest
import torch

from lipcheck import wellposed as wp
from lipcheck.wellposed import enclosure as E

from test_enclosure_tightness import _actual, _images, _model

D = torch.float64


@pytest.mark.usefixtures("one_thread")
def test_gain_4_is_proven_and_holds_an_independent_solve():
    """Gain 4 (point log-norms 10-28, curvature M2 up to 3e3). On [0, 1] the reference's radius ran into the
    variance floor before it was aimed at the tube REF_TUBE / M2 (not proven; now proven, 90 s); here on [0, 0.2]
    (int mu ~ 4) to keep the test short."""
    model, images = _model(gain=4.0), _images(1)
    model.flow.t1 = 0.2
    enc = wp.enclose(model, images, progress=False)
    assert enc.proven.all(), enc.reason
    actual = _actual(model, images, enc)
    assert (actual <= enc.radius.numpy()).all()  # every returned time
    assert float(enc.radius[-1, 0]) <= 1.1 * actual[-1, 0]  # tight: the reference's radius is small against y's


@pytest.mark.usefixtures("one_thread")
def test_tol_1e9_at_gain_1_is_proven_and_tight():
    """tol 1e-9: the reference at 1e-11 (REF_FLOOR), its steps cut where the remainder would need more than half
    of max_per_step sub-intervals."""
    model, images = _model(), _images(1)
    enc = wp.enclose(model, images, tol=1e-9, progress=False)
    assert enc.proven.all(), enc.reason
    actual = _actual(model, images, enc)
    assert (actual <= enc.radius.numpy()).all()
    assert float(enc.radius[-1, 0]) <= 1.5 * actual[-1, 0], (enc.radius[-1], actual[-1])


def test_gain_8_is_refused_with_the_constant_that_blocks_it():
    """Gain 8: int mu along y ~ 18 and M2 ~ 2e4: the tube REF_TUBE / M2 would need a reference defect below
    REF_REACH sup ||y'||. Refused before any proof, with those numbers; nothing claimed beyond t = 0."""
    model, images = _model(gain=8.0), _images(1)
    enc = wp.enclose(model, images, progress=False)
    assert not enc.proven.any() and math.isinf(float(enc.radius[-1, 0]))
    why = enc.reason[0]
    assert why.startswith("not attempted") and "M2 = " in why and "float64's reach" in why
    assert enc.stats["refused"] is True and enc.stats["method_kind"] == "refused"
    assert enc.stats["seconds"]["total"] < 30


def test_a_work_budget_refuses_before_any_proof_with_the_prediction_and_its_constants():
    """max_work below the reference enclosure's predicted defect sub-intervals: refused before any proof (nothing
    claimed beyond t = 0), the reason giving the count, max_work, the curvature and the Lipschitz constant; the
    default budget proves the same image (no clock enters the choice: the same on any machine and under load)."""
    model, images = _model(), _images(1)
    enc = wp.enclose(model, images, max_work=1.0, progress=False)
    assert not enc.proven.any() and math.isinf(float(enc.radius[-1, 0]))
    assert enc.stats["refused"] is True and enc.stats["seconds"]["total"] < 30
    why = enc.reason[0]
    assert why.startswith("not attempted: the reference enclosure would need about") and "max_work = 1" in why
    assert "M2 = " in why and "L = " in why and "a larger max_work (or None) tries it" in why
    G = wp.lognorm_envelope(enc, torch.tensor([1e-3], dtype=D))  # nothing proven: no growth bound after t = 0
    assert G.shape == (len(enc.t), 1) and float(G[0, 0]) == 1.0 and math.isinf(float(G[-1, 0]))
    v = float(why.split("token variance ")[1].split(",")[0])  # the variance its constants were taken at, reported
    assert enc.stats["variance_floor"] == pytest.approx(v, rel=5e-3) and v > 0
    assert wp.enclose(model, images, progress=False).proven.all()  # default max_work = REF_WORK_BUDGET


def test_the_work_budget_is_a_strict_bound_on_the_predicted_count(monkeypatch):
    """_over_budget refuses exactly when the predicted work (the sum of `_sub_intervals` over y_ref's steps plus
    LOGNORM_WORK times the sum of `_lognorm_points`) is above max_work: 7 sub-intervals and 3 point log-norms pass
    max_work = 7 + 3 LOGNORM_WORK and are refused just below; a NaN prediction is not refused here (the proof then
    says what fails); one reason per sample, each with its own defect target."""
    monkeypatch.setattr(E, "_sub_intervals", lambda field, steps, coefs, target: torch.tensor([3.0, 4.0], dtype=D))
    monkeypatch.setattr(E, "_lognorm_points", lambda *a: torch.tensor([1.0, 2.0], dtype=D))
    monkeypatch.setattr(E, "_tube_aim", lambda field, steps, coefs: (0.1, 2.5, 0.04))
    work = 7 + 3 * E.LOGNORM_WORK
    coefs = [torch.zeros(5, 2, 1, 1, 3, dtype=D)]

    class F:
        def lipschitz(self, v):
            assert v == 0.04
            return 9.5

    pieces = ([(0.0, 1.0)], coefs)
    assert E._over_budget(F(), pieces, torch.tensor([1e-7, 2e-7], dtype=D), work) is None
    why = E._over_budget(F(), pieces, torch.tensor([1e-7, 2e-7], dtype=D), work - 0.001)
    assert len(why) == 2 and all(f"about {work:.3g} field evaluations (7 defect sub-intervals and 3 point log-norms "
                                 f"at {E.LOGNORM_WORK} each)" in w and f"max_work = {work - 0.001:.6g}" in w for w in why)
    assert "M2 = 2.5 " in why[0] and "L = 9.5 " in why[0] and "token variance 0.04" in why[0]
    assert "reference defect of 1e-07" in why[0] and "reference defect of 2e-07" in why[1]
    assert len(E._over_budget(F(), pieces, 3e-6, 1.0)) == 2  # a given target (ref_defect_abs): the same for both
    monkeypatch.setattr(E, "_sub_intervals", lambda *a: torch.tensor([math.nan], dtype=D))
    assert E._over_budget(F(), pieces, 3e-6, 1.0) is None


def test_predicted_lognorm_points_follow_the_lognorm_grid(monkeypatch):
    """_lognorm_points per step: max(1, ceil(M2 sup ||y'|| h / (2 slack))) + 1 (`direct.lognorm_grid`'s intervals and
    the step's end): one token moving at speed 1 on a step of h = 0.5 with M2 = 7 asks for ceil(1.75) = 2 log-norm
    intervals at slack 1 (3 points), 7 at slack 0.25 (8 points); a token at rest for one (2 points)."""
    monkeypatch.setattr(E, "_tube_aim", lambda field, steps, coefs: (0.1, 7.0, 0.0))
    c = torch.zeros(5, 1, 1, 1, 3, dtype=D)
    c[1, 0, 0, 0] = torch.tensor([0.0, 0.3, 0.4], dtype=D)  # y' = c_1 / h: speed 0.5 / 0.5 = 1
    rest = torch.zeros_like(c)
    pts = lambda slack: E._lognorm_points(None, [(0.0, 0.5), (0.5, 1.0)], [c, rest], slack).tolist()
    assert pts(1.0) == [3.0, 2.0] and pts(0.25) == [8.0, 2.0]
