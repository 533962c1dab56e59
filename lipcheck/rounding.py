"""Floating-point rounding: unit roundoff, gamma_n, and spectral bounds verified by Cholesky (proofs/S2.md).

The one home of every a-priori rounding constant and of the verified eigenvalue / spectral-norm bounds the
certificates rest on. Nothing here trusts an eigensolver or an SVD: their outputs are only guesses, and a
guess becomes a proof when a floating-point Cholesky factorisation of a shifted matrix runs to completion
(Rump, BIT 46 (2006), after Demmel): if fl-Cholesky of A - c I completes for a symmetric floating-point A and

    c >= gamma_{n+1} / (1 - 2 gamma_{n+1}) sum_i |A_ii| + (rounding of A's diagonal) + 4 (2n + 1) eta,

then A is positive definite. Hence lambda_max(S) < mu when A = fl(mu I - S) passes (`cholesky_certifies`), and
||M||_2^2 = lambda_max(M^* M) <= mu + e_G when fl(M^* M) passes with mu, e_G bounding the error of forming
M^* M (`norm2_upper`).
"""
from __future__ import annotations

import math

import torch

from .threads import limited


def unit_roundoff(dtype) -> float:
    """u = eps / 2: |fl(x op y) - x op y| <= u |x op y| for round-to-nearest in `dtype`."""
    if not dtype.is_floating_point and not dtype.is_complex:
        raise ValueError(f"dtype {dtype} has no unit roundoff: pass a floating-point dtype")
    return torch.finfo(dtype).eps / 2


def gamma(n: float, u=torch.float64) -> float:
    """gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, Lemma 3.1); u a float or a dtype.
    inf once n u >= 1: no a-priori bound exists, and every caller refuses a non-finite margin."""
    if not isinstance(u, float):
        u = unit_roundoff(u)
    nu = n * u
    return nu / (1 - nu) if nu < 1 else math.inf


def check_certified_dtype(dtype) -> torch.dtype:
    """float32 or float64; half precisions leave no room for a rounding margin and are refused."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64 for a certified bound, got {dtype} "
                         f"(float16/bfloat16 leave no room for a rounding margin: pass dtype=torch.float64)")
    return dtype


def tiny_subnormal(dtype) -> float:
    """The smallest positive subnormal number: the absolute error of one underflowing operation."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def rump_shift(trace_abs: torch.Tensor, n: int, u: float, dtype) -> torch.Tensor:
    """c = gamma_{n+1} / (1 - 2 gamma_{n+1}) sum_i |A_ii| + 4 (2n + 1) eta (Rump 2006, Cor. 2.4)."""
    gn = gamma(n + 1, u)
    if not gn < 0.5:
        return torch.full_like(trace_abs, math.inf)
    return gn / (1 - 2 * gn) * trace_abs + 4 * (2 * n + 1) * tiny_subnormal(dtype)


def cholesky_certifies(S: torch.Tensor, mu: torch.Tensor, u: float | None = None, *, overwrite: bool = False):
    """(ok, mu rounded up): ok where fl-Cholesky of fl(mu I - S) - c I completes, so lambda_max(S) < mu.

    S (..., n, n) symmetric in floating point, mu (...,). The diagonal of fl(mu I - S) errs by <= u (|mu| +
    max|S_ii|), which c adds to Rump's shift; the reported float is mu (1 + 2u) (upward rounding).
    overwrite: S itself becomes the factorised matrix (no copy: at n = 768 a copy's fresh pages cost as much as
    the factorisation)."""
    n = S.shape[-1]
    u = unit_roundoff(S.dtype) if u is None else u
    dS = S.diagonal(dim1=-2, dim2=-1)
    dA = mu[..., None] - dS  # the diagonal of A = mu I - S
    c = rump_shift(dA.abs().sum(-1), n, u, S.dtype) + u * (mu.abs() + dS.abs().amax(-1))
    A = S.neg_() if overwrite else -S
    A.diagonal(dim1=-2, dim2=-1).copy_(dA - c[..., None])
    # NaN/inf anywhere refuses: an optimised potrf need not test its pivots for NaN (a NaN off the diagonal of an
    # order-300 matrix passed LAPACK's check as called through scipy). amax and amin propagate NaN and reach +-inf:
    # two reads instead of a boolean copy of A
    finite = torch.isfinite(A.amax((-2, -1))) & torch.isfinite(A.amin((-2, -1))) & torch.isfinite(c)
    return _cholesky_completes(A) & finite, mu * (1 + 2 * u)


