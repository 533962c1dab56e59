"""The deflated bound's size rule (proofs/S2.md, 'Deflated majorant'): how many token functions k, and whether
Theorem D4's X fits the work budget term by term or through the heads' rank (`x_route`), else Theorem D3. Sizes
alone, no clock: the same call plans the same k on any machine."""
from __future__ import annotations

import math

from . import gram_envelope as ge
from . import gram_heads as gh

# Theorem D4's X is built up to this many multiply-adds (either route, `x_route`); beyond, Theorem D3's h^2 terms
# serve. Measured on 2 quiet cores: 8 heads at k C = 4608 (8.7e10 term by term) certified a held-out 12x12 C = 128
# layer to a gap of 9.5e-4 in 15.5 s, where 3e10 (k C = 2688) left 2.7e-3
GRAM_BUDGET = 1e11


def x_route(heads: int, k: int, C: int, budget: float | None = None) -> str | None:
    """How Theorem D4's X fits the budget (default GRAM_BUDGET): 'kron' (h^4 (k C)^2 and h^4 C^3 multiply-adds each
    within it), else 'heads' (through the heads' rank, gram_heads.work), else None."""
    budget = GRAM_BUDGET if budget is None else budget
    if heads ** 4 * float(k * C) ** 2 <= budget and heads ** 4 * float(C) ** 3 <= budget:
        return "kron"
    if C % heads == 0 and gh.work(heads, k, C) <= budget:
        return "heads"
    return None


def gram_affordable(heads: int, k: int, C: int, budget: float | None = None) -> bool:
    return x_route(heads, k, C, budget) is not None  # Theorem D4 fits (else Theorem D3 is used)


def default_k(N: int, C: int) -> int:
    """Token functions for an N-token grid and C channels: the eigenvalues of T_N(s_up) above a level grow like N
    (Szego), so k grows like N (10 up to 250 tokens, 41 at 32 x 32), capped (not below 10) so that the dense
    k C x k C checks stay near a 4608-dimensional matrix (under 60 s on 2 cores)."""
    return max(1, min(max(10, math.ceil(N / 25)), max(10, 4608 // max(int(C), 1)), N - 1))


def default_k_gram(N: int, C: int) -> int:
    """Token functions with the circulant Gram envelope: as many as keep k C near 4608 (at least 10, at most N - 1);
    its cost is the k C x k C checks only (no envelope refinement depends on k)."""
    return max(1, min(max(10, 4608 // max(int(C), 1)), N - 1))


LOWRANK_MAX_K = 512


def planned_k(H: int, W: int, C: int, heads: int, *, scale: float = 1.0) -> int:
    """Token functions for the default certification's deflated bound (complement 'gram'), from the sizes alone:
    default_k_gram's k C near 4608 (times scale^(1/3): the k C x k C checks cost (k C)^3), lowered until Theorem D4's
    X fits GRAM_BUDGET * min(scale, 1) by one of its routes (`x_route`); where neither fits at any k >= 1,
    Theorem D3's h^2 terms serve instead (`d3_affordable`). 0 where the Gram envelope does not
    fit (gram_envelope.affordable) or no k >= 1 fits; at most LOWRANK_MAX_K beyond 32 x 32 (the low-rank path's
    Lanczos). scale: the time budget over the 60 s these constants were sized for (on 2 cores)."""
    if not ge.affordable(H, W) or H * W < 2:
        return 0
    N = H * W
    g = GRAM_BUDGET * min(scale, 1.0)  # deflated_bound refuses a k beyond GRAM_BUDGET itself
    k = min(max(10, int(4608 * scale ** (1 / 3)) // max(int(C), 1)), N - 1)
    if not ge.dense(H, W):  # Lanczos for k eigenvectors of R_f beyond 32 x 32: k near N is a full eigensolve the slow
        k = min(k, LOWRANK_MAX_K)  # way (C = 2 at 60 x 60: k = 2304, 77 s; capped, it changes C <= 8 only)
    # Theorem D4 with the largest k whose X fits (`x_route`: term by term, or through the heads' rank)
    kd = next((j for j in range(k, 0, -1) if gram_affordable(heads, j, C, g)), 0)
    if kd >= 1:
        return kd
    # Theorem D3: heads^2 (k C)^2 <= g, and its 2 k C x 2 k C check near 9216 (no floor of 10 token functions)
    k = min(k, max(1, int(4608 * scale ** (1 / 3)) // max(int(C), 1)), int(math.sqrt(g / heads ** 2) / C))
    while k >= 1 and not d3_affordable(heads, k, C, g):
        k -= 1
    return max(k, 0)


def d3_affordable(heads: int, k: int, C: int, budget: float | None = None) -> bool:
    """Whether Theorem D3's matrices fit the budget (default GRAM_BUDGET): h^2 Kronecker terms of (k C)^2 entries, h^2
    channel products."""
    budget = GRAM_BUDGET if budget is None else budget
    return heads ** 2 * float(k * C) ** 2 <= budget and heads ** 2 * float(C) ** 3 <= budget


def choose_complement(H: int, W: int, C: int, heads: int, k: int | None = None) -> str:
    """'gram' (the circulant Gram envelope bounds the complement, Lemma G2 of proofs/S2.md) where half its torus fits
    gram_envelope.MAX_FREQUENCIES (up to 32 x 32) and Theorem D4's matrices fit GRAM_BUDGET; else 'majorant'
    (Lemma D2)."""
    kk = default_k_gram(H * W, C) if k is None else max(1, min(int(k), H * W - 1))
    return "gram" if ge.affordable(H, W) and gram_affordable(heads, kk, C) else "majorant"
