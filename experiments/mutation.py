"""Mutation testing of the certified code: do the tests tell a lying bound from a true one?

    python experiments/mutation.py [--modules attention,gaussian,...] [--max-mutants 40] [--seed 0]
                                   [--max-children 2] [--timeout-multiplier 4] [--timeout-constant 10]
                                   [--update] [--report-only] [--merge JSON ...] [--docs DIR]

Runs mutmut (pyproject [tool.mutmut]) once per module group on a fresh scratch copy of lipcheck/ and
tests/ under build/mutation/<group>/, each group against its own fast test files (GROUPS below), with
the "mutation" hypothesis profile (derandomised, no shrinking) and a per-mutant CPU-time limit of
2 * timeout_multiplier * (the mutant's tests' clean duration + timeout_constant) seconds. Nothing here
knows line numbers or mutant ids: mutants are regenerated from the code as it is, and every survivor
is matched against SURVIVOR_REASONS by function name and the mutated text. Not part of the default
pytest run. Writes docs/mutation.md and docs/data/mutation.json.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lipcheck import report  # noqa: E402

# group -> (modules to mutate (fnmatch on paths under lipcheck/), test files, pytest -k expression or None).
# Only fast tests: mutmut runs, for each mutant, just the selected tests that call the mutated function.
GROUPS = {
    "attention": (["lipcheck/bounds/attention.py"],
                  ["tests/test_attention_bounds.py", "tests/test_probe.py"],
                  "not growth_ti and not probe_values_equal and not jacobian_formula"),
    "gaussian": (["lipcheck/gaussian.py"], ["tests/test_gaussian.py"], None),
    "spectral": (["lipcheck/bounds/spectral.py"], ["tests/test_bounds.py"], "not default_settings_close"),
    "wellposed": (["lipcheck/wellposed/*"], ["tests/test_wellposed.py", "tests/test_enclosure.py"], None),
    "lognorm": (["lipcheck/bounds/lognorm.py"], ["tests/test_enclosure.py", "tests/test_lognorm.py"], None),
    "majorant": (["lipcheck/bounds/majorant.py"], ["tests/test_majorant.py"],
                 "not wired_into_ssog_lipschitz"),  # that test patches keyword defaults, which mutmut wraps
    "deflation": (["lipcheck/bounds/deflation.py"], ["tests/test_deflation.py", "tests/test_gram_envelope.py"], None),
    "gram_envelope": (["lipcheck/bounds/gram_envelope.py"], ["tests/test_gram_envelope.py"], None),
    # the deflated bound's parameter search: estimates only (any choice is certified), reported on its own
    "deflation_search": (["lipcheck/bounds/deflation_search.py"], ["tests/test_deflation.py"], None),
    "rounding": (["lipcheck/rounding.py"], ["tests/test_lognorm.py", "tests/test_bounds.py"],
                 "rounding or norm2 or lambda or cholesky or rump or gamma or anchor or gram or head_norms or op_is"),
    "network": (["lipcheck/bounds/network.py"], ["tests/test_network_bounds.py", "tests/test_bounds.py"],
                "network or vector_field or mixer or mlp or min_token"),
}

# Why a surviving mutant survives: (module glob, function-name regex, regex on the mutated line(s) of the
# diff, reason). A reason says either that the mutant is equivalent (no input distinguishes it), or that
# the change only loosens a bound in a way no true-bound test can see. Anything unmatched is reported as
# "unexplained" and counts against the suite.
SURVIVOR_REASONS = [
    ("lipcheck/bounds/deflation.py", r"orthonormality_defect", r"torch\.eye\(k, device=Q\.device\)",
     "equivalent: the identity is exact in float32 and the subtraction promotes it to Q's float64"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"estimate=sp\._scale_back\(.*up=None\)",
     "equivalent: _scale_back tests `up` for truth only, and None is false like False"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"_finite\(math\.sqrt\(tau\).*, None\)",
     "message text only (the refusal itself is unchanged)"),
    ("lipcheck/bounds/deflation.py", r"_sub", r"[3-9] \* u \* out\.fro",
     "loosens: a larger allowance for the subtraction's rounding"),
    ("lipcheck/bounds/deflation.py", r"orthonormality_defect", r"rounding\.gamma\(N \+ [5-9]\)",
     "loosens: a larger rounding allowance on fl(Q^T Q)"),
    ("lipcheck/bounds/deflation.py", r"certify_delta", r"rounding\.gamma\(k - 3\)",
     "shrinks by 6u relative the allowance for fl(c Q Q^T) (itself ~1e-14 of delta, covered many times by the "
     "1e-9 pad of the certificate): no float64 input can exhibit it; not equivalent"),
    ("lipcheck/bounds/deflation.py", r"token_blocks", r"rel \* fq \* \(1 - 4 \* eta\)",
     "shrinks by 8 eta (~1e-12) relative the allowance for K_h Q's rounding: no float64 input can exhibit it; "
     "not equivalent"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"GCXX=|GC=None|GB=GB\.err, A=A\.err",
     "now killed by tests/test_deflation.py::test_report_fields_and_the_envelope_budget (the reported allowances, "
     "added after this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"envelope_toeplitz", r"toeplitz_majorant\(p, H, W, rtol=1e-2, max_rounds",
     "now killed by tests/test_deflation.py::test_report_fields_and_the_envelope_budget (the time budget reaches "
     "the envelope's refinement, added after this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"_kron_sum", r"err -= rounding\.gamma",
     "now killed by tests/test_deflation.py::test_kron_sum_covers_its_rounding (added after this run; "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"kCXX=",
     "now killed by tests/test_deflation.py::test_deflated_bound_tight_where_the_majorant_is_not (the reported kC, "
     "added after this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"top_eigenvectors", r"eigsh\(TN\.cpu\(\)\.numpy\(\), k=k \+ 1, v0",
     "equivalent: T_N(s_up) is positive semidefinite (s_up >= 0), so the largest-magnitude eigenvalues eigsh "
     "returns by default are the largest ones"),
    ("lipcheck/bounds/deflation.py", r"certify_delta", r"[4-9] \* u \* float\(S\.square",
     "loosens: a larger allowance for the subtraction's rounding (a true bound stays true)"),
    ("lipcheck/bounds/deflation.py", r"orthonormality_defect", r"rounding\.gamma\(N \* k \+ [3-9]\)",
     "loosens: a larger rounding allowance on ||Q||_F^2"),
    ("lipcheck/bounds/deflation.py", r"token_blocks", r"\(2 \* [HW] \+ 1\) \* tiny|\(2 \+ rounding\.gamma\(N \* k",
     "loosens: more flushed-tap allowance, or ||Q||_F counted twice (a larger error bound on K_h Q)"),
    ("lipcheck/bounds/deflation.py", r"orthonormality_defect", r"rounding\.gamma\(k \* k - 4\)",
     "shrinks by 8u relative the rounding allowance of a computed Frobenius norm inside eta (~1e-13, itself "
     "covered many times by the 1e-8 allowances downstream): no float64 input can exhibit it; not equivalent"),
    ("lipcheck/bounds/deflation.py", r"_kron_sum", r"rounding\.gamma\(len\(L\) - 2\)",
     "shrinks by 4u relative the allowance for the Kronecker sum's rounding (test_kron_sum_covers_its_rounding "
     "checks it against exact rationals; the actual error is orders below it): no float64 input can exhibit it; "
     "not equivalent"),
    ("lipcheck/bounds/deflation_search.py", r"krylov_basis|top_eigenvalue", r"range\(blocks \+ 1\)|V\[:, \+1\]",
     "now killed by tests/test_deflation.py::test_search_eigen_helpers_against_numpy (added after this run; "
     "checked by hand)"),
    ("lipcheck/bounds/deflation*.py", r"krylov_basis|choose_parameters",
     r"range\(blocks [+-] \d\)|apply\(e, ref, X\), n, \d+, \d+, i\)|enumerate\(\(",
     "parameter choice: another Krylov space for the eigenvalue estimates that choose eps (any eps > 0 gives a "
     "certified bound, Theorem D3; test_block_certificate_is_theorem_d3 allows 1e-6 over the best of its grid)"),
    ("lipcheck/bounds/deflation.py", r"certify_block", r"sq = math\.sqrt\(n\) \* \(1 \+ [5-9] \* u\)",
     "loosens: a larger rounding allowance for the diagonal blocks (a true bound stays true)"),
    ("lipcheck/bounds/deflation.py", r"token_blocks", r"rel \* fq \* \([2-9] \+ 4 \* eta\)",
     "loosens: a larger allowance for K_h Q's rounding (a true bound stays true)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound|default_k", r"\(k is None\) and False|max\(int\(C\), None\)",
     "now killed by tests/test_deflation.py::test_default_k_rule_and_the_default_call (added after this run; "
     "checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"GC = _sym\(_kron_sum\(GCl, GCr, transpose_P=True\)\)",
     "now killed by tests/test_deflation.py::test_block_matrices_against_the_dense_operator (added after this "
     "run; checked by hand)"),
    ("lipcheck/bounds/deflation*.py", r"krylov_basis", r"for _ in range\([3-9]\)",
     "estimate only: one more reorthogonalisation of the Krylov basis that chooses eps (the same basis up to "
     "rounding; any eps gives a certified bound, Theorem D3)"),
    ("lipcheck/bounds/deflation.py", r"certify_delta", r"verified_lambda_max\(S, tries=CERTIFY_TRIES\)",
     "guess only: without it verified_lambda_max starts from its own eigvalsh guess; the Cholesky certificate "
     "decides either way (the same delta up to the pad)"),
    ("lipcheck/bounds/deflation*.py", r"choose_parameters",
     r"\(lo < nxt < hi\) and False|floor = \(beta \+ 4 \* gb_err\) / |1e-9 / scale|0\.5 / scale",
     "parameter search only: bisection without the fixed-point step, or another floor / reference point for "
     "sigma (any sigma gives a certified bound: the Cholesky check of Theorem D3 decides; "
     "test_block_certificate_is_theorem_d3 allows 1e-6 over the best of its grid)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"_finite\(.*\"DEFLATED MAJORANT BOUND\"\)",
     "message text only (the refusal itself is unchanged)"),
    ("lipcheck/bounds/deflation.py", r"token_blocks", r"rel / fq \* \(1 \+ 4 \* eta\)",
     "shrinks by the factor ||Q||_F^2 = k the allowance for K_h Q's rounding (about 1e-14 relative, orders above "
     "the actual rounding): no float64 input can exhibit it; not equivalent"),
    ("lipcheck/bounds/deflation_search.py", r"krylov_basis", r"default_rng\(None\)",
     "now killed by tests/test_deflation.py::test_block_certificate_is_theorem_d3 (the choice is deterministic; "
     "added after this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"_sym", r"unit_roundoff\(S\.dtype\) / X\.fro",
     "now killed by tests/test_deflation.py::test_sym_covers_its_rounding (added after this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"default_k", r"4609 // max",
     "now killed by tests/test_deflation.py::test_default_k_rule_and_the_default_call (C = 11 and 419, added after "
     "this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound",
     r"margin = mb\.margin if \(from_majorant\) and False|seconds=time\.perf_counter\(\) \+ t0",
     "now killed by tests/test_deflation.py::test_returned_fields_describe_the_bound_returned (added after this "
     "run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"_scale_back\(math\.sqrt\(tau_est\), e, up=True\)",
     "equivalent within the float range: the rounding direction of a power-of-two scaling of the estimate, which is "
     "exact unless the scaled estimate under- or overflows"),
    ("lipcheck/bounds/deflation.py", r"certify_block", r"n \* tau_first \+ n / s2",
     "certificate's first pad only (smaller here): the Cholesky check decides whether tau is proven; a failed check "
     "pads tenfold (any pad that passes is certified)"),
    ("lipcheck/bounds/deflation.py", r"certify_delta|kernel_factors",
     r"rounding\.gamma\(k \+ [4-9]\) \* c \* fq|\(2 \+ float\(ex\[h\]\.max\(\)\)\)",
     "loosens: a larger rounding allowance (a true bound stays true)"),
    ("lipcheck/bounds/deflation.py", r"head_projections|orthonormality_defect",
     r"rounding\.gamma\(q\.head_dim - 2\)|Q\.square\(\)\.sum\(\)\) \* \(1 - rounding\.gamma",
     "shrinks a rounding allowance by a few u relative (orders above the actual rounding): no float64 input can "
     "exhibit it; not equivalent"),
    ("lipcheck/bounds/deflation_search.py", r".*", r".",
     "estimate only: this module chooses Theorem D3's eps and sigma and Theorem D4's g and holds no certificate "
     "(each theorem is certified for every choice by the Cholesky checks in deflation.certify_block and "
     "deflation.certify_gram); test_block_certificate_is_theorem_d3 and test_gram_certificate_is_theorem_d4 keep "
     "the choices within 1e-6 of the best of a fine grid"),
    ("lipcheck/bounds/deflation.py", r"certify_block", r"3 \* u \* \(r \* GB\.fro \+ 2 / sq\)",
     "shrinks the second block's diagonal-rounding allowance (6u sqrt(kC) -> 6u / sqrt(kC), below 1e-12 "
     "relative, orders above the actual rounding): no float64 input can exhibit it; not equivalent"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"skipped=\"XX|max_rounds: int = 20[1-9]",
     "message text, or the envelope's round budget by one (its 15 s time budget stops it first)"),
    ("lipcheck/bounds/deflation.py", r"envelope_toeplitz", r"k: int = 1[1-9]",
     "the default of a helper's k: deflated_bound always passes its k"),
    ("lipcheck/bounds/deflation.py", r"token_blocks", r"ey = e\[\.\.\., 1\]|\(rel \* fq \* \(1 \+ 4 \* eta\) - eta\)",
     "swaps the two axes' tap-error allowances, or shrinks K_h Q's allowance by 2 kappa eta (each a few u "
     "relative, orders above the actual rounding): no float64 input can exhibit it; not equivalent"),
    ("lipcheck/bounds/deflation.py", r"token_blocks", r"\* \([2-9] \+ float\(ex\[h\]\.max\(\)\)\)",
     "loosens: a larger allowance for the sums' rounding in K_h Q (a true bound stays true)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"majorant=sp\._scale_back\(mb\.upper, [1-9]",
     "now killed by tests/test_deflation.py::test_delta_above_the_majorant_returns_the_majorant (the reported "
     "majorant, added after this run; checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"envelope_toeplitz", r"_no_nan\(t, \"",
     "message text only (the refusal itself is unchanged)"),
    ("lipcheck/bounds/lognorm.py", r"structured_lognorm", r"n1\.amax\(\+1\)",
     "equivalent: the per-token norms n1 have shape (B, N), so axis +1 is axis -1"),
    ("lipcheck/bounds/network.py", r".*", r"_gamma\([^,()]+, \)",
     "equivalent: gamma's default unit roundoff is float64's, the u passed (_U64)"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"torch\.zeros\(C, \)",
     "equivalent: zeros are exact in every dtype, and only their norm (0.0) is used"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"_gamma\(C \+ 4, \)\)",
     "now killed by tests/test_network_bounds.py::test_layernorm_output_radius_rounded_up_in_the_certification_dtype "
     "(certified in float32, the margin must be float32's; added after this run, checked by applying the mutant by "
     "hand)"),
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r"min_variance <= 0:",
     "now killed by tests/test_network_bounds.py::test_vector_field_passes_its_rtol_to_the_mixer_bound (a floor of 0 "
     "is legal; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/network.py", r"mixer_lipschitz|vector_field_lipschitz",
     r"(?m)attention_lipschitz_on_ball\(mixer, token_radius, num_tokens, device=device\)|^\+\s+device=device, rtol=rtol\)",
     "changes only the precision the bound is computed in: float64 (the callee's default) instead of the requested "
     "dtype; identical for every caller certifying in float64, and otherwise still a certified bound"),
    ("lipcheck/bounds/network.py", r"mlp_lipschitz", r"\.to\(device=device\)",
     "changes only the precision the bound is computed in: the layer's own dtype instead of the requested one; "
     "identical for float64 layers certified in float64 (every caller), and otherwise still a certified bound "
     "(norm2_upper verifies in float64 whatever the input dtype)"),
    ("lipcheck/bounds/network.py", r"token_variance_lower", r"\(1 \+ _gamma\(_U64\)\)",
     "unobservable: drops a (1 + gamma) factor of O(u) from the mean's rounding allowance (itself O(C u) of mean|x|), "
     "a change of O(u^2) relative; the term is fixed by proofs/S3.md"),
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r"vacuous=glob >= VACUOUS",
     "boundary only: differs only when the global bound is exactly 1000.0, a float no layer is built to hit; the "
     "bound itself is unchanged"),
    ("lipcheck/wellposed/enclosure.py", r"piecewise_quartic", r"fk = dict\(dtype=x0\.dtype, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device, where the states are"),
    ("lipcheck/wellposed/gradients.py", r"gradient_check", r"prepare\(model, images, dtype=dtype\)",
     "equivalent on a CPU-only machine: the model and images are already on the CPU, the only device"),
    ("lipcheck/wellposed/enclosure.py", r"rayleigh_lower", r"ln\.gamma\(2 \* n - 4\)",
     "unobservable: the Rayleigh quotient's rounding allowance counted for 2n - 4 instead of 2n + 4 operations, O(u) "
     "relative on a lower bound that sits far below the log-norm it estimates; the term is fixed by proofs/S5.md"),
    ("lipcheck/bounds/*.py", r".*", r"bar = tqdm\(.*disable=progress",
     "equivalent for every bound: whether the progress bar is drawn only changes what tqdm prints to the terminal"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r'meshgrid\(cy, cx, indexing=None\)',
     "equivalent: torch.meshgrid's default indexing is 'ij', the value passed"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.__init__", r"\+ [3-9] \* math\.pi \* p\.sigma\.square\(\)\)",
     "loosens: a larger bound on the rounding of the derivative's lattice sum; a larger, still true allowance"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.__init__", r"self\.eta_d = eta_d / \(1 \+ p\.gamma",
     "unobservable: the derivative rounding allowance eta_d (itself O(u)) scaled by 1 - O(u) instead of 1 + O(u), "
     "a change of O(u^2) relative to the coefficients; the term is fixed by proofs/S2.md"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"gamma = norm\.weight\.detach\(\)\.to\(device=device\)",
     "equivalent: only max|gamma| is used, and a maximum of absolute values is exact in every dtype (the float32 "
     "weights convert exactly to float64)"),
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r"mlp_lipschitz\(block\.mlp, dtype=dtype, variant=gelu_variant\)",
     "equivalent on a CPU-only machine: device=None means the layer's own device"),
    ("lipcheck/bounds/network.py", r"min_token_variance", r"x\.abs\(\)\.mean\(dim=None\)",
     "now killed by tests/test_network_bounds.py::test_min_token_variance_subtracts_each_tokens_mean_allowance "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/network.py", r"min_token_variance", r"_gamma\(C - 3, _U64\)|_gamma\(C \+ [4-9], _U64\)|_gamma\([4-9], _U64\)\)\) \* \(1 - _gamma\(2",
     "unobservable: the rounding allowance of the two-pass sum changed by a few u relative; the rounding that "
     "actually occurs is far below the worst case on any input a test can draw, and the term is fixed by "
     "proofs/S3.md, not by a test"),
    ("lipcheck/bounds/network.py", r"mlp_lipschitz|vector_field_lipschitz|_ln_constants", r"\(1 \+ _gamma\([5-9], _U64\)\)|_gamma\(C \+ [5-9], ",
     "loosens: a float64 assembly margin a few u larger"),
    ("lipcheck/bounds/majorant.py", r"_lower_estimate", r"dtype=sn\.p\.WV\.dtype, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device, where the coefficients are"),
    ("lipcheck/bounds/majorant.py", r"_top_eigen", r"v0\.reshape\(N\), steps\)",
     "equivalent: lanczos flattens its start vector (v0.reshape(-1)), so a (N,) and a (1, N) start are the same"),
    ("lipcheck/bounds/majorant.py", r"interval_transforms", r"safe = torch\.where\(kk == 1, ",
     "equivalent: at kk = 1 the placeholder 1 equals kk, and at kk = 0 the quotient it guards is discarded by the "
     "torch.where that follows (amp takes h / pi there)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"estimate=sp\._scale_back\(lam, e, up=None\)",
     "equivalent: _scale_back tests `if up`, and None is false like False"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"w\.shape\[0\] - 3 \* split_per_round > max_cells|init_cells: int = 17|sn if \(sn is not None\) and False",
     "now killed by tests/test_majorant.py::test_cell_budget_initial_layout_and_a_callers_anchors (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.remainder", r"p\.gamma\(p\.alpha\.shape\[1\] - 8\)",
     "now killed by tests/test_majorant.py::test_cell_remainder_bounds_and_matches_taylor (the remainder at a cell "
     "of positive width pinned to proofs/S2.md at 50 digits; added after this run, checked by applying the mutant by "
     "hand)"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r'bar = tqdm\(desc="resolution-free sup"',
     "equivalent for every bound: the progress bar's total only changes what tqdm prints to the terminal"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"kb = torch\.minimum\(kb, cell_bounds\(K, \)\)",
     "efficiency only: every anchor instead of the newest ones (a tighter or equal cell bound at more cost); any "
     "subset of anchors gives a certified bound"),
    ("lipcheck/bounds/spectral.py", r"anchor_verification", r"g\(2 / C \+ 4\)",
     "unobservable: the allowance for ||u1||^2 (a sum of 2C squares) counted for 4 terms instead of 2C + 4, O(C u) "
     "relative on a norm that is 1 to within ~u for every computed singular vector; only a worst-case rounding "
     "would reach it, and the term is fixed by proofs/S2.md"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"up \* F\[0\]\) - e0\)",
     "unobservable: the first Gram product's worst-case rounding e0 = (gamma_m + 2u) ||T||_F^2 subtracted instead "
     "of added moves the bound by ~m u relative, while the rounding that actually occurs is far smaller and the "
     "iteration's other allowances exceed it on every input tried (a tight case such as an orthogonal matrix leaves "
     "Gram iteration 1-2% loose); the term is fixed by proofs/S2.md"),
    # before the generic device pattern below, which a dropped keyword just before ')' would also match
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r"dtype=dtype, device=device, \)$|rtol=None\)|rtol=rtol, \)",
     "now killed by tests/test_network_bounds.py::test_vector_field_passes_its_rtol_to_the_mixer_bound (added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/network.py", r"mixer_lipschitz", r"rtol",
     "tightness only: rtol sets how tight SSoG's resolution-free bound is; every rtol gives a certified bound"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"beta = norm\.bias\.detach\(\)\.to\(dtype=None",
     "now killed by tests/test_network_bounds.py::test_layernorm_output_radius_rounded_up_in_the_certification_dtype "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/network.py", r"min_token_variance", r"\.to\(None\)",
     "now killed by tests/test_network_bounds.py::test_min_token_variance_is_a_lower_bound_at_full_precision (added "
     "after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"_top_eigen\(t, None, W, v, max\(lanczos_steps, 300\)\)",
     "now killed by tests/test_majorant.py::test_large_grid_final_estimate_and_certificate (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"max\(lanczos_steps, 30[1-9]\)",
     "efficiency only: a few more Lanczos steps for the final estimate past 1024 tokens; the Cholesky certificate "
     "decides the bound whatever the estimate"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.__init__", r"self\.J_abs = torch\.stack\(\[\(A \* D1\[\.\.\., 1\]\)",
     "now killed by tests/test_majorant.py::test_cell_model_gradient_bounds_cover_each_axis (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"centre_error", r"\(1 \+ [5-9] \* u\)",
     "loosens: the allowance grows by u^2 relative (below one ulp of it); a larger, still true allowance"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r'_no_nan\(\w+, (None|"XX[^"]*XX")\)|_finite\(.*"toeplitz majorant bound"\)',
     "equivalent for every bound: the second argument of _finite / _no_nan only names the quantity in the refusal's "
     "message"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"corners = torch\.tensor\(\[\[-1, -1\], \[-1, 1\], \[1, -1\], \[1, 1\]\], device=dev\)",
     "equivalent: +-1 are exact in every float dtype, and each use multiplies the corners by a tensor of the "
     "certification dtype, to which type promotion converts them exactly"),
    ("lipcheck/bounds/spectral.py", r"SymbolNorm\.matrix", r"scale = c\.to\(None\)",
     "equivalent: the coefficients already have SymbolNorm's complex dtype (symbol_coefficients of the same "
     "parameters), so the conversion is a no-op"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"win = torch\.sin\(",
     "changes only the window of the symbol-guided start vector on large grids: the lower bound is still an "
     "attained ratio ||T v|| / ||v||, and the random-start run still sets the reported probabilistic bound"),
    ("lipcheck/bounds/attention.py", r"_frobenius_upper", r"fi\.smallest_normal / fi\.eps",
     "loosens: the underflow allowance grows from ~1e-161 to ~1e-145, added to a norm in [1/2, sqrt(k)) (the matrix "
     "is scaled first); a larger, still true bound"),
    ("lipcheck/bounds/attention.py", r"layernorm_lipschitz", r"eps / 3",
     "margin changed by O(u) relative and still above the rounding that actually occurs on every tested input "
     "(the tests compare with 40-digit references); the margin is fixed by the proof in proofs/S4.md, not by a test"),
    ("lipcheck/gaussian.py", r"check_representable", r"\(2 \* DIRECT_TERMS \+ 2\) \* DIRECT_TERMS",
     "now killed by tests/test_gaussian.py::test_check_representable_reads_the_dtype_of_mu_and_the_exponent_limit "
     "(2 sigma^2 = 6e-307, just inside the exponent limit; added after this run, checked by applying the mutant by "
     "hand)"),
    ("lipcheck/bounds/lognorm.py", r"dense_lognorm", r"dtype=y\.dtype, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device, where the states are"),
    ("lipcheck/rounding.py", r"_real_gram", r"gamma\(m \* n \+ 4, \)",
     "equivalent: gamma's default unit roundoff is float64's, the u passed (the Gram matrix is formed in float64)"),
    ("lipcheck/rounding.py", r"cholesky_certifies", r"if \(u is None\) or True else u",
     "now killed by tests/test_lognorm.py::test_cholesky_certifies_exactly_at_known_eigenvalues (a coarser u passed "
     "in must refuse a gap float64's u certifies; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/rounding.py", r"norm2_upper", r"if i == 1 or s is not None:",
     "efficiency only: the eigensolver also runs when the caller's guess certifies; the certificate is taken at "
     "max(guess, eigenvalue) either way, a certified bound"),
    ("lipcheck/bounds/attention.py", r"head_matrices", r'einsum\("HD,HCD->HC"',
     "equivalent: torch.einsum takes upper-case subscripts for the same contraction"),
    ("lipcheck/bounds/gram_envelope.py", r"affordable", r"\(2 \* H - 2\) \* \(2 \* W - 1\)",
     "now killed by tests/test_gram_envelope.py::test_complement_choice_and_bad_input (512 x 1 affordable, 513 x 1 "
     "not; added after the seed-37 run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/gram_envelope.py", r"circulant_gram_bound", r"math\.sqrt\(tau\) / \(1 \+ 2 \* u\)",
     "now killed by tests/test_gram_envelope.py::test_envelope_majorises_the_gram_matrix (the bound's last steps "
     "pinned; added after the seed-37 run, checked by hand)"),
    ("lipcheck/bounds/gram_envelope.py", r"torus_symbol_norms", r"\+ err_c\) (/ \(1 \+ 2|\* \(1 \+ 3) \* u\)",
     "now killed by tests/test_gram_envelope.py::test_torus_norms_are_the_documented_certified_values (added after "
     "the seed-37 run, checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"_gram_deflated",
     r'(None|"XXdeflated boundXX"|"DEFLATED BOUND"|"XXcirculant Gram boundXX"|"CIRCULANT GRAM BOUND")\)',
     "equivalent: the message of a check that cannot fire (certify_d4 and certified_top refuse non-finite values, "
     "so the roots are finite)"),
    ("lipcheck/bounds/deflation.py", r"_gram_deflated", r"complement=None, errors",
     "now killed by tests/test_gram_envelope.py::test_envelope_majorises_the_gram_matrix (the reported complement "
     "bound is the returned delta; added after the seed-40 run, checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"_mm", r"gamma\(n \+ [3-9]\) \* X\.fro",
     "loosens: a larger rounding allowance on a product's Frobenius term"),
    ("lipcheck/bounds/deflation.py", r"_pairwise", r"x\.err \* y\.err - g \* xf",
     "shrinks a pairwise product's rounding allowance by its gamma_n ||x||_F ||y||_F term (a few u relative): the "
     "tests' exact values sit further below the bound than that, so no float64 input here exhibits it; not "
     "equivalent"),
    ("lipcheck/bounds/deflation.py", r"certify_block", r"r \* GB\.fro \+ [3-9] \* sq",
     "loosens: a larger rounding allowance on the B-block's residual term"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"\n\+\s*\)\)$",
     "now killed by tests/test_deflation.py::test_delta_above_the_majorant_returns_the_majorant (the envelope's "
     "error is reported; added after the seed-40 run, checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"from_majorant = mb\.upper <= upper",
     "equivalent but for an exact tie, where the majorant and the deflated value are the same number"),
    ("lipcheck/bounds/spectral.py", r"anchor_verification", r"g\(2 \* C - 4\)",
     "shrinks a vector norm's rounding allowance by 8u relative: no float64 input here exhibits it; not "
     "equivalent"),
    ("lipcheck/bounds/spectral.py", r"certified_max_points", r'add_anchors\(c\[pick\]\), (None|"XX|"ANCHOR)',
     "equivalent: the message of a check that cannot fire (NaN coefficients are refused by name before any anchor; "
     "finite ones give finite anchor bounds)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r'seconds\["XXmajorantXX"\]',
     "now killed by tests/test_deflation.py::test_ssog_lipschitz_takes_the_deflated_bound (the majorant's seconds "
     "are reported; added after the seed-40 run, checked by hand)"),
    ("lipcheck/bounds/spectral.py", r"top_singular_guess", r"vector_norm\(v, dim=\+1",
     "equivalent: v is (k, n), so dim 1 is dim -1"),
    ("lipcheck/bounds/gram_envelope.py", r"circulant_gram_bound", r"q\.magnitude\(\), (None|\"CIRCULANT GRAM BOUND\"|\"XX)",
     "equivalent: the message of a check that cannot fire (certified_top has refused a failed certificate and R's "
     "error is finite, so sqrt(tau) is finite in normalised units)"),
    ("lipcheck/bounds/gram_envelope.py", r"gram_envelope", r"err = H (/ W|\* W \* e_r \* \(1 \+ rounding\.gamma\(5)",
     "now killed by tests/test_gram_envelope.py::test_envelope_majorises_the_gram_matrix (err pinned to N e_r "
     "(1 + gamma_4); added after the seed-39 run, checked by hand)"),
    ("lipcheck/bounds/gram_envelope.py", r"torus_symbol_norms", r"s \* s \* \(1 \+ 8 \* u\), None\)",
     "now killed by tests/test_gram_envelope.py::test_complement_choice_and_bad_input (finite norms whose squares "
     "overflow are refused by name; added after the seed-38 run, checked by hand)"),
    ("lipcheck/bounds/deflation.py", r"_gram_deflated", r"math\.sqrt\(tau_R\) \* \(1 - 2 \* u\)|envelope_secondsXX",
     "now killed by tests/test_gram_envelope.py::test_envelope_majorises_the_gram_matrix (the envelope value equals "
     "circulant_gram_bound's, its seconds are reported; added after the seed-37 run, checked by hand)"),
    ("lipcheck/rounding.py", r"_real_gram", r"gamma\(2 \* m / n \+ 4, u\)",
     "now killed by tests/test_lognorm.py::test_norm2_upper_gram_allowance_is_the_formula_and_zero_results_are_float64 "
     "(F2 pinned in the code's order; added after the seed-37 run, checked by hand)"),
    ("lipcheck/rounding.py", r"rump_shift|_cholesky_completes", r"gn = gamma\(n \+ 1, \)|n = A\.shape\[\+1\]",
     "now killed by tests/test_lognorm.py::test_float32_cholesky_check_keeps_float32s_rump_shift_and_4d_batches "
     "(added after the seed-37 run, checked by hand)"),
    ("lipcheck/bounds/gram_envelope.py", r".*", r"_finite\(.*, None\)|\"circulant gram",
     "message text only (the refusal itself is unchanged)"),
    ("lipcheck/bounds/deflation.py", r"_gram_deflated", r"\"circulant gram bound\"",
     "message text only (the refusal itself is unchanged)"),
    ("lipcheck/bounds/deflation.py", r"_gram_deflated", r"c = max\(float\(ev\[0\]\) \+ float\(ev\[k\]\)",
     "loosens: any c >= 0 is valid (x^T (R - c Q Q^T) x = x^T R x on span(Q)^perp); a larger c only raises the "
     "allowance gamma c ||Q||_F^2 of certify_delta"),
    ("lipcheck/bounds/deflation.py", r"certify_delta", r"gamma\(N \* k - 2\)",
     "shrinks by 4 units of roundoff (relative) the rounding allowance on ||Q||_F^2, itself some 1e-13 of the "
     "envelope: no float64 input exposes it"),
    ("lipcheck/bounds/deflation.py", r"certify_delta", r"verified_lambda_max\(S, lam=None",
     "efficiency only: eigvalsh's guess instead of the caller's; the Cholesky check certifies either"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"envelope_toeplitz\(p, H, W, time_budget",
     "refinement target only (the envelope refined near the top eigenvector instead of the (k+1)-th): every "
     "envelope is certified"),
    ("lipcheck/bounds/deflation.py", r"deflated_bound", r"_scale_back\(.*up=None\)",
     "equivalent for these values: _scale_back tests `up` for truth only and rounds outward only off the normal "
     "range"),
    ("lipcheck/bounds/deflation.py", r"gram_matrices", r"token_blocks\(q, (None|H), (None|W), Q, eta, factors=f\)",
     "equivalent: with the kernel factors passed, token_blocks reads the grid only through them"),
    ("lipcheck/bounds/deflation.py", r"certify_block", r"pad = max\(1e-12, .*\* tau_first\)",
     "the first pad only: a smaller one costs a retry (tenfold per failure), the Cholesky check decides"),
    ("lipcheck/rounding.py", r"_cholesky_completes", r"potrf\(flat\[i\]\.numpy\(\)\.T, lower=(None|1),",
     "equivalent for the exactly symmetric fl(mu I - S) every caller passes: lower=None is falsy like 0, and "
     "lower=1 factors the transpose, which completes exactly when the matrix's does (the same numbers)"),
    ("lipcheck/rounding.py", r"verified_lambda_max", r"4 \* n \* u / scale",
     "the first pad only: a smaller one costs a retry (tenfold per failure), the Cholesky check decides"),
    ("lipcheck/rounding.py", r"norm2_upper", r"\(1 (\+ gamma\(7|- gamma\(6), u\)\)",
     "now killed by tests/test_lognorm.py::test_norm2_upper_is_the_documented_certificate (the result pinned to the "
     "last bit; added after the seed-37 run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/gram_envelope.py", r"torus_symbol_norms", r"chunk: int = \d+",
     "equivalent: the batch size of the C x C norms, each certified on its own"),
    ("lipcheck/bounds/gram_envelope.py", r".*", r"torch\.(empty|arange)\([^()]*, \)|torch\.arange\(L, \)",
     "equivalent on a CPU-only machine: the default device is the CPU, where the layer is"),
    ("lipcheck/bounds/gram_envelope.py", r"certified_top", r"verified_lambda_max\(env\.R, \)",
     "equivalent in practice: the first Cholesky try (eigvalsh's guess plus 4 n u ||R||_F) certifies; fewer "
     "retries could only turn a failing guess into a refusal"),
    ("lipcheck/bounds/gram_envelope.py", r"torus_toeplitz_coefficients", r"rounding\.gamma\(8, \)",
     "equivalent: gamma's default unit roundoff is float64's, the only dtype the envelope accepts"),
    ("lipcheck/bounds/*.py", r".*", r"device=None\)|dtype=dtype, \)|device=device, \)|, device=None,",
     "equivalent on a CPU-only machine: device=None means the layer's own device"),
    ("lipcheck/bounds/attention.py", r"_head_norms", r"head_matrices\(layer, device=device\)",
     "loosens: the norms are then computed in float64 under float32's (larger) margins, still upper bounds"),
    ("lipcheck/bounds/attention.py", r"_frobenius_upper|_spectral_upper|_round_up|_head_norms",
     r"numel\(\) - 1|eps / 3|eps \* 2|\(SVD_CONSTANT [-/] |gamma\(d [-+*/] [0-9]|\+ 3, u\)|\+ 5, u\)",
     "margin changed by O(u) relative and still above the rounding that actually occurs on every tested input "
     "(the tests compare with 40-digit and exact-rational references); the margin is fixed by the proof "
     "in proofs/S4.md, not by a test"),
    ("lipcheck/bounds/attention.py", r"unit_roundoff", r"eps \* 2",
     "loosens: u doubled, every margin larger"),
    ("lipcheck/bounds/attention.py", r"attention_block_lipschitz", r"up \*\* [4-9]|2 \* torch\.finfo|\* up \*\* 3 \* up",
     "loosens: a float64 margin a few u larger"),
    ("lipcheck/bounds/attention.py", r"layernorm_image_radius|layernorm_lipschitz", r"gamma\(C \+ [5-9]|gamma\([5-9],|gamma\(C \* 4",
     "loosens: a float64 margin a few u larger"),
    ("lipcheck/bounds/attention.py", r"_head_norms", r"gd \* fV / fO|gd \* fQ / fK",
     "now killed by tests/test_attention_bounds.py::test_head_norm_bounds_dominate_exact_norms (factors whose "
     "products cancel; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/attention.py", r"_layernorm_affine", r"torch\.zeros\(C, dtype=None\)|torch\.ones\(C, dtype=None\)",
     "equivalent: zeros (ones) are exact in every dtype and are converted to float64 before use"),
    ("lipcheck/bounds/attention.py", r"attention_block_lipschitz", r"mlp_lipschitz\(block\.mlp, device=device\)",
     "equivalent at float64 (the default dtype, used by every caller): mlp_lipschitz defaults to float64"),
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r'num_tokens = ""',
     "now killed by tests/test_network_bounds.py::test_attention_block_radius_is_the_layernorm_image (an attention "
     "block without states must ask for the number of tokens; added after this run, checked by applying the "
     "mutant by hand)"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"8 \* torch\.finfo|9 \* torch\.finfo|\* up",
     "loosens: a float64 margin a few u larger"),
    ("lipcheck/gaussian.py", r"_pieces", r"DIRECT_TERMS - 1|DIRECT_TERMS \+ 2",
     "equivalent in floating point: the lattice terms j = 6, 7 it drops (or adds) are below exp(-60) relative to "
     "S >= 1 whenever the direct sum is used (sigma < 0.5), far under the unit roundoff"),
    ("lipcheck/gaussian.py", r"axis_matrix|log_kernel", r"arange\(n, device=mu\.device\)|else None, \)|or True else None",
     "equivalent: the offsets are small integers, exact in every dtype, and log_kernel converts them to mu's dtype "
     "(on a CPU-only machine device=None is mu's device)"),
    ("lipcheck/gaussian.py", r"tap_relative_error|log_normaliser|check_representable", r"gamma\((9|1[0-9]), ",
     "loosens: the a-priori tap error bound a few u larger"),
    ("lipcheck/bounds/lognorm.py", r"_ln_numbers", r"torch\.zeros\(C, \)",
     "equivalent: only the norm of these zeros is used, 0.0 in every dtype and on every device"),
    ("lipcheck/bounds/lognorm.py", r"_op", r"if \(w\.numel\(\)\) or True",
     "equivalent: norm2_upper of an empty matrix is 0, the value of the else branch"),
    ("lipcheck/bounds/lognorm.py", r"lipschitz", r"ln_jacobian\([3-9], v\)",
     "equivalent: ln_jacobian selects LN1 for which == 1 and LN2 for any other value"),
    ("lipcheck/rounding.py", r"rump_shift", r"gn / \(2 - 2 \* gn\)",
     "halves the Cholesky rounding margin c (about n u tr A), which is a worst-case bound (Rump 2006) never "
     "attained by the rounding that actually occurs, so no floating-point input separates it; the margin is fixed "
     "by proofs/S5.md Lemma 3, not by a test"),
    ("lipcheck/bounds/lognorm.py", r"structured_lognorm", r"gamma\(k\.hidden \+ [3-9] \* k\.C \+ 16|gamma\(k\.hidden \+ 2 \* k\.C \+ (1[7-9]|[2-9][0-9])",
     "loosens: the a-priori forming error a few u larger"),
    ("lipcheck/wellposed/certificate.py", r"aposteriori_certificate", r"if a <= t1\]",
     "equivalent: every recorded solver step starts before t1 (the integration stops at t1), so a == t1 never occurs"),
    ("lipcheck/wellposed/gronwall.py", r"perturbation_growth", r"segment_variance_floor\(X, Y, drift, drift, \)",
     "drops the reference's error (~1e-12 relative to the state) from the variance floor's margin: the floor moves "
     "by that much, far below the distance of any tested state to a floor that changes the constant; the margin is "
     "fixed by proofs/S5.md, not by a test"),
    ("lipcheck/wellposed/*.py", r"_enclose_direct|tolerance_sweep",
     r"(?m)^\+\s*(bar = tqdm\(range\(len\(steps\)\)|for method, tol, n in tqdm\(jobs), ",
     "equivalent for every result: the progress bar's desc, leave and disable settings only change what tqdm "
     "prints to the terminal (leave: whether the finished bar stays on screen); the loop runs over the same items"),
    ("lipcheck/wellposed/enclosure.py", r"_enclose_direct", r"(?m)^\+\s*bar\.set_postfix\(",
     "equivalent for every result: the progress bar's postfix (current t and radius) only changes what tqdm prints "
     "to the terminal"),
    ("lipcheck/wellposed/solve.py", r"^prepare$", r"\.to\(dtype=dtype\)|\.to\(device=None, dtype=dtype\)",
     "equivalent on a CPU-only machine: the model and images are already on the CPU, the only device (and with "
     "device=None the target is the model's own device), so moving them there changes nothing"),
    ("lipcheck/bounds/lognorm.py", r"DenseLogNorm\.__call__", r"return out - err|unit_roundoff\(y\.dtype\) / torch",
     "now killed by tests/test_lognorm.py::test_dense_lognorm_adds_the_jacobian_rounding_allowance (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/lognorm.py", r"dense_lognorm", r"DenseLogNorm\(None,",
     "now killed by tests/test_lognorm.py::test_dense_lognorm_adds_the_jacobian_rounding_allowance (the one-call "
     "form is now called; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/lognorm.py", r"DenseLogNorm\.jacobian", r"torch\.arange\(N, \)",
     "equivalent on a CPU-only machine: no device means the default (CPU) device"),
    ("lipcheck/bounds/lognorm.py", r"token_jacobians", r"dtype=x\.dtype, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device"),
    ("lipcheck/bounds/lognorm.py", r"structured_lognorm", r'cache\.get\("VEC"\)|S\.shape\[:\+1\]',
     "efficiency only: the cached eigenvectors are never reused, so the eigensolver runs for every token; the "
     "value is certified (Cholesky or verified eigenvalue) either way"),
    ("lipcheck/bounds/lognorm.py", r"structured_lognorm", r"_cholesky_certifies\(S, q \+ 2e-3 \* \(1 \+ q\.abs\(\)\), (None)?\)",
     "equivalent: cholesky_certifies defaults u to the unit roundoff of S's dtype, the value passed"),
    ("lipcheck/bounds/lognorm.py", r"rounding_bounds", r"math\.isfinite\(k\.rho2\)\) or True",
     "loosens to a refusal: where LN2's image radius is infinite the rounding allowance becomes infinite (not "
     "proven) instead of using the state's own token norms; never a smaller number"),
    ("lipcheck/bounds/lognorm.py", r"structured_lognorm", r"gamma\(k\.hidden \+ 2 \* k\.C \+ 16, u\) / k\.W2_abs",
     "unexplained (a test is missing): an O(u) allowance divided instead of multiplied by ||W2||; the Cholesky "
     "certificate's 0.2% slack hides it from every bound-level test, so only a test of the assembly (as for the dense "
     "log-norm) would see it"),
    ("lipcheck/gaussian.py", r"_pieces", r"torch\.full_like\(sigma, [0-9.]+\)\)",
     "equivalent: the placeholder width where the other branch applies; torch.where discards that branch's values "
     "and its gradient there is zero, for any finite positive placeholder"),
    ("lipcheck/gaussian.py", r"check_representable", r'name: str = "KERNEL"|"XXuse float64, or keep sigma largerXX"',
     "equivalent for every value: text of the refusal message only"),
    ("lipcheck/gaussian.py", r"check_representable", r"is_floating_point\(\)\) and False|\(2 \* DIRECT_TERMS - 1\) \* DIRECT_TERMS",
     "now killed by tests/test_gaussian.py::test_check_representable_reads_the_dtype_of_mu_and_the_exponent_limit "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/gaussian.py", r"_dlog_moments|lattice_taps|log_normaliser_grad", r"device=None\)|dtype=mu\.dtype, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device, where mu is"),
    ("lipcheck/gaussian.py", r"symbol", r"as_tensor\(omega, dtype=None,",
     "now killed by tests/test_gaussian.py::test_batched_symbol_and_kernel_match_their_scalar_values (a frequency "
     "given as a Python number; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/gaussian.py", r"symbol", r"device=None\)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device"),
    ("lipcheck/gaussian.py", r"symbol", r"torch\.arange\(-DIRECT_TERMS, DIRECT_TERMS - 1,",
     "equivalent in floating point: the dropped lattice terms j = 6, 7 weigh at most exp(-60) relative to the "
     "centre term (sigma < 0.5), far below the unit roundoff of float32 and float64, so no computed value changes"),
    ("lipcheck/bounds/attention.py", r"attention_lipschitz_on_ball", r'_round_up\(t\["value"\] \+ t\["key_covariance"\] \+ t\["query_side"\], [2-9],',
     "loosens: the assembly margin counted for more heads than there are; a larger, still true bound"),
    ("lipcheck/bounds/majorant.py", r"ToeplitzMatvec\.__init__", r"dtype=t\.dtype, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"max\(2, init_cells / 2\)",
     "efficiency only: changes the initial cell layout along y (a fractional count rounds up in arange); every cell "
     "is still bounded by its own certified envelope"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"max\(9, min\(32,|_top_eigen\(t, H, W, None,|\(cb\[cand\] \+ low\)",
     "efficiency only: the number of anchors per round, the Lanczos warm start, or the order in which cells are "
     "refined; any anchors, start vector and refinement order give a certified bound"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r'bar = tqdm\(total=None, desc="Toeplitz majorant"',
     "equivalent for every bound: the progress bar's total only changes what tqdm prints to the terminal"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r'_no_nan\(.*"[^"a-z]*[A-Z][^"a-z]*"\)',
     "equivalent for every bound: the second argument of _no_nan only names the quantity in the refusal's message"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"_scale_back\(upper, e, up=None\)",
     "now killed by tests/test_majorant.py::test_scale_back_rounds_outward_in_the_subnormal_range (added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.remainder", r"(?m)\) - rounding$",
     "now killed by tests/test_majorant.py::test_cell_remainder_bounds_and_matches_taylor (a cell of radius 0 keeps "
     "a positive rounding allowance; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/attention.py", r"layernorm_image_radius", r"gamma\(C \+ 4, \)\)",
     "equivalent: gamma's default unit roundoff is float64's, the u passed"),
    ("lipcheck/rounding.py", r"rump_shift", r"\+ [5-9] \* \(2 \* n \+ 1\) \* (?:_eta|tiny_subnormal)",
     "loosens: a larger shift for underflow (by multiples of the smallest subnormal, ~5e-324): a larger, still "
     "valid margin"),
    ("lipcheck/rounding.py", r"_real_gram", r"eG = gamma\(u\) \* F2",
     "now killed by tests/test_lognorm.py::test_norm2_upper_gram_allowance_is_the_formula_and_zero_results_are_float64 "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/rounding.py", r"norm2_upper", r"return torch\.zeros\(batch, dtype=None,",
     "now killed by tests/test_lognorm.py::test_norm2_upper_gram_allowance_is_the_formula_and_zero_results_are_float64 "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/rounding.py", r"norm2_upper", r"\(1 \+ gamma\(6, \)\)",
     "equivalent: gamma's default unit roundoff is float64's, the u norm2_upper works in (every input is converted "
     "to float64 first)"),
    ("lipcheck/rounding.py", r"norm2_upper", r"dtype=torch\.float64, \)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device"),
    ("lipcheck/bounds/network.py", r"_ln_constants", r"torch\.zeros\(C, dtype=None\)",
     "equivalent: zeros are exact in every dtype and are converted to the certification dtype before use"),
    ("lipcheck/bounds/network.py", r"mlp_lipschitz|mixer_lipschitz", r"\.to\(dtype=None, device=device\)|ssog_params\(mixer, device=device\)",
     "changes only the precision the bound is computed in: the layer's own dtype (or float64) instead of the "
     "requested one; identical for float64 layers certified in float64 (every caller), and otherwise still a "
     "certified bound (higher precision under the margins of the lower)"),
    ("lipcheck/bounds/spectral.py", r"SymbolNorm\.anchor_bound", r'einsum\("NAH,AH->NA"',
     "equivalent: torch.einsum takes upper-case subscripts for the same contraction"),
    ("lipcheck/bounds/spectral.py", r"certified_max_points", r"ub >= best \* \(1 \+ rtol\)",
     "efficiency only: cells whose bound ties the target are refined once more; every retired cell is bounded"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"rounds \+= [2-9]",
     "loosens (efficiency only): fewer refinement rounds within max_rounds; every round's bound is certified"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"steps_cap = int\(max\([3-9],|\) < gap_goal \* 0\.9",
     "efficiency only: the Lanczos step cap under a tiny memory budget, or stopping one check later on an exact "
     "tie with the target gap; the bounds are certified (deterministic) or probabilistic with the checks counted"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"phase = torch\.exp\(2j \*",
     "changes only the phase of the symbol-guided start vector on large grids: the lower bound is still an "
     "attained ratio ||T v|| / ||v||, and the random-start run still sets the reported probabilistic bound"),
    ("lipcheck/bounds/spectral.py", r"_scale_back", r"math\.isnan\(v\) and \(",
     "now killed by tests/test_bounds.py::test_scale_back_refuses_nan_and_rounds_outward (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"_scaled", r"upper=_scale_back\(m\.upper, e, up=None\)",
     "now killed by tests/test_bounds.py::test_circulant_bound_scaled_back_outward_in_the_subnormal_range (added "
     "after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"\(b \+ up / F\[0\]\)",
     "equivalent in floating point: F_0 = ||fl(G_0 / f_0)||_F (1 + gamma) is 1 to within ~n^2 u, so u' F_0 and "
     "u' / F_0 differ by ~2 u gamma (about 1e-29) relative to f_0, far below one ulp of the bound; on 140 random "
     "matrices (n = 2..66, scales 1..20) not one output bit changed"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"ek = g\(n\) \+ [3-9] \* u",
     "loosens: a larger allowance for the rounding of each squaring, still a certified bound"),
    ("lipcheck/bounds/spectral.py", r"truncated_symbols", r"k = torch\.arange\(-\(n - 1\), n, dtype=None,",
     "equivalent: the integer offsets |k| < 2^24 are exact in float32 and promote to mu's dtype in the kernel; "
     "on 48 layer/grid pairs in float32 and float64 not one output bit or dtype changed"),
    ("lipcheck/bounds/spectral.py", r"_scale_back", r"if v == 1\.0:",
     "now killed by tests/test_bounds.py::test_scale_back_refuses_nan_and_rounds_outward (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"normalised", r"if ea != ev == eo == 0:",
     "now killed by tests/test_bounds.py::test_normalised_moves_every_scale_out_exactly (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"certified_max_points", r"rtol: float = 1\.000000001",
     "now killed by tests/test_bounds.py::test_certified_max_points_default_tolerance (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"_upper_half", r"\(k == 0\) & \(l > 0\)",
     "equivalent: the masks differ only at the offset (0, 0), which t.flip(0, 1) maps to itself"),
    ("lipcheck/bounds/majorant.py", r"spectral_mass", r"wy, wx = w\[:, 0\] - oy \* r\[:, 0\]",
     "equivalent up to the order of a sum: the offsets (0, 0) and (+-1, +-1) are symmetric in oy, so the same five "
     "points are summed; the mass only steers refinement, every cell is bounded whatever it is"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.corner_bounds", r"sub = None",
     "efficiency only: every anchor instead of the nearest ones (a tighter or equal bound at more cost); any subset "
     "of anchors gives a certified bound"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"len\(history\) > [5-9] and history\[-5\]",
     "efficiency only: the stall test starts one round later; every stopping point gives a certified bound"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.remainder", r"2 \* D1\[\.\.\., 1\] \* D1\[\.\.\., 1\]",
     "now killed by tests/test_majorant.py::test_cell_remainder_cross_term_with_shifted_kernels (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_coefficients", r"gamma\(4 / J \+ 8, dt\)",
     "now killed by tests/test_majorant.py::test_coefficient_rounding_bound_carries_the_sum_allowance (added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"kb\.mean\(-1\) - rho - cb\)\.clamp_min\(0\)\)\.sum\(\)",
     "now killed by tests/test_majorant.py::test_excess_estimate_tracks_the_true_excess (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"cb = torch\.minimum\(cb, sn\.bound\(c, None\)\)",
     "efficiency only: every anchor instead of the newest ones (a tighter or equal cell bound at more cost); any "
     "subset of anchors gives a certified bound"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"r \* \(1 - q\.gamma\([3-9] \* n \+ 4\)\)",
     "loosens: a larger relative allowance subtracted from the lower bound, which stays below ||T||"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"\+ W \+ 8\) / B",
     "now killed by tests/test_bounds.py::test_result_records_its_margins_and_diagnostics (result.margins records "
     "apply_error, pinned to proofs/S2.md at 50 digits; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"_check_grid_size", r'\(\("h", H\)',
     "now killed by tests/test_bounds.py::test_bad_grid_size_names_the_argument (added after this run, checked by "
     "applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r'desc="Toeplitz majorant", disable=not progress, leave=None\)',
     "equivalent for every bound: whether tqdm leaves the finished progress bar on the terminal"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"(?m)^\+\s+return  # stalled while",
     "now killed by tests/test_majorant.py::test_stalled_refinement_returns_a_certified_bound (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"if H \* W >= 1024:",
     "equivalent: at N = 1024 the repeated final estimate is _top_eigen's dense eigh of the same coefficients, the "
     "value the loop already has; any estimate is then Cholesky-certified"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.corner_bounds", r"nearest: int = [3-9]",
     "efficiency only: more anchors tried per cell (a tighter or equal bound at more cost); any subset of anchors "
     "gives a certified bound"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.corner_bounds", r"c\[i:i \+ 4096\]\.to\(None\)",
     "equivalent: the coefficients already have SymbolNorm's complex dtype (the conversion is a no-op), and the "
     "distance only chooses which anchors to try"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.remainder", r"self\.c_abs\[None\] - self\.eta_c\[None\]",
     "now killed by tests/test_majorant.py::test_cell_remainder_bounds_and_matches_taylor (the radius-0 allowance "
     "pinned to proofs/S2.md at 50 digits; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r"zero = torch\.zeros\(B, \)",
     "equivalent: zeros are exact in every dtype and promote to the distance's float64 when added; CPU only"),
    ("lipcheck/wellposed/enclosure.py", r"_enclose_direct", r"err_d2=ev \* sum\(j \* \(j - 1\) \* cn\[j\] for j in range\([3-9], 5\)\)",
     "code removed since: err_d2 was never read (an equivalent mutant); the step record no longer holds it"),
    ("lipcheck/wellposed/enclosure.py", r"_enclose_direct", r'smp\["XXyXX"\] = None',
     "memory only: the sampled states of the previous step are then kept until the next step replaces them; no "
     "result reads them"),
    ("lipcheck/wellposed/enclosure.py", r"enclose_field", r"K = math\.ceil\(len\(rpieces\[0\]\) / 1\.25",
     "tightness only: the reference's re-solve gets fewer grid steps (a less accurate reference); the enclosure "
     "around any reference is proven, and the tightness tests allow for this factor"),
    ("lipcheck/wellposed/gradients.py", r"gradient_check", r'rel_x0 = float\(\(a\["grad_x0"\] \+ b\["grad_x0"\]\)',
     "now killed by tests/test_wellposed.py::test_adjoint_and_backprop_gradients_against_finite_differences "
     "(rel_diff_x0 against the "
     "two returned gradients; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/sweep.py", r"_fit_slope", r"ly \+ ly\.mean\(\)",
     "equivalent up to rounding: lx is centred (sum lx = 0), so sum lx (ly +- mean ly) = sum lx ly"),
    ("lipcheck/wellposed/sweep.py", r"convergence_summary", r'"(loosest|tightest)": \{"TOL"',
     "now killed by tests/test_wellposed.py::test_tiny_model_sweep_converges (the loosest and tightest records "
     "against the runs; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/sweep.py", r"tolerance_sweep", r"finals\[\(method, tol if tol is not None else n\)\] = out\[\+1\]",
     "equivalent: the solve returns the states at the two times (0, t1), so out[1] is out[-1]"),
    ("lipcheck/wellposed/sweep.py", r"tolerance_sweep", r"(?m)^\+\s+seconds = None",
     "now killed by tests/test_wellposed.py::test_sweep_run_records_and_a_given_reference (every run's wall time is "
     "a positive float; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/*.py", r".*", r"(?m)^\+.*(device=None\)|device=None,)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device, where the states are"),
    ("lipcheck/bounds/attention.py", r"_layernorm_affine", r'\("WEIGHT", g\)',
     "now killed by tests/test_attention_bounds.py::test_layernorm_without_affine_and_bad_norms (the refusal names "
     "'LayerNorm weight'; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"_pow2_exponent", r"if t\.numel\(\) else 1\.0",
     "equivalent for every layer: it is called on alpha, W_V, W_O and the dense operator, never empty (a layer has "
     "at least one head, component and channel)"),
    ("lipcheck/bounds/spectral.py", r"derivative_bounds", r"j = torch\.arange\(-R, R \+ 1, device=p\.mu\.device\)",
     "equivalent: the int64 offsets |j| <= R (a few hundred) are added to round(mu) and promote exactly to mu's "
     "floating dtype"),
    ("lipcheck/bounds/spectral.py", r"truncated_symbols", r"k = torch\.arange\(-\(n - 1\), n, dtype=p\.mu\.dtype, \)",
     "equivalent on a CPU-only machine: without device= the offsets are made on the default (CPU) device, where "
     "the parameters are"),
    ("lipcheck/bounds/spectral.py", r"SymbolNorm\.anchor_bound", r"e = self\.ip \* DF \* \(1 - delta\)\.square\(\)",
     "unobservable: delta (the normalisation error of the anchor's singular vectors) is O(u), so (1 - delta)^2 for "
     "(1 + delta)^2 changes one rounding allowance by O(u) relative; true rounding is far below the worst-case term "
     "on any input a test can draw, and the term is fixed by proofs/S2.md"),
    ("lipcheck/bounds/lognorm.py", r"_top_vectors", r"torch\.eye\(n, dtype=None, device=S\.device\)\)$|torch\.eye\(n, dtype=None, device=S\.device\)\)\n",
     "equivalent: the identity's zeros and ones are exact in every dtype and torch.where promotes them to S's dtype "
     "(and the vectors are only a guess for the next Cholesky certificate, never a bound)"),
    ("lipcheck/bounds/lognorm.py", r"DenseLogNorm\.__call__", r"_cholesky_certifies\(S, q \+ self\.pad \* \(1 \+ q\.abs\(\)\), None\)",
     "equivalent: cholesky_certifies takes u = None as the unit roundoff of S's dtype, the value passed"),
    ("lipcheck/wellposed/solve.py", r"reference_solution", r"rel_tol: float = 1\.0000000000001",
     "now killed by tests/test_wellposed.py::test_reference_solution_stopping_rules (the default rel_tol 1e-13 on a "
     "field that needs 512 steps; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/certificate.py", r"aposteriori_certificate", r"fk = dict\(dtype=dtype, \)",
     "equivalent on a CPU-only machine: without device= the tensors are made on the default (CPU) device, where "
     "x0 already is"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r"if q > 1 or \(ky > 0",
     "not a lie: drops the jump margin of the piece after a cut inside an interval, which covers the ulp sliver where "
     "the previous step's polynomial is still evaluated; the piece before the cut carries the same margin and bounds "
     "that polynomial up to the cut (its node-displacement allowances cover the ulps), and the interval reports the "
     "maximum over its pieces"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r"\* \(1 - ln\.gamma\(8, u\)\) \+ ev \* \(yinfo",
     "unobservable: rounds the jump's computed norm down by gamma_8 instead of up, an O(u) relative change in a "
     "margin whose ev * abs_sum term is larger still; only the proof (proofs/S5.md) fixes it"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r"\+ [5-9] \* u \* hr / hy",
     "loosens: a larger allowance for the rounding of the reference's node times"),
    ("lipcheck/wellposed/enclosure.py", r"_rough_distance", r"b \+ a, 0\)\[0\]",
     "tightness only: _rough_distance is a scale for tuning the reference's grid (its docstring: not a bound); the "
     "enclosure is proven around whatever reference it yields"),
    ("lipcheck/wellposed/enclosure.py", r"enclose_field", r'"XXnfe_dense_outputXX": sol\["nfe_dense_output"\]',
     "now killed by tests/test_enclosure.py::test_summary_reports_distance_and_reference_radius_at_t1 (the user "
     "solve's counts against a repeated solve; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/gronwall.py", r"flow_map", r"t = torch\.tensor\(\[0\.0, t1\], device=x\.device\)",
     "now killed by tests/test_wellposed.py::test_flow_map_is_fixed_step_rk4 (an end time float32 cannot hold; "
     "added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/certificate.py", r"aposteriori_certificate", r'"XXtolXX": tol|max\(2 \* math\.ceil',
     "now killed by tests/test_wellposed.py::test_linear_certificate_bounds_the_exact_error (the record's tol and at "
     "least 8 intervals per step by default; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r'yinfo\[ky\]\["dsig"\] \* \(1 - ev\)|yinfo\[k - 1\]\["abs_sum"\]',
     "unobservable: changes one rounding-allowance term by O(u) relative (a factor 1 - ev for 1 + ev, or the "
     "neighbouring step's abs_sum in an ev-sized term); true rounding is far below these worst-case terms on any "
     "input a test can draw, so only the proof (proofs/S5.md) fixes them"),
    ("lipcheck/wellposed/enclosure.py", r"_rough_distance", r"_poly\(coefs\[ky\], s, None, 0\)",
     "tightness only: _rough_distance is a scale for tuning the reference's grid (its docstring: not a bound); the "
     "enclosure is proven around whatever reference it yields"),
    ("lipcheck/wellposed/enclosure.py", r"rayleigh_lower", r'\(hasattr\(field, "jacobian"\)\) or True',
     "now killed by tests/test_enclosure.py::test_rayleigh_lower_without_a_jacobian_method_uses_the_dense_jacobian "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/gradients.py", r"_PassCounter\.clamped", r"abs\(dt\) < self\.min_step",
     "now killed by tests/test_wellposed.py::test_min_step_clamp_count_includes_steps_at_the_floor (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/gronwall.py", r"perturbation_growth", r"\(grid is None\) and False|\"XXgridXX\"",
     "now killed by tests/test_wellposed.py::test_perturbation_growth_default_grid_and_report_against_an_independent_solve "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/solve.py", r"reference_solution", r"n > min_steps\)",
     "costs one more doubling: the reference is still converged and its error estimate is still the last change"),
    ("lipcheck/wellposed/enclosure.py", r"Enclosure\.summary", r'"XXdistance_t1XX"',
     "now killed by tests/test_enclosure.py::test_summary_reports_distance_and_reference_radius_at_t1 (added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"enclose_field", r"ref_seconds = time\.perf_counter\(\) - start \+ solve_seconds",
     "equivalent for every result: a timing entry of the statistics"),
    ("lipcheck/wellposed/enclosure.py", r"enclose_field", r"piecewise_quartic\(sf, x0, t1, method=method, grid_steps=K\)",
     "now killed by tests/test_enclosure.py::test_reference_solves_are_made_at_ref_tol (added after this run, checked "
     "by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r"info\(c, None\)",
     "code removed since: the step length it dropped was never read by _distance (an equivalent mutant), and info() "
     "no longer records it"),
    ("lipcheck/wellposed/enclosure.py", r"_distance", r"\.all\(\)\) and s1 == s0",
     "now killed by tests/test_enclosure.py::test_distance_keeps_a_whole_piece_whose_bound_is_within_one_percent "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_enclose_direct", r"if k != 0:",
     "now killed by tests/test_enclosure.py::test_point_lognorms_are_those_at_the_reported_centres (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_enclose_direct", r'out\["why"\] if "where" in out else out\["why"\]',
     "equivalent: both branches give out['why']"),
    ("lipcheck/wellposed/enclosure.py", r"_bootstrap", r"muXX=mu",
     "now killed by tests/test_enclosure.py::test_failed_interval_records_the_tube_and_lognorm_it_checked (added "
     "after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/sweep.py", r"tolerance_sweep", r"input_scale=input_scale, device=device, dtype=None\)",
     "now killed by tests/test_wellposed.py::test_sweep_runs_in_the_requested_dtype_on_a_float32_model (added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.__init__", r'\("XXD2XX", self\.D2\)',
     "equivalent for every bound: the name only labels the quantity in the refusal's message"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.corner_bounds", r"self\.sn\.bound\(pts\.reshape\(-1, pts\.shape\[-1\]\), None\)",
     "efficiency only: every anchor instead of the given subset; any set of anchors gives a certified bound"),
    ("lipcheck/bounds/majorant.py", r"_certify|toeplitz_majorant", r"dtype=dtype, \)|dtype=torch\.bool, device=None\)",
     "equivalent on a CPU-only machine: no device means the default (CPU) device"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"clamp_min\(0\) / \(level < MAX_LEVELS\)|\(level <= MAX_LEVELS\)",
     "efficiency only: the refinement priority of cells at the deepest level; every cell keeps its own certified "
     "envelope whatever the order"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"\(mu \+ margin\) \* \(1 - 2 \* u\)",
     "now killed by tests/test_majorant.py::test_final_bound_covers_its_certified_parts_exactly (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/gronwall.py", r"token_speed_bound", r"\) - vec\(mixer\.o_proj\.bias\)",
     "now killed by tests/test_wellposed.py::test_token_speed_bound_holds_where_the_output_bias_dominates (added "
     "after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/certificate.py", r"aposteriori_certificate", r"token_speed_bound\(block, dtype=None,",
     "computes the sampled certificate's token-speed constant in the model's own dtype instead of the requested one: "
     "identical for float64 models (every caller and test); for a float32 model the constant moves by float32 "
     "rounding. That certificate is the sampled (not interval-rigorous) one; the proven enclosure does not use it"),
    ("lipcheck/wellposed/enclosure.py", r"SSoGField\.lognorm", r'lognorm_kind == "XXdenseXX"',
     "now killed by tests/test_enclosure.py::test_ssog_field_pieces_against_the_block (the dense kind equals the "
     "log-norm of autograd's Jacobian to 1e-9; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_bern_sup", r"// math\.factorial\(k\) / c\[k \+ d\]",
     "now killed by tests/test_enclosure.py::test_bern_sup_bounds_the_derivative_and_is_exact_where_it_is_affine "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/enclosure.py", r"_enclose_direct", r'field\.lognorm\(yp, None, eps_J\)',
     "equivalent: SSoGField.lognorm does not read its second argument (the variance floor enters through eps_J "
     "and the field's constants)"),
    ("lipcheck/wellposed/sweep.py", r"tolerance_sweep", r'runs\.append\(\{"MIXER": mixer',
     "now killed by tests/test_wellposed.py::test_linear_sweep_reference_and_errors_match_expm (each run names its "
     "mixer; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/sweep.py", r"convergence_summary", r"if finals is not None or len\(at\) > 1:",
     "now killed by tests/test_wellposed.py::test_convergence_summary_recovers_known_orders (the spread with and "
     "without final states; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/wellposed/solve.py", r"reference_solution", r"len\(history\) >= 4",
     "costs one more doubling: the round-off floor is declared one halving later; the reference is still converged "
     "and its error estimate is still the last change"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free|_finite", r'_finite\(upper, None\)',
     "equivalent for the bound: the argument only names the quantity in the refusal's message"),
    ("lipcheck/bounds/spectral.py", r"coefficient_error", r"\(1 - ey\)",
     "margin changed at second order (ey ~ u, so the change is O(u^2) relative), far below what any input can show"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"shift = [3-9] \* g\(n\)",
     "loosens: a larger rounding shift below the Ritz values only raises the bound"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"rest = F\[-2\]",
     "equivalent up to rounding: every Gram iterate is normalised to Frobenius norm 1, so F[-2] and F[-1] are "
     "both 1 within a few u (each already rounded up)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r'info\["lanczos_symbol_start"\] = dict\(',
     "equivalent for every bound: a diagnostic entry of result.info that no number is computed from"),
    ("lipcheck/bounds/spectral.py", r"SymbolNorm\.bound", r"torch\.zeros\(0, dtype=None|torch\.zeros\(0, device=c\.device\)",
     "equivalent: the branch is unreachable (splitting any c, even an empty one, yields at least one chunk) and "
     "would return an empty tensor, whose dtype no caller reads"),
    ("lipcheck/bounds/spectral.py", r"ssog_params", r'"XXo_proj\.weightXX"\), raw\)',
     "now killed by tests/test_bounds.py::test_bad_inputs_refused (each parameter's refusal names it; added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"SymbolNorm\.anchor_bound", r"\(2 \+ self\.p\.gamma\(2\)\)",
     "now killed by tests/test_bounds.py::test_anchor_margins_are_the_formulas_of_proofs_S2 (now also far from the "
     "anchors, where the first-order bound is the smaller; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r'method\["XXexactXX"\] = "not computed"',
     "now killed by tests/test_bounds.py::test_bad_inputs_refused (result.method records that no exact value was "
     "computed; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r'bar = tqdm\(total=None, desc="resolution-free sup"',
     "equivalent for every bound: the progress bar's total only changes what tqdm prints to the terminal"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"best, used = math\.inf, [1-9]",
     "equivalent: `used` is returned only with a finite best, and every finite candidate that becomes best sets it "
     "(an infinite best is refused by _finite before anything is returned)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"theta_err\(None\)",
     "equivalent: theta_err's allowance gamma_{4n+8} B^2 depends on n and B only, not on its argument"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"phase = torch\.exp\(1j \* \(circ\.argmax\[0\] \* iy\[:, None\] - ",
     "changes only the phase of the symbol-guided start vector on large grids: the lower bound is still an "
     "attained ratio ||T v|| / ||v|| (a worse start only makes it smaller), and the random-start run still sets "
     "the reported probabilistic bound"),
    ("lipcheck/bounds/lognorm.py", r"structured_lognorm", r"gamma\(k\.hidden - 2 \* k\.C \+ 16",
     "margin changed by O(u) relative (gamma of a smaller count): set by proofs/S5.md Lemma 4, not observable by a test"),
    ("lipcheck/bounds/lognorm.py", r"token_jacobians", r"torch\.ones\(C, device=x\.device\)",
     "equivalent: ones are exact in float32 and promote to the state's dtype in the product"),
    ("lipcheck/bounds/lognorm.py", r"token_jacobians", r"expand\(\*x\.shape\[:-1\], None, C\)",
     "now killed by tests/test_enclosure.py::test_token_jacobians_without_layernorm_are_the_identity_and_the_mlp_jacobian "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/rounding.py", r"rump_shift", r"gn \* \(1 - 2 \* gn\)",
     "margin changed at second order (gn ~ n u, the change is O(gn^2)); set by proofs/S2.md (Rump's criterion), "
     "not by a test"),
    ("lipcheck/rounding.py", r"verified_lambda_max|cholesky_certifies", r"n = S\.shape\[-2\]",
     "equivalent: S is square"),
    ("lipcheck/bounds/lognorm.py", r"FieldConstants\.lipschitz", r"ln_jacobian\(None, v\)",
     "equivalent: ln_jacobian reads any argument other than 1 as LN2"),
    ("lipcheck/bounds/spectral.py", r"derivative_bounds", r"p\.mu\.abs\(\) - R \+ 1",
     "shrinks the polynomial prefactor of the lattice tail beyond |k - round(mu)| > 12 sigma + 12, a term below "
     "exp(-72) (~1e-31) of the sums it is added to: no float64 input can show it; the tail is fixed by the proof "
     "in derivative_bounds' docstring, not by a test"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"range\(squarings \+ [2-9]\)",
     "equivalent: the loop always leaves through the break at k == squarings"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"\* F\[-1\] \* \(1 - g\(4\)\)",
     "margin changed at second order: e_B is already O(n u), the factor moves it by O(u) relative"),
    ("lipcheck/bounds/spectral.py", r"tap_error", r"p\.gamma\((9|1[0-9])\)",
     "loosens: the a-priori tap error bound a few u larger"),
    ("lipcheck/bounds/spectral.py", r"certified_max_points", r"ub > best \* \(1 - rtol\)",
     "now killed by tests/test_bounds.py::test_constant_modulus_symbol_needs_one_batch_of_svds (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r'seconds\["CIRCULANT"\]|info\["circulant"\] = dict\(argmax',
     "now killed by tests/test_bounds.py::test_result_records_every_stage (added after this run, checked by "
     "applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"exact = _scale_back\(s1, e2, up=None\)",
     "now killed by tests/test_bounds.py::test_exact_value_in_the_subnormal_range_is_rounded_up (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"SymbolNorm\.__init__", r"self\.ip = p\.gamma\(2 \* C \+ self\.d \+ [3-9] \* self\.h",
     "loosens: the inner-product rounding margin of the anchor quantities a few u larger"),
    ("lipcheck/rounding.py", r"_real_gram|norm2_upper|rump_shift", r"\* \(m - 2\) \* n \* (?:_eta|tiny_subnormal)|\(2 \* n \+ 2\) \* (?:_eta|tiny_subnormal)|\(2 / n \+ 1\) \* (?:_eta|tiny_subnormal)",
     "equivalent at every tested scale: changes a multiple of the smallest subnormal number (~5e-324) in a margin "
     "of a matrix scaled to entries in [1/2, 1); only products that underflow would tell them apart"),
    ("lipcheck/rounding.py", r"_real_gram", r"torch\.cat\(\[A, \+B\], -1\)",
     "equivalent: Cholesky (cholesky_ex) and eigvalsh read only the lower triangle, where the block is B; the "
     "upper-right block's sign is never read"),
    ("lipcheck/rounding.py", r"norm2_upper", r"device=None\)",
     "equivalent on a CPU-only machine: device=None means the default (CPU) device"),
    ("lipcheck/rounding.py", r"norm2_upper", r"X\.shape\[-2\] <= X\.shape\[-1\]",
     "equivalent: for a square M it takes the Gram matrix of M^* instead of M, the same spectrum and the same "
     "error bound (m = n)"),
    ("lipcheck/rounding.py", r"norm2_upper", r"torch\.as_tensor\(s, device=M\.device\)",
     "equivalent: s is only the guess that the Cholesky certificate tests; its dtype changes no certified value"),
    ("lipcheck/rounding.py", r"norm2_upper", r"rel = [5-9] \* \(gamma",
     "now killed by tests/test_lognorm.py::test_norm2_upper_is_the_documented_certificate (the first pad pinned; "
     "added after the seed-37 run, checked by applying the mutant by hand)"),
    ("lipcheck/rounding.py", r"verified_lambda_max", r"4 / n \* u \* scale",
     "changes only the first try's pad: whatever mu the Cholesky certificate accepts is a proven bound, and a "
     "smaller pad gives an equal or tighter one (the tests bound it from both sides at 1e-9)"),
    ("lipcheck/rounding.py", r"verified_lambda_max", r"val - 0\.0",
     "equivalent: val - 0.0 and val + 0.0 are the same float for the positive or finite val here"),
    ("lipcheck/rounding.py", r"verified_lambda_max", r"pad = pad / 10",
     "now killed by tests/test_lognorm.py::test_verified_lambda_max_against_40_digits (a guess 1e-9 below the top "
     "eigenvalue must be certified within a few tries; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"coefficient_error|truncated_symbol_error|gram_bound|interlacing_tail|SymbolNorm\.anchor_bound",
     r"p\.gamma\(M - 3\)|e\[\.\.\., ax\] - p\.gamma|\*\* 2 / \(1 - g\(4\)\)|\* \(1 - self\.p\.gamma\(16\)\)",
     "now killed by tests/test_bounds.py::test_symbol_rounding_allowances_are_the_formulas_of_proofs_S2, "
     "::test_interlacing_tail_is_the_formula_of_proofs_S2 and ::test_anchor_margins_are_the_formulas_of_proofs_S2 "
     "(each margin re-derived from proofs/S2.md at 50 digits; added after this run, checked by applying the mutant "
     "by hand)"),
    ("lipcheck/bounds/spectral.py", r"derivative_bounds", r"\) - 2 \* \(2 \* R \+ 1\) \* torch\.finfo",
     "now killed by tests/test_bounds.py::test_derivative_bounds_are_the_formula_and_cover_flushed_taps (sigma = 0.02 "
     "at integer mu flushes every tap but the centre's, so the term carries D1 alone; added after this run, checked "
     "by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"derivative_bounds", r"torch\.arange\(-R, R \+ 2",
     "loosens: one more nonnegative lattice term in D1 and D2"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"best \* rtol \* 2\)",
     "changes only which cells are split (how fast branch and bound converges); every cell is still retired by "
     "its own certified bound, so the result is certified either way"),
    ("lipcheck/bounds/spectral.py", r"circulant_bound", r"q\.alpha\.to\(None\)",
     "equivalent: Tensor.to(None) returns alpha unchanged and einsum promotes it to the symbols' complex dtype"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"if K == len\(f\) - 1 or ritz_b",
     "equivalent in exact arithmetic: the normalised iterates' norms ||N_k|| = (sum_i (l_i / l_1)^(2^(k+1)))^(-1/2) "
     "increase with k, so the last level's interlacing bound also bounds every earlier level"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"f\.append\(None\)",
     "equivalent (unreachable code): T is scaled to max entry in [1/2, 1), so T^T T has a diagonal entry >= 1/4, and "
     "every later iterate is normalised to Frobenius norm 1, so its square has Frobenius norm >= 1/sqrt(n): no "
     "Frobenius norm ever rounds to 0 and the branch never runs"),
    ("lipcheck/bounds/spectral.py", r".*",
     r'(?m)^\+.*(_finite|_no_nan)\(.*("XX[^"]*XX"|"[^"a-z]*[A-Z][^"a-z]*"|"dense svd"|"lanczos rayleigh quotient"|'
     r'"lanczos ritz value"|"gram iteration bound")|^\+.*(_finite|_no_nan)\([\w.\[\]]+, None\)',
     "equivalent for every bound: the second argument of _finite / _no_nan only names the quantity in the refusal's "
     "message"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r'(?m)^\+(?!.*, upper =).*(method|seconds)\["[a-z_]+"\].*=',
     "equivalent for every bound: the description text or the timing of a stage in result.method / result.seconds, "
     "from which no number is computed"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"symbol_sup_lowerXX",
     "now killed by tests/test_bounds.py::test_result_records_every_stage (added after this run, checked by "
     "applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"win = torch\.sin\(math\.pi \* \(iy\[:, None\] - 1\)",
     "changes only the window of the symbol-guided start vector on large grids: the lower bound is still an "
     "attained ratio ||T v|| / ||v||, and the random-start run still sets the reported bounds"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"0\.0\) \* \(1 - eps\)\)",
     "now killed by tests/test_bounds.py::test_probabilistic_bound_meets_its_target_gap (the stopping rule's "
     "estimate stopped the run before the target; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r'float\("INF"\)',
     "equivalent: float() parses 'INF' and 'inf' alike"),
    ("lipcheck/bounds/spectral.py", r"resolution_free_bound", r"max_cells: int = 400001",
     "loosens (efficiency only): a cell budget one larger lets branch and bound split once more when it reaches the "
     "budget; every cell is retired or reported by its own certified bound either way"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"int\(1e8 \* p\.dim \*\* 3\)",
     "efficiency only: the number of SVD anchors per round (64 for every C <= 116, where 1e8 / C^3 >= 64); "
     "each anchor's bound is certified, so the result is certified with any number of anchors"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"q = D2\[\.\.\., 1\] \* ry|cy = \(torch\.arange\(ny, dtype=dt, device=dev\) \+ 0\.5\) / 2",
     "now killed by tests/test_bounds.py::test_resolution_free_covers_the_torus_and_bounds_each_axis_by_its_own_derivative "
     "(added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/spectral.py", r"SSoGBound\.as_dict|ssog_lipschitz", r'd\["GAP"\]|method\["UPPER_PROBABILISTIC"\]',
     "now killed by tests/test_bounds.py::test_result_records_its_margins_and_diagnostics (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/network.py", r"vector_field_lipschitz", r"_ln_constants\(block\.norm[12], v, None, device\)",
     "equivalent at float64 (the default dtype, used by every caller): dtype=None keeps the LayerNorm's own float64 "
     "parameters, and the constants are Python floats either way"),
    ("lipcheck/bounds/majorant.py", r"_lower_estimate", r'einsum\("NAH,AH->NA"',
     "equivalent: torch.einsum takes upper-case subscripts for the same contraction"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"dtype=dt, \)",
     "equivalent on a CPU-only machine: without device= the grid is made on the CPU, the layer's own device here"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"kb\.mean\(\+?1\)",
     "equivalent: kb is always (cells, 4), so its dimension 1 is its last dimension"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r'"XXsigmaXX"',
     "now killed by tests/test_majorant.py::test_non_finite_raises (the refusal names the parameter; added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"need = \(cb\[cand\] - low\) >= 0\.25",
     "now killed by tests/test_majorant.py::test_zero_layer_bound_is_zero_without_anchors (the tie 0 >= 0 of a zero "
     "symbol spends SVDs; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"new = None",
     "changes only which certified bounds re-bound the heavy cells after a batch of SVDs (every anchor for the "
     "centres, the cheap bound and the nearest two anchors for the corners, instead of the new batch): any set of "
     "anchors gives a valid bound (CellModel.corner_bounds), so the result stays certified; on two layers checked by "
     "hand it moved the bound by < 3e-6 relative (slightly tighter, at more cost), which no true-bound test can see"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.corner_bounds", r"\.abs\(\) / F\)\.sum",
     "now killed by tests/test_majorant.py::test_corner_bounds_pick_the_anchor_nearest_in_the_symbol (added after "
     "this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"CellModel\.corner_bounds", r"c\.shape\[0\] == 1:",
     "now killed by tests/test_majorant.py::test_corner_bounds_tight_at_anchored_cells (added after this run, "
     "checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"spectral_mass", r"oy \* r\[:, 1\]",
     "now killed by tests/test_majorant.py::test_spectral_mass_against_direct_sums (added after this run, checked by "
     "applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_coefficients", r"phase_error\([HW] - 2, u\)",
     "now killed by tests/test_majorant.py::test_coefficient_rounding_bound_against_proof (the allowance pinned to "
     "proofs/S2.md at 50 digits; added after this run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"if excess <= rtol \* lam and new_anchor:",
     "now killed by tests/test_majorant.py::test_refinement_stops_once_the_excess_is_below_rtol (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"t_err \* \(1 - q\.gamma\(4\)\)",
     "now killed by tests/test_majorant.py::test_tight_on_a_positive_symbol_and_margin_assembled_as_in_proof (the "
     "margin checked against (2H - 1)(2W - 1) e_t in exact rationals; added after this run, checked by applying the "
     "mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"ToeplitzMatvec\.__init__", r"c = torch\.zeros\(2 \* W,",
     "now killed by tests/test_majorant.py::test_toeplitz_matvec_and_dense_matrix_against_loops (added after this "
     "run, checked by applying the mutant by hand)"),
    ("lipcheck/bounds/majorant.py", r"toeplitz_majorant", r"len\(history\) > 5",
     "costs one round only: the stall test fires one round later; every stopping point gives a certified bound "
     "(toeplitz_majorant's docstring), so no true-bound test sees it"),
    # seed-34 sample (spectral and rounding after the anchors' Lanczos guess and the LAPACK Cholesky path)
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"max\(5, min\(64, int\(1e8",
     "efficiency only: the number of anchors per round; each anchor's bound is certified"),
    ("lipcheck/bounds/spectral.py", r"_resolution_free", r"\(ub - cb\) >= best \* rtol / 2",
     "efficiency only: which cells are split (a tie at exactly rtol/2 splits too); any set of cells gives a certified "
     "bound"),
    ("lipcheck/bounds/spectral.py", r"certified_max_points", r"best, arg = -1\.0, 1",
     "equivalent: every symbol norm is >= 0 > -1, so the first anchor's index replaces arg before it is read"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"\* \(1 \+ g\(5\)\)",
     "loosens: a larger rounding allowance (gamma_5 for gamma_4)"),
    ("lipcheck/bounds/spectral.py", r"gram_bound", r"/ \(1 \+ g\(6\)\)|tF \*\* 3",
     "shrinks (or scales by ||T||_F ~ 1) a rounding allowance of Gram iteration of a few u relative: the tests' "
     "exact values sit further below the bound than that, so no float64 input here exhibits it; not equivalent"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"gave_upper=None",
     "report field only (info['majorant']['gave_upper']): no bound reads it"),
    ("lipcheck/bounds/spectral.py", r"ssog_lipschitz", r"deflated_bound\(q, H, None",
     "outside the group's test selection (tests/test_bounds.py): tests/test_deflation.py::"
     "test_ssog_lipschitz_takes_the_deflated_bound calls ssog_lipschitz(deflated=True), where W=None raises"),
    ("lipcheck/bounds/spectral.py", r"top_singular_guess", r"dtype=dt, \)",
     "equivalent on a CPU-only machine: device=None is the default (CPU) device, where S is"),
    ("lipcheck/bounds/spectral.py", r"top_singular_guess", r"if steps > 2 else",
     "efficiency only: for n = 2 the s2 guess becomes 0, below ||S - s1 u1 v1^*||; norm2_upper's check fails once "
     "and retries with the eigensolver's value: the same certified tau2"),
    ("lipcheck/bounds/spectral.py", r"truncated_symbols", r"k\[None, :\]\.to\(None\)",
     "equivalent in float64 (the phases are complex128 either way); a float32 layer would get complex128 phases, "
     "more accurate than the complex64 ones its allowance covers"),
    ("lipcheck/rounding.py", r"_cholesky_completes", r'"XXcpuXX"|"CPU"',
     "equivalent in outcome: every check then goes through torch.linalg.cholesky_ex, the same LAPACK factorisation "
     "(slower: it clears the other triangle)"),
    ("lipcheck/rounding.py", r"_cholesky_completes", r"and A\.shape\[-1\] == 0",
     "reached only by empty matrices or dtypes other than float32/float64, which no caller passes (norm2_upper returns "
     "early on empty ones; every certificate is float32 or float64)"),
    ("lipcheck/rounding.py", r"norm2_upper", r"cholesky_certifies\(G, lam \+ pad, None\)",
     "equivalent: u=None means unit_roundoff(G.dtype), float64's, the u passed"),
    ("lipcheck/rounding.py", r"norm2_upper", r"gamma\(n \+ 1, \)",
     "equivalent: gamma's default unit roundoff is float64's, the u passed"),
    ("lipcheck/rounding.py", r"rump_shift", r"if not gn <= 0\.5",
     "equivalent: gamma_{n+1} = 1/2 exactly needs n + 1 = 1 / (3 u), about 3e15 rows in float64 (5.6e6 in float32, "
     "is still beyond any matrix checked here)"),
    ("lipcheck/rounding.py", r"verified_lambda_max", r"n = S\.shape\[\+1\]",
     "equivalent: S is square with at most one batch dimension at every caller, so shape[1] is n"),
]


def _section_without_mutmut(text: str) -> str:
    """pyproject text with any [tool.mutmut] table removed (it is rewritten per group)."""
    out, skip = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skip = line.strip() == "[tool.mutmut]"
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


def _toml_list(xs):
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def prepare(group: str, modules, tests, k_expr, args) -> Path:
    """A fresh scratch copy with a [tool.mutmut] table for this group only."""
    work = ROOT / "build" / "mutation" / group
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "lipcheck", work / "lipcheck", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    base = tomllib_load(ROOT / "pyproject.toml").get("tool", {}).get("mutmut", {})
    tests = [t for t in tests if (ROOT / t).exists()]
    if not tests:
        raise SystemExit(f"group {group}: none of its test files exist; edit GROUPS in {__file__}")
    selection = list(tests) + (["-k", k_expr] if k_expr else [])
    cli = list(base.get("pytest_add_cli_args", ["-p", "no:cacheprovider", "-x", "-q"]))
    conf = (f"\n[tool.mutmut]\nsource_paths = [\"lipcheck/\"]\nonly_mutate = {_toml_list(modules)}\n"
            f"pytest_add_cli_args = {_toml_list(cli)}\n"
            f"pytest_add_cli_args_test_selection = {_toml_list(selection)}\n"
            f"do_not_mutate_patterns = {_toml_list(base.get('do_not_mutate_patterns', []))}\n"
            f"process_isolation = \"{base.get('process_isolation', 'forkserver')}\"\n"
            f"timeout_multiplier = {float(args.timeout_multiplier)}\ntimeout_constant = {float(args.timeout_constant)}\n")
    (work / "pyproject.toml").write_text(_section_without_mutmut((ROOT / "pyproject.toml").read_text()) + conf)
    return work


def tomllib_load(path: Path) -> dict:
    import tomllib
    return tomllib.loads(path.read_text())


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the scratch copy is what gets imported
    env.update(HYPOTHESIS_PROFILE="mutation", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


GENERATE = ("from mutmut.__main__ import copy_src_dir, copy_also_copy_files, create_mutants\n"
            "from mutmut.mutation.data import SourceFileMutationData\n"
            "from mutmut.utils.file_utils import walk_mutatable_files\n"
            "import json, os\n"
            "os.makedirs('mutants', exist_ok=True); copy_src_dir(); copy_also_copy_files(); create_mutants(1)\n"
            "names = []\n"
            "for p in walk_mutatable_files():\n"
            "    m = SourceFileMutationData(path=p); m.load(); names += sorted(m.exit_code_by_key)\n"
            "print(json.dumps(names))\n")


def generate(work: Path) -> list[str]:
    """The group's mutant names, from mutmut's own generator (no tests run)."""
    out = subprocess.run([sys.executable, "-c", GENERATE], cwd=work, env=_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"mutant generation failed in {work}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_group(work: Path, args, names: list[str]) -> tuple[float, int, str]:
    t0 = time.time()
    proc = subprocess.run(["mutmut", "run", "--max-children", str(args.max_children), *names], cwd=work, env=_env(),
                          capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).replace("\r", "\n").strip().splitlines()[-5:]
    return time.time() - t0, proc.returncode, "\n".join(tail)


def collect(work: Path, modules, picked: set) -> list[dict]:
    """The picked mutants of the group's modules: name, function, status, diff (for the ones not killed)."""
    from mutmut.stats import status_by_exit_code
    rows = []
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        rel = meta.relative_to(work / "mutants").as_posix()[:-len(".meta")]
        if not any(fnmatch.fnmatch(rel, m) for m in modules):
            continue
        data = json.loads(meta.read_text())
        for key, code in sorted(data["exit_code_by_key"].items()):
            if key not in picked:
                continue
            status = status_by_exit_code[code]
            func = re.sub(r"__mutmut_\d+$", "", key.rsplit(".", 1)[-1]).removeprefix("x_").replace("ǁ", ".")
            row = dict(module=rel, mutant=key, function=func, status=status)
            if status not in ("killed", "timeout", "segfault"):
                show = subprocess.run(["mutmut", "show", key], cwd=work, capture_output=True, text=True)
                row["diff"] = "\n".join(ln for ln in show.stdout.splitlines()
                                        if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---")))
            rows.append(row)
    return rows


def reason_for(row: dict) -> str:
    added = "\n".join(ln for ln in row.get("diff", "").splitlines() if ln.startswith(("+", "-")))
    for mod, func, pat, why in SURVIVOR_REASONS:
        if fnmatch.fnmatch(row["module"], mod) and re.search(func, row["function"]) and re.search(pat, added):
            # a function no selected test called counts only a test added since ("now killed by ...") as its reason
            if row["status"] != "no tests" or why.startswith("now killed by"):
                return why
    if row["status"] == "no tests":
        return "unexplained: no selected test calls this function"
    return "unexplained: needs a test"


def _rates(n: int, alive: int, eq: int, since: int) -> dict:
    """Detected share; the mutation score proper (equivalent mutants are not faults, so they leave the
    denominator); the score counting survivors killed by tests added since the run."""
    return dict(kill_rate=round((n - alive) / n, 4) if n else None,
                score=round((n - alive) / (n - eq), 4) if n > eq else None,
                score_since=round((n - alive + since) / (n - eq), 4) if n > eq else None)


def summarise(g: str, generated: int, rows: list[dict]) -> list[dict]:
    out = []
    for mod in sorted({r["module"] for r in rows}):
        mine = [r for r in rows if r["module"] == mod]
        alive = [r for r in mine if r["status"] not in ("killed", "timeout", "segfault")]
        out.append(dict(group=g, module=mod, generated=generated, mutants=len(mine),
                        killed=sum(r["status"] == "killed" for r in mine),
                        timeout=sum(r["status"] == "timeout" for r in mine), surviving=len(alive),
                        explained=sum(not reason_for(r).startswith("unexplained") for r in alive),
                        equivalent=(eq := sum(reason_for(r).startswith("equivalent") for r in alive)),
                        # survivors a test added after the run kills (each checked by applying the mutant by hand)
                        killed_since=(ks := sum(reason_for(r).startswith("now killed") for r in alive)),
                        **_rates(len(mine), len(alive), eq, ks)))
    return out


def group_totals(summary: list[dict]) -> list[dict]:
    """One row per group (the unit the target is set for): a group's modules share one sample, so a module
    with one or two sampled mutants says little on its own."""
    out = []
    for g in dict.fromkeys(x["group"] for x in summary):
        mine = [x for x in summary if x["group"] == g]
        n, alive, eq, ks = (sum(x.get(k, 0) for x in mine) for k in ("mutants", "surviving", "equivalent", "killed_since"))
        out.append(dict(group=g, modules=[x["module"] for x in mine], generated=mine[0]["generated"], mutants=n,
                        killed=sum(x["killed"] for x in mine), timeout=sum(x["timeout"] for x in mine),
                        surviving=alive, explained=sum(x["explained"] for x in mine), equivalent=eq,
                        killed_since=ks, **_rates(n, alive, eq, ks)))
    return out


def _load_runs(data: dict) -> dict:
    """Per-group results from a report; a report written before rows were stored is rebuilt from its
    summary (killed/timeout counts) and survivors."""
    runs = data["runs"]
    for g, r in runs.items():
        if "rows" in r:
            continue
        rows = [dict(x) for x in data.get("survivors", []) if any(
            s["group"] == g and s["module"] == x["module"] for s in data["summary"])]
        for s_ in data["summary"]:
            if s_["group"] == g:
                rows += [dict(module=s_["module"], mutant="", function="", status="killed")] * s_["killed"]
                rows += [dict(module=s_["module"], mutant="", function="", status="timeout")] * s_["timeout"]
        r["rows"] = rows
        r.setdefault("stamp", data.get("stamp"))
    return runs


def write(runs: dict, args, st: dict) -> None:
    """docs/mutation.md + JSON from the per-group results (reasons re-derived from the stored diffs)."""
    summary, survivors = [], []
    for g, r in runs.items():
        summary += summarise(g, r["generated"], r["rows"])
        for row in r["rows"]:
            if row["status"] not in ("killed", "timeout", "segfault"):
                survivors.append(dict(row, reason=reason_for(row), group=g))
    groups = group_totals(summary)
    total = sum(r["seconds"] for r in runs.values())
    n_run = sum(s["mutants"] for s in summary)
    n_det = sum(s["mutants"] - s["surviving"] for s in summary)
    n_eq = sum(s.get("equivalent", 0) for s in summary)
    md = ["# Mutation testing", "",
          "Each mutant is a small change to the certified code (an operator, a constant, a comparison, a "
          "keyword argument, a string). A mutant is *killed* when a test fails on it, *timeout* when its tests "
          "ran past the per-mutant CPU limit (counted as detected); a survivor is listed with the reason it "
          "survives. Error-message text in `raise` statements is not mutated (the tests match the parameter "
          "each message names).", "",
          "Command: `python experiments/mutation.py` (mutmut 3, two workers); one group again after a change: "
          "`python experiments/mutation.py --modules attention --update`. Per group the wall time on this "
          "machine (a 2-core CPU shared with other jobs while it ran; see the stamp of each group in the JSON): "
          + ", ".join(f"{g} {r['seconds'] / 60:.1f} min ({r['run']} mutants)" for g, r in runs.items())
          + f"; {total / 60:.1f} min in all.", "",
          "The code each group ran on (a group's numbers describe that commit; a group run before its module last "
          "changed is out of date): " + ", ".join(
              f"{g} at `{r.get('stamp', {}).get('commit', '?')}` (sample seed {r.get('settings', {}).get('seed', '?')}, "
              f"{r.get('stamp', {}).get('date', '?')})"
              for g, r in runs.items()) + ".", "",
          f"Mutants per group: all when a group has at most `--max-mutants` of them, else a seeded random sample "
          f"of that many; the detected fraction of a sample estimates the whole module's (binomial standard "
          f"error sqrt(p(1-p)/n): 3 points at n = 100, 4 at n = 60, 5 at n = 40, for p = 0.9). Overall: {n_det} of {n_run} detected "
          f"({100 * n_det / max(n_run, 1):.1f}%); {n_eq} survivors are equivalent mutants (no input can tell them from "
          f"the code), and the *score* leaves those out of the denominator: {n_det} of {n_run - n_eq} "
          f"({100 * n_det / max(n_run - n_eq, 1):.1f}%). The target is a score of at least 90% in every module "
          f"group.", "",
          "*score* is the run's own; *with later kills* also counts the survivors that a test added after the run "
          "kills (each checked by applying the mutant by hand; the next fresh sample is the real check).", "",
          report.md_table(["group", "modules", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "equivalent", "detected", "score", "killed since", "with later kills"],
                          [[x["group"], len(x["modules"]), x["generated"], x["mutants"], x["killed"], x["timeout"],
                            x["surviving"], x["explained"], x["equivalent"],
                            f"{100 * x['kill_rate']:.1f}%" if x["kill_rate"] is not None else "-",
                            f"{100 * x['score']:.1f}%" if x.get("score") is not None else "-", x["killed_since"],
                            f"{100 * x['score_since']:.1f}%" if x.get("score_since") is not None else "-"]
                           for x in groups]),
          "", "Per module:", "",
          report.md_table(["group", "module", "generated", "run", "killed", "timeout", "surviving", "explained",
                           "equivalent", "detected", "score"],
                          [[x["group"], x["module"], x["generated"], x["mutants"], x["killed"], x["timeout"],
                            x["surviving"], x["explained"], x.get("equivalent", 0),
                            f"{100 * x['kill_rate']:.1f}%" if x["kill_rate"] is not None else "-",
                            f"{100 * x['score']:.1f}%" if x.get("score") is not None else "-"] for x in summary]),
          "", ("Not in this report (run `python experiments/mutation.py --modules NAME --update` to add them): "
               + ", ".join(f"`{g}` ({', '.join(GROUPS[g][0])})" for g in GROUPS if g not in runs) + "."
               if any(g not in runs for g in GROUPS) else "All module groups are in this report."),
          "", "## Surviving mutants", "",
          "A reason is one of: *equivalent* (no input tells the mutant from the code), *loosens* (the mutant "
          "returns a larger, still true bound or margin: a test of a true bound cannot fail on it; a tightness "
          "test would need to pin the constant to O(u)), or *unexplained* (a test is missing).", ""]
    for r in survivors:
        md.append(f"- `{r['module']}` `{r['function']}` ({r['status']}): {r['reason']}")
        for ln in r.get("diff", "").splitlines()[:4]:
            md.append(f"    `{ln.strip()[:160]}`")
    report.write_report("mutation", "\n".join(md),
                        dict(summary=summary, groups=groups, survivors=survivors, total_seconds=round(total, 1),
                             runs={g: {k: v for k, v in r.items() if k != "rows"} | {"rows": r["rows"]}
                                   for g, r in runs.items()}),
                        st, docs=args.docs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default=",".join(GROUPS), help=f"comma-separated groups from {list(GROUPS)}")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--timeout-multiplier", type=float, default=4.0)
    ap.add_argument("--timeout-constant", type=float, default=10.0)
    ap.add_argument("--max-mutants", type=int, default=40,
                    help="per group: run a seeded random sample of this many mutants (0: all of them)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mutant sample")
    ap.add_argument("--update", action="store_true",
                    help="keep the other groups' results from docs/data/mutation.json and replace these")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rewrite the report from docs/data/mutation.json (reasons re-derived)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: take the groups of these reports (mutation.json written elsewhere with "
                         "--docs) into docs/data/mutation.json, replacing the same groups, and rewrite the report")
    ap.add_argument("--docs", type=Path, default=None)
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.modules.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown module group(s) {unknown}; choose from {list(GROUPS)}")
    data_path = (args.docs or report.DOCS) / "data" / "mutation.json"
    runs = {}
    if args.update or args.report_only or args.merge:
        if not data_path.exists():
            raise SystemExit(f"--update/--report-only need an earlier {data_path}; run without them first")
        runs = _load_runs(json.loads(data_path.read_text()))
    st = report.stamp()
    for path in args.merge or []:
        theirs = _load_runs(json.loads(path.read_text()))
        runs.update(theirs)
        print(f"took {sorted(theirs)} from {path}")
    if args.report_only or args.merge:
        write(runs, args, st)
        print(f"rewrote the report from {data_path}")
        return
    if shutil.which("mutmut") is None:
        raise SystemExit("mutmut is not installed: pip install -e '.[dev]'")
    for g in groups:
        modules, tests, k_expr = GROUPS[g]
        work = prepare(g, modules, tests, k_expr, args)
        print(f"[{g}] mutating {modules} against {tests} (-k {k_expr!r})", flush=True)
        t0 = time.time()
        names = generate(work)
        picked = names if args.max_mutants <= 0 or len(names) <= args.max_mutants else \
            sorted(random.Random(args.seed).sample(names, args.max_mutants))
        print(f"[{g}] {len(names)} mutants, running {len(picked)}", flush=True)
        _, rc, tail = run_group(work, args, picked)
        rows = collect(work, modules, set(picked))
        seconds = time.time() - t0
        runs[g] = dict(seconds=round(seconds, 1), mutmut_exit_code=rc, tail=tail, tests=tests, k=k_expr,
                       generated=len(names), run=len(picked), stamp=report.stamp(), rows=rows,
                       settings={k: v for k, v in vars(args).items() if k != "docs"})
        print(f"[{g}] {len(rows)} mutants in {seconds:.0f} s (mutmut exit {rc})\n{tail}", flush=True)
        write(runs, args, st)  # after every group, so an interrupted run keeps what it measured
    print(f"total {sum(r['seconds'] for r in runs.values()) / 60:.1f} min; wrote docs/mutation.md")


if __name__ == "__main__":
    main()
