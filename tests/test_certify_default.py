"""The default certification: the tightest method the size rule fits (the deflated bound where the dense SVD does not
apply), CertifyOptions and the old keywords, lipcheck.certify on layers and models, refusals."""
import importlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lipcheck
import lipcheck.rounding
from lipcheck.bounds import CertifyOptions, plan, ssog_lipschitz
from lipcheck.bounds import deflation as df
from lipcheck.bounds import lipschitz
from lipcheck.mixers.ssog import SIGMA_FLOOR

F64 = torch.float64
# the deflated path on grids small enough for a dense reference: the dense SVD and Gram iteration switched off, and
# the resolution-free branch and bound (a separate statement, never the winner here) left out to keep the tests lean
NO_DENSE = dict(exact_max=0, gram_max=0, resolution_free=False)


def layer_of(C, heads, M, seed, mu_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    layer = lipcheck.SSoG(C, heads, M, dtype=F64)
    with torch.no_grad():
        layer.alpha.copy_(torch.randn(heads, M, generator=g, dtype=F64))
        layer.mu.copy_(mu_scale * torch.randn(heads, M, 2, generator=g, dtype=F64))
        layer.sigma_raw.copy_(torch.randn(heads, M, 2, generator=g, dtype=F64))
        layer.v_proj.weight.copy_(torch.randn(C, C, generator=g, dtype=F64) / math.sqrt(C))
        layer.o_proj.weight.copy_(torch.randn(C, C, generator=g, dtype=F64) / math.sqrt(C))
        layer.o_proj.bias.copy_(torch.randn(C, generator=g, dtype=F64))
    return layer


def dense_norm(layer, H, W):
    """||T||_2 from the layer's own forward pass minus its bias on every basis vector (no lipcheck bound code)."""
    C = layer.v_proj.in_features
    n = H * W * C
    with torch.no_grad():
        lay = layer.double()
        b = lay(torch.zeros(1, H, W, C, dtype=F64))
        T = (lay(torch.eye(n, dtype=F64).reshape(n, H, W, C)) - b).reshape(n, n)
    return float(np.linalg.norm(T.numpy(), 2))


@settings(max_examples=4)
@given(H=st.integers(3, 6), W=st.integers(3, 6), heads=st.integers(1, 2), d=st.integers(1, 4),
       M=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_default_is_the_deflated_bound_where_the_dense_svd_is_off(H, W, heads, d, M, seed):
    """With the dense stages off, the size rule picks the deflated bound; it brackets the dense norm and closes the
    gap to 1e-3 (Lanczos meets it from below)."""
    layer = layer_of(heads * d, heads, M, seed)
    r = ssog_lipschitz(layer, H, W, seed=seed, **NO_DENSE)
    exact = dense_norm(layer, H, W)
    assert r.lower <= exact * (1 + 1e-12) and exact <= r.upper * (1 + 1e-12), (r.lower, exact, r.upper)
    assert r.budget["deflated"] and "deflated" in r.seconds and r.best_method in ("deflated", "circulant")
    assert r.upper <= min(r.circulant, r.closed_form)
    # (an operator at the rounding scale, a kernel shifted off the grid, has no relative gap to speak of)
    assert r.gap <= 1e-3 or exact <= 1e-9 * r.closed_form, (r.gap, r.method)
    assert not r.cut_short


def test_default_on_small_grids_is_the_verified_dense_svd():
    """No options at all: N C <= exact_max gives the Cholesky-verified dense norm, which nothing beats; the rule says
    so and runs neither the deflated bound nor the majorant."""
    layer = layer_of(6, 2, 2, 7)
    r = ssog_lipschitz(layer, 5, 4, seed=1)
    exact = dense_norm(layer, 5, 4)
    assert r.lower <= exact * (1 + 1e-12) and exact <= r.upper * (1 + 1e-12)
    assert r.best_method in ("exact", "gram") and r.gap <= 1e-6
    assert "deflated" not in r.seconds and "majorant" not in r.seconds and "exact_max" in r.budget["rule"]


def test_the_size_rule_is_units_of_work():
    """plan() reads sizes only: the deflated bound up to 128 x 128 with k C near 4608 and GRAM_BUDGET, else the
    majorant up to 64 x 64, the circulant embedding beyond; budget_s scales the work; deflated / majorant override."""
    p = plan(16, 16, 96, 3)
    assert p.deflated and p.deflation_k == 48 and p.complement == "gram" and not p.majorant and not p.exact
    assert plan(20, 12, 128, 8).deflation_k == 36  # k C near 4608, and 8^4 (k C)^2 <= GRAM_BUDGET
    # X term by term while 8^4 (k C)^2 <= GRAM_BUDGET, then through the heads' rank (8 heads of 16 channels)
    assert df.x_route(8, 38, 128) == "kron" and df.x_route(8, 39, 128) == "heads"
    assert plan(20, 12, 128, 12).deflation_k == 17  # 12 heads do not divide C = 128: 12^4 (k C)^2 <= GRAM_BUDGET binds
    p = plan(64, 64, 192, 3)
    assert p.deflated and p.deflation_k == 24 and p.complement == "gram" and not p.majorant
    assert plan(128, 128, 384, 3).deflation_k == 12
    p = plan(14, 14, 768, 12)  # X's 12^4 channel products (98 GB) do not fit; through the heads' rank 64 they do
    assert p.deflated and p.deflation_k == 10 and not p.majorant and p.rf_max_rounds == 11
    assert df.x_route(12, 10, 768) == "heads" and df.x_route(12, 10, 768, budget=1e10) is None
    # with a tenth of the budget neither X (12^4 r^3 cores alone exceed it) nor Theorem D3 (12^2 C^3) fits
    p = plan(14, 14, 768, 12, CertifyOptions(budget_s=6.0))
    assert not p.deflated and p.majorant and "GRAM_BUDGET * 0.1" in p.rule
    assert not df.gram_affordable(12, 1, 768, 1e10) and not df.d3_affordable(12, 1, 768, 1e10)
    assert plan(16, 16, 96, 3).rf_max_rounds == 200
    p = plan(129, 129, 8, 1)  # half the torus beyond MAX_TORUS_FREQUENCIES, and N > 4096
    assert not p.deflated and not p.majorant and "circulant" in p.rule
    assert plan(4, 4, 2, 1).exact and not plan(4, 4, 2, 1).deflated
    assert plan(16, 16, 96, 3, CertifyOptions(budget_s=7.5)).deflation_k == 24  # (k C)^3 scales with the budget
    assert not plan(16, 16, 96, 3, CertifyOptions(deflated=False)).deflated
    assert plan(16, 16, 96, 3, CertifyOptions(deflated=False)).majorant
    assert not plan(16, 16, 96, 3, CertifyOptions(dtype=torch.float32)).deflated  # float64 only
    assert plan(16, 16, 96, 3) == plan(16, 16, 96, 3)


def test_options_object_and_old_keywords_agree():
    layer = layer_of(8, 2, 3, 11)
    kw = dict(seed=5, target_gap=1e-4, **NO_DENSE)
    r1 = ssog_lipschitz(layer, 5, 6, **kw)
    r2 = ssog_lipschitz(layer, 5, 6, options=CertifyOptions(**kw))
    r3 = ssog_lipschitz(layer, 5, 6, options=CertifyOptions(seed=5, exact_max=0), gram_max=0, resolution_free=False,
                        target_gap=1e-4)  # keywords on top of an options object
    for r in (r2, r3):
        assert (r.upper, r.lower, r.upper_probabilistic, r.best_method) == (r1.upper, r1.lower, r1.upper_probabilistic,
                                                                            r1.best_method)
    with pytest.raises(TypeError, match="deflation_kk"):
        ssog_lipschitz(layer, 5, 6, deflation_kk=3)
    with pytest.raises(TypeError, match="CertifyOptions"):
        ssog_lipschitz(layer, 5, 6, options=dict(seed=1))
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="budget_s"):
            CertifyOptions(budget_s=bad)
    with pytest.raises(ValueError, match="deadline_s"):
        CertifyOptions(deadline_s=0)
    with pytest.raises(ValueError, match="failure_probability"):
        ssog_lipschitz(layer, 5, 6, failure_probability=1.5)


def test_a_past_deadline_cuts_stages_and_says_so():
    """deadline_s already spent: the optional stages are skipped and the result lists them; what remains is
    certified."""
    layer = layer_of(6, 2, 2, 3)
    r = ssog_lipschitz(layer, 4, 5, seed=2, deadline_s=1e-9, exact_max=0, gram_max=0)
    exact = dense_norm(layer, 4, 5)
    assert r.cut_short and {"resolution_free", "deflated", "dense_gram"} <= set(r.budget["cut"])
    assert set(r.budget["cut"]) <= set(lipschitz.METHODS) | {"lower", "upper_probabilistic"}  # stage names only
    assert r.lower <= exact * (1 + 1e-12) and exact <= r.upper * (1 + 1e-12)
    assert r.best_method in ("circulant", "closed_form")


def test_an_operator_that_vanishes_on_the_grid():
    """sigma at the floor, the shift off the grid: T = 0 on 12 x 12; the default path must neither fail nor claim
    more."""
    layer = lipcheck.SSoG(4, 1, 1, dtype=F64)
    layer.set_gaussian_params(torch.tensor([[0.8]], dtype=F64), torch.tensor([[[40.0, 0.0]]], dtype=F64),
                              torch.full((1, 1, 2), SIGMA_FLOOR * 1.001, dtype=F64))
    r = ssog_lipschitz(layer, 12, 12, seed=1, resolution_free=False)  # N C = 576: the dense SVD
    r0 = ssog_lipschitz(layer, 12, 12, seed=1, **NO_DENSE)
    for x in (r, r0):
        assert x.lower == 0.0 and 0.0 <= x.upper <= 1e-9 * x.closed_form


def test_certify_a_model_finds_every_ssog_layer_at_its_grid():
    torch.manual_seed(0)
    model = lipcheck.vit_from_preset("tiny", "discrete", "ssog", img_size=24, patch_size=4, dim=12, num_heads=2,
                                     dtype=F64)  # float64 sigma: the forward-pass reference sees the same kernel
    grid = model.img_size // 4
    res = lipcheck.certify(model, resolution_free=False, seed=0)
    names = [n for n, m in model.named_modules() if isinstance(m, lipcheck.SSoG)]
    assert [c.name for c in res] == names and len(res) == 2
    for c, name in zip(res, names):
        layer = model.get_submodule(name)
        exact = dense_norm(layer, grid, grid)
        assert (c.H, c.W) == (grid, grid) == (6, 6)
        assert c.lower <= exact * (1 + 1e-12) and exact <= c.upper * (1 + 1e-12)
        assert c.gap == pytest.approx(c.upper / c.lower - 1, abs=1e-15) and c.gap >= c.upper / c.lower - 1
        assert c.method == c.bound.best_method and c.detail == c.bound.method[c.method] and not c.cut_short
    # another grid on request; a looped model shares one block, certified once
    res = lipcheck.certify(model, grid=(3, 2), resolution_free=False, seed=0)
    assert {(c.H, c.W) for c in res} == {(3, 2)}
    looped = lipcheck.vit_from_preset("tiny", "looped", "ssog", dim=12, num_heads=2)
    assert len(lipcheck.certify(looped, resolution_free=False, seed=0)) == 1
    # a single layer needs its grid and returns one result
    one = lipcheck.certify(model.blocks[0].mixer, grid=4, resolution_free=False, seed=0)
    assert (one.H, one.W) == (4, 4) and one.lower <= one.upper
    with pytest.raises(ValueError, match="grid"):
        lipcheck.certify(model.blocks[0].mixer)
    with pytest.raises(ValueError, match="no lipcheck.SSoG"):
        lipcheck.certify(lipcheck.vit_from_preset("tiny", "discrete", "attention"))
    with pytest.raises(ValueError, match="grid"):
        lipcheck.certify(torch.nn.Sequential(lipcheck.SSoG(4, 1, 1)))
    importlib.import_module("lipcheck.certification")  # importing the module leaves the function in place
    assert callable(lipcheck.certify) and "certify" in lipcheck.__all__


def test_nan_weights_refuse():
    model = lipcheck.vit_from_preset("tiny", "discrete", "ssog", dim=12, num_heads=2)
    with torch.no_grad():
        model.blocks[1].mixer.o_proj.weight[0, 0] = float("nan")  # the second layer: refused before the first runs
    with pytest.raises(ValueError, match=r"blocks\.1\.mixer.*o_proj\.weight.*non-finite"):
        lipcheck.certify(model)
    layer = layer_of(4, 1, 2, 1)
    with torch.no_grad():
        layer.alpha[0, 0] = float("inf")
    with pytest.raises(ValueError, match="alpha"):
        ssog_lipschitz(layer, 20, 20)


def test_the_result_says_how_each_stage_certified():
    """The description per stage a user reads (method) and the plan's fields that steer the stages: the deflated
    bound names the envelope its complement used, the dense stages say they were not computed, and an explicit k or
    rf_max_rounds lifts the size rule's choices."""
    layer = layer_of(4, 2, 2, 3)
    r = ssog_lipschitz(layer, 5, 5, seed=2, exact_max=0, gram_max=0)
    env = r.info["deflated"]["envelope"]
    assert env in ("gram", "majorant")
    assert r.method["deflated"].startswith("deflated bound: exact on") and \
        ("circulant Gram envelope" in r.method["deflated"]) == (env == "gram")
    assert r.method["exact"] == "not computed" and r.exact is None
    assert r.method["resolution_free"].startswith("branch and bound on the torus")
    assert all(isinstance(v, str) and v for v in r.method.values())
    # the size rule: an explicit k leaves the complement to deflated_bound; rounds asked for are not capped by work
    assert plan(16, 16, 96, 3).complement == "gram"
    assert plan(16, 16, 96, 3, CertifyOptions(deflation_k=20)).complement == "auto"
    assert plan(16, 16, 96, 3, CertifyOptions(deflation_k=20)).deflation_k == 20
    assert plan(16, 16, 96, 3).rf_max_work == lipschitz.RF_PAIRS
    assert plan(16, 16, 96, 3, CertifyOptions(budget_s=30)).rf_max_work == lipschitz.RF_PAIRS / 2
    assert plan(16, 16, 96, 3, CertifyOptions(rf_max_rounds=50)).rf_max_work is None
    assert plan(16, 16, 96, 3, CertifyOptions(rf_max_rounds=50)).rf_max_rounds == 50
    # rounds of the resolution-free bound: 200 for small C, never below 8 however large C
    assert lipschitz.rf_rounds(48) == 200 and lipschitz.rf_rounds(4096) == 8 and lipschitz.rf_rounds(768) == 11


def test_stages_a_deadline_or_a_failure_stops_are_reported_and_the_rest_certifies(monkeypatch):
    """A spent deadline skips the dense SVD too ('not computed', with the reason); a majorant run under a deadline
    gets the time left; a deflated bound the size rule chose that fails is reported with its error and the next
    method serves, still a true bound."""
    layer = layer_of(6, 2, 2, 3)
    exact = dense_norm(layer, 4, 5)
    r = ssog_lipschitz(layer, 4, 5, seed=2, deadline_s=1e-9)
    assert r.method["exact"] == "not computed" and "deadline" in r.exact_reason and r.exact is None
    assert "exact" in r.budget["cut"] and r.cut_short
    assert exact <= r.upper * (1 + 1e-12)
    r = ssog_lipschitz(layer, 4, 5, seed=2, exact_max=0, gram_max=0, deflated=False, majorant=True, deadline_s=600)
    assert "majorant" in r.seconds and not r.cut_short and exact <= r.upper * (1 + 1e-12)
    assert r.budget["deadline_s"] == 600 and r.budget["budget_s"] == 60.0

    def refuse(*a, **kw):
        raise ValueError("refused here")
    monkeypatch.setattr(lipschitz, "deflated_bound", refuse)
    r = ssog_lipschitz(layer, 4, 5, seed=2, exact_max=0, gram_max=0, dense_gram=False)
    assert r.info["deflated"] == {"error": "refused here"} and r.method["deflated"].startswith("failed, not used")
    assert r.best_method != "deflated" and exact <= r.upper * (1 + 1e-12)
    assert "majorant" in r.seconds  # the size rule's fallback where its deflated bound failed
    # the dense Gram after the failed deflated bound serves instead, and the majorant is not run
    r = ssog_lipschitz(layer, 4, 5, seed=2, exact_max=0, gram_max=0)
    assert r.best_method == "dense_gram" and "majorant" not in r.seconds and exact <= r.upper <= exact * (1 + 1e-6)
    with pytest.raises(ValueError, match="refused here"):  # asked for by name: the refusal stands
        ssog_lipschitz(layer, 4, 5, seed=2, exact_max=0, gram_max=0, deflated=True)


def test_the_dense_svd_without_the_gram_stage_builds_its_own_matrix():
    """gram_max = 0: no earlier stage formed the dense operator, so the exact stage forms it; its value is the
    norm of the layer's own forward pass (formed here) and the certified upper bound sits just above it."""
    layer = layer_of(6, 2, 2, 3)
    exact = dense_norm(layer, 4, 5)
    r = ssog_lipschitz(layer, 4, 5, seed=2, gram_max=0)
    assert r.exact == pytest.approx(exact, rel=1e-12)
    assert exact <= r.upper <= exact * (1 + 1e-9) and r.best_method == "exact"


def test_a_generous_deadline_leaves_the_deflated_bound_as_it_is():
    """The deflated bound the size rule plans, with and without a far deadline: the same certified number from the
    same stage (the deadline hands the envelope the seconds left, which never run out here). Equal to a few ulps,
    not bit for bit: BLAS's summation order in the envelope's products can differ between two calls in one process."""
    layer = layer_of(6, 2, 2, 3)
    free = ssog_lipschitz(layer, 4, 5, seed=2, exact_max=0, gram_max=0)
    timed = ssog_lipschitz(layer, 4, 5, seed=2, exact_max=0, gram_max=0, deadline_s=3600)
    assert not free.method["deflated"].startswith("failed") and not timed.method["deflated"].startswith("failed")
    assert timed.info["deflated"]["value"] == pytest.approx(free.info["deflated"]["value"], rel=1e-14)
    assert timed.info["deflated"]["k"] == free.info["deflated"]["k"] and not timed.cut_short


def test_a_deflated_bound_that_serves_needs_no_fallback_and_records_its_basis():
    """Where the size rule's deflated bound gives the upper bound (the dense stages off), the Toeplitz majorant's
    fallback does not run, the guide was kept (its gap is below RETRY_GAP, so no unguided retry), and the circulant
    stage names its (2H-1) x (2W-1) grid; the sandwich holds around the layer's own forward pass."""
    layer = layer_of(4, 2, 2, 3)
    r = ssog_lipschitz(layer, 7, 5, seed=2, **NO_DENSE)
    d = r.info["deflated"]
    assert d["gave_upper"] and r.best_method == "deflated" and r.upper / r.lower - 1 <= lipschitz.RETRY_GAP
    assert d["guide_dropped"] is False and d["retried_from_k"] is None
    assert "majorant" not in r.method and "majorant" not in r.seconds and "majorant" not in r.info
    assert "13x9 DFT grid" in r.method["circulant"]
    exact = dense_norm(layer, 7, 5)
    assert r.lower <= exact <= r.upper * (1 + 1e-12)


def test_the_lanczos_lower_bound_subtracts_its_rounding():
    """_lower_of: ||fl(T v)|| / ||v|| times (1 - gamma_{2n+4}) less the apply error (proofs/S2.md, 'Lower bound'),
    computed here from the fast operator's own value, and below the ratio the layer's dense matrix gives."""
    layer = layer_of(4, 2, 2, 5)
    H, W = 6, 5
    run = lipschitz._start(layer, H, W, CertifyOptions(), 0.0)
    v = torch.randn(1, H, W, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    r = float(lipschitz.sp.apply_T(v, run.q).norm() / v.norm())
    n = H * W * 4
    want = max(0.0, r * (1 - lipcheck.rounding.gamma(2 * n + 4)) - run.apply_err)
    assert lipschitz._lower_of(run, v) == want
    with torch.no_grad():
        b = layer(torch.zeros(1, H, W, 4, dtype=F64))
        ratio = float((layer(v) - b).norm() / v.norm())
    assert math.ldexp(want, run.q.log2_scale) <= ratio
