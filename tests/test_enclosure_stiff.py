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
    v = float(why.split("token variance ")[1].split(",")[0])  # the variance its constants were taken at, reported
    assert enc.stats["variance_floor"] == pytest.approx(v, rel=5e-3) and v > 0
    assert wp.enclose(model, images, progress=False).proven.all()  # default max_work = REF_WORK_BUDGET


def test_the_work_budget_is_a_strict_bound_on_the_predicted_count(monkeypatch):
    """_over_budget refuses exactly when the predicted count (the sum of `_sub_intervals` over y_ref's steps) is
    above max_work: 7 sub-intervals pass max_work = 7 and are refused at 6.999; a NaN prediction is not refused
    here (the proof then says what fails); one reason per sample, each with its own defect target."""
    monkeypatch.setattr(E, "_sub_intervals", lambda field, steps, coefs, target: torch.tensor([3.0, 4.0], dtype=D))
    monkeypatch.setattr(E, "_tube_aim", lambda field, steps, coefs: (0.1, 2.5, 0.04))
    coefs = [torch.zeros(5, 2, 1, 1, 3, dtype=D)]

    class F:
        def lipschitz(self, v):
            assert v == 0.04
            return 9.5

    pieces = ([(0.0, 1.0)], coefs)
    assert E._over_budget(F(), pieces, torch.tensor([1e-7, 2e-7], dtype=D), 7) is None
    why = E._over_budget(F(), pieces, torch.tensor([1e-7, 2e-7], dtype=D), 6.999)
    assert len(why) == 2 and all("about 7 defect sub-intervals" in w and "max_work = 6.999" in w for w in why)
    assert "M2 = 2.5 " in why[0] and "L = 9.5 " in why[0] and "token variance 0.04" in why[0]
    assert "reference defect of 1e-07" in why[0] and "reference defect of 2e-07" in why[1]
    assert len(E._over_budget(F(), pieces, 3e-6, 1.0)) == 2  # a given target (ref_defect_abs): the same for both
    monkeypatch.setattr(E, "_sub_intervals", lambda *a: torch.tensor([math.nan], dtype=D))
    assert E._over_budget(F(), pieces, 3e-6, 1.0) is None


class _Stub:
    """A field with constant point log-norm lam and curvature K (no variance floor)."""
    uses_variance = False

    def __init__(self, lam, K):
        self.lam, self.K = lam, K

    def lognorm(self, y, v, eps_J):
        return torch.full((y.shape[0],), self.lam, dtype=D)

    def curvature(self, v):
        return self.K

    def lipschitz(self, v):
        return 1.0


def _unit_speed_pieces(monkeypatch):
    """y with y' = 1 on two steps of [0, 1] (sup ||y'|| = 1), its distance to the reference 1 at every node."""
    monkeypatch.setattr(E, "_node_distances", lambda *a: (torch.tensor([1.0]), torch.tensor([1.0])))
    steps = [(0.0, 0.5), (0.5, 1.0)]
    coefs = [torch.zeros(5, 1, 1, 1, 2, dtype=D) for _ in steps]
    for c in coefs:
        c[1, 0, 0, 0, 0] = 0.5
    return steps, coefs


def test_defect_target_keeps_the_tube_below_its_share_of_one_over_the_curvature(monkeypatch):
    """target = max(min(the share aim, REF_TUBE / (K 2 t1 phi(g))), REF_REACH sup ||y'||), g = lam t1: the tube
    aim wins over the work floor where the curvature is large, and the reach floor over both."""
    steps, coefs = _unit_speed_pieces(monkeypatch)
    for lam, K in ((2.0, 1e3), (2.0, 1e-3), (30.0, 1e9)):
        got, needed = E._defect_target(_Stub(lam, K), (steps, coefs), ([], []), 1.0, 0.02)
        got = float(got[0])
        phi = math.expm1(lam) / lam
        share = min(0.02, max(0.1 / (2 * phi), 0.02 * 1e-3))
        want = max(min(share, 0.25 / K / (2 * phi)), 1e-12)
        assert got == pytest.approx(want, rel=1e-12), (lam, K, got, want)
        assert needed == (0.25 / K / (2 * phi) < share)
    assert E._out_of_reach(_Stub(30.0, 1e9), steps, coefs, 1.0) is not None  # 0.25 / 1e9 / (2 e^30 / 30) < 1e-12
    assert E._out_of_reach(_Stub(2.0, 1e3), steps, coefs, 1.0) is None


def test_defect_target_trusts_a_contraction_only_down_to_int_mu_minus_30(monkeypatch):
    """int mu is estimated from point log-norms along y alone (no tube), so the share aim trusts a contraction only
    down to g = -30: at g = -100 it asks for 0.1 / (2 phi(-30)) (phi(-30) ~ 1/30), not 0.1 / (2 phi(-100)) = 5; the
    tube aim takes g as it is."""
    steps, coefs = _unit_speed_pieces(monkeypatch)
    lam, K, ratio = -100.0, 1e-3, 10.0  # ratio * rough / t1 = 10: the work cap stays out of the way
    got, needed = E._defect_target(_Stub(lam, K), (steps, coefs), ([], []), 1.0, ratio)
    phi = lambda g: math.expm1(g) / g  # noqa: E731
    share = min(ratio, max(0.1 / (2 * phi(-30.0)), ratio * 1e-3))
    tube = 0.25 / K / (2 * phi(lam))
    assert float(got[0]) == pytest.approx(max(min(share, tube), 1e-12), rel=1e-12) and not needed
    assert float(got[0]) < 0.5 * 0.1 / (2 * phi(lam))