def top_eigenpairs(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w (...,), v (..., n)): the largest eigenvalue of each symmetric S (..., n, n) and an eigenvector, as
    guesses (never bounds). On a CPU LAPACK's syevx for the top pair alone (24 ms at n = 768 against 134 ms for
    torch's full eigh); elsewhere torch's eigh."""
    n = S.shape[-1]
    if S.device.type != "cpu" or S.dtype not in (torch.float32, torch.float64) or n < LAPACK_MIN_N:
        w, V = torch.linalg.eigh(S)
        return w[..., -1], V[..., -1]
    from scipy.linalg import eigh
    flat = S.reshape(-1, n, n)
    w, v = torch.empty(flat.shape[0], dtype=S.dtype), torch.empty(flat.shape[0], n, dtype=S.dtype)
    with limited():
        for i in range(flat.shape[0]):
            if not math.isfinite(float(flat[i].sum())):  # no eigensolver on NaN/inf (the certificate refuses it)
                w[i], v[i] = math.nan, 1.0
                continue
            wi, vi = eigh(flat[i].numpy(), subset_by_index=[n - 1, n - 1], driver="evx", check_finite=False)
            w[i], v[i] = float(wi[0]), torch.from_numpy(vi[:, 0])
    return w.reshape(S.shape[:-2]), v.reshape(*S.shape[:-2], n)


LAPACK_MIN_N = 256  # from this order on, Cholesky checks call LAPACK directly (_cholesky_completes)
# ... up to this order: scipy's bundled OpenBLAS (32-bit indices) segfaulted in dpotrf at order 16000 and above
# (measured: 15000 completes); beyond, `_blocked_cholesky_` factorises it in place, panel by panel (torch's LAPACK)
LAPACK_MAX_N = 11585  # n^2 <= 2^27 elements (1 GiB in float64)


def _cholesky_completes(A: torch.Tensor) -> torch.Tensor:
    """Where fl-Cholesky of the symmetric matrices A (..., n, n), read from their lower triangles, runs to the end
    (A is overwritten). On a CPU, LAPACK's potrf through scipy without clearing the other triangle: torch's
    cholesky_ex zeroes it afterwards, a pass over the matrix that cost twice the factorisation of a 768 x 768 one.
    The same factorisation either way (LAPACK's potrf); Rump's theorem holds for any order of its operations."""
    # small matrices (batches of thousands in the log-norm certificates) stay with torch's batched call: there the
    # clearing costs little and a Python loop over scipy calls would cost more
    if A.device.type == "cpu" and A.dtype in (torch.float32, torch.float64) and A.shape[-1] > LAPACK_MAX_N:
        flat = A.reshape(-1, A.shape[-1], A.shape[-1])
        return torch.tensor([_blocked_cholesky_(flat[i]) for i in range(flat.shape[0])]).reshape(A.shape[:-2])
    if (A.device.type != "cpu" or A.dtype not in (torch.float32, torch.float64)
            or not LAPACK_MIN_N <= A.shape[-1] <= LAPACK_MAX_N):
        _, info = torch.linalg.cholesky_ex(A)
        return info == 0
    from scipy.linalg import lapack
    potrf = lapack.dpotrf if A.dtype == torch.float64 else lapack.spotrf
    n = A.shape[-1]
    flat = A.reshape(-1, n, n)
    ok = torch.empty(flat.shape[0], dtype=torch.bool)
    with limited():  # scipy's OpenBLAS on torch's thread count, not its own pool of one thread per core
        for i in range(flat.shape[0]):
            # the row-major lower triangle is the column-major upper one: A^T as a Fortran array, upper
            _, info = potrf(flat[i].numpy().T, lower=0, clean=0, overwrite_a=1)
            ok[i] = info == 0
    return ok.reshape(A.shape[:-2])


CHOLESKY_BLOCK = 1024  # columns per panel of `_blocked_cholesky_`


def _blocked_cholesky_(A: torch.Tensor, nb: int = CHOLESKY_BLOCK) -> bool:
    """Whether fl-Cholesky of the symmetric A (n x n, its lower triangle read) runs to the end, computed in place
    (A's lower triangle becomes the factor; no second n x n array: at n = 24576 that is 4.5 GiB saved), left-looking
    by panels of nb columns: each panel is updated by one product with the columns before it, its diagonal block
    factorised (LAPACK) and the rest solved against it. Every entry is the standard Cholesky recurrence with the
    dot products summed in some order, so Rump's theorem (`cholesky_certifies`) holds as for potrf. A NaN or inf
    anywhere in a row reaches that row's pivot: every block must factorise and every diagonal entry be finite."""
    n = A.shape[-1]
    for j0 in range(0, n, nb):
        j1 = min(j0 + nb, n)
        if j0 > 0:
            A[j0:, j0:j1].sub_(A[j0:, :j0] @ A[j0:j1, :j0].T)
        L11, info = torch.linalg.cholesky_ex(A[j0:j1, j0:j1])
        if int(info) != 0 or not bool(torch.isfinite(L11.diagonal()).all()):
            return False
        A[j0:j1, j0:j1] = L11
        if j1 < n:  # X L11^T = A21
            A[j1:, j0:j1] = torch.linalg.solve_triangular(L11, A[j1:, j0:j1].T, upper=False).T
    return True


def verified_lambda_max(S: torch.Tensor, *, tries: int = 6, lam: torch.Tensor | None = None) -> torch.Tensor:
    """Upper bounds on lambda_max of the exact symmetric matrices S (..., n, n) given in floating point.

    lam (default: eigvalsh) is a guess; `cholesky_certifies` makes it a proof at mu = lam + pad, the pad
    starting at 1e-12 ||S||_F + 4 n u ||S||_F and growing tenfold per failed try; inf where all tries fail."""
    n = S.shape[-1]
    u = unit_roundoff(S.dtype)
    if lam is None:
        lam = torch.linalg.eigvalsh(S)[..., -1]
    scale = torch.linalg.matrix_norm(S).clamp_min(torch.finfo(S.dtype).tiny)
    out = torch.full_like(lam, math.inf)
    pad = 1e-12 * scale + 4 * n * u * scale
    todo = torch.ones_like(lam, dtype=torch.bool)
    for _ in range(tries):
        ok, val = cholesky_certifies(S, lam + pad, u)
        ok = ok & todo
        out = torch.where(ok, val + 0.0, out)
        todo = todo & ~ok
        if not bool(todo.any()):
            break
        pad = pad * 10
    return out


def sum_of_squares(M: torch.Tensor) -> torch.Tensor:
    """fl(sum |M_ij|^2) over the last two axes as the sum of (Re M_ij)^2 + (Im M_ij)^2: 2 m n squares for complex M
    (m n for real), no square root per entry; within gamma_{2mn} relative of the exact sum (proofs/S2.md)."""
    if M.is_complex():
        return torch.view_as_real(M.resolve_conj()).square().sum((-3, -2, -1))
    return M.square().sum((-2, -1))


def _real_gram(M: torch.Tensor):
    """(G, n', e_G, F2): G = sym(fl(M^* M)) as a real symmetric n' x n' matrix (complex G = A + iB embedded as
    [[A, -B], [B, A]], the same eigenvalues twice), e_G >= ||G - M^* M||_2, F2 >= ||M||_F^2 (proofs/S2.md)."""
    m, n = M.shape[-2:]
    u = unit_roundoff(torch.float64)
    F2 = sum_of_squares(M) * (1 + gamma(2 * m * n + 4, u))
    G = M.mH @ M
    G = (G + G.mH) / 2
    # |fl(x^* y) - x^* y| <= gamma_{m+2} |x|^T |y| (complex; Higham 3.6), one more rounding in the symmetrisation,
    # and underflow: <= 8 (m + 2) eta per entry; || |M|^T |M| ||_F <= ||M||_F^2
    eG = gamma(m + 4, u) * F2 + 8 * (m + 2) * n * tiny_subnormal(torch.float64)
    if G.is_complex():
        G = hermitian_as_real(G)
    return G, G.shape[-1], eG, F2


def hermitian_as_real(G: torch.Tensor) -> torch.Tensor:
    """[[A, -B], [B, A]] for Hermitian G = A + iB (..., n, n): real symmetric with G's eigenvalues, each twice (so one
    is positive definite iff the other is); exact (copies and negations)."""
    n = G.shape[-1]
    E = G.new_empty(*G.shape[:-2], 2 * n, 2 * n, dtype=G.real.dtype)
    E[..., :n, :n] = G.real
    E[..., n:, n:] = G.real
    E[..., n:, :n] = G.imag
    torch.neg(G.imag, out=E[..., :n, n:])
    return E


def norm2_upper(M: torch.Tensor, *, s: torch.Tensor | None = None, tries: int = 8) -> torch.Tensor:
    """Verified upper bounds on ||M||_2 for the matrices M (..., m, n) as stored (real or complex, any float dtype).

    Exact in float64 arithmetic (float32 and complex64 convert exactly); scaled by a power of two (exact) so that
    M^* M neither overflows nor underflows. G = fl(M^* M) errs by <= e_G in norm; with mu certified by
    `cholesky_certifies` (lambda_max(G) < mu), ||M||_2 <= sqrt(mu + e_G), rounded up. s: guesses of ||M||_2
    (e.g. from an SVD already computed); default the top eigenvalue of G. inf where every try fails or M has
    NaN/inf entries: callers refuse it."""
    batch = M.shape[:-2]
    if M.numel() == 0:
        return torch.zeros(batch, dtype=torch.float64, device=M.device)
    X = M.to(torch.complex128 if M.is_complex() else torch.float64)
    if X.shape[-2] < X.shape[-1]:
        X = X.mH  # ||M|| = ||M^*||: the Gram matrix on the smaller side
    mx = float((torch.view_as_real(X.resolve_conj()) if X.is_complex() else X).abs().max())  # largest |re|, |im|
    if not math.isfinite(mx):
        return torch.full(batch, math.inf, dtype=torch.float64, device=M.device)
    if mx == 0.0:
        return torch.zeros(batch, dtype=torch.float64, device=M.device)
    e = math.frexp(mx)[1]
    X = _times_pow2(X, -e)  # largest |re|, |im| in [1/2, 1): entries below sqrt 2
    G, n, eG, F2 = _real_gram(X)
    u = unit_roundoff(torch.float64)

    def top(G):  # a guess: the Hermitian n/2 x n/2 block pair has the same eigenvalues at a quarter of the work
        if X.is_complex():
            h = n // 2
            G = torch.complex(G[..., :h, :h], G[..., h:, :h])
        return torch.linalg.eigvalsh(G)[..., -1].clamp_min(0)

    if s is None:
        lam = top(G)
    else:
        lam = _times_pow2(torch.as_tensor(s, dtype=torch.float64, device=M.device), -e).square()
    # the pad clears Rump's shift (<= gamma_{n+1} n mu) and the guess's own error; it grows 16-fold per failure
    rel = 4 * (gamma(n + 1, u) * n + 2 * n * u)
    pad = rel * torch.maximum(lam, u * F2) + 16 * (2 * n + 1) * tiny_subnormal(torch.float64)
    out = torch.full(batch, math.inf, dtype=torch.float64, device=M.device)
    todo = torch.ones(batch, dtype=torch.bool, device=M.device)
    for i in range(tries):
        if i == 1 and s is not None:  # the caller's guess failed: fall back to the eigensolver's
            lam = torch.maximum(lam, top(G))
            pad = torch.maximum(pad, rel * lam)
        ok, mu = cholesky_certifies(G, lam + pad, u)
        ok = ok & todo
        out = torch.where(ok, (mu + eG).sqrt() * (1 + gamma(6, u)), out)
        todo = todo & ~ok
        if not bool(todo.any()):
            break
        pad = pad * 16
    # scale back by 2^e: exact, or inf beyond the float64 range (refused by the callers)
    return _times_pow2(out, e)


def _times_pow2(x: torch.Tensor, k: int) -> torch.Tensor:
    """x 2^k in two exact steps: a single float 2^k overflows for |k| > 1023, which subnormal matrices need (their
    largest entry below 2^-1022 scales up by up to 2^1074)."""
    return x * (2.0 ** (k // 2)) * (2.0 ** (k - k // 2))
