"""lipcheck.threads: scipy's and numpy's BLAS pools run on the thread count lipcheck is given, read at the moment
lipcheck calls into them (threadpoolctl.threadpool_info(), an independent search of the loaded libraries)."""
import os
import sys

import numpy as np
import pytest
import scipy.linalg.lapack
import scipy.sparse.linalg
import threadpoolctl
import torch

from lipcheck import rounding, threads
from lipcheck.bounds import deflation_search, majorant

CORES = os.cpu_count() or 1


def blas_counts() -> list[int]:
    """Thread counts of every BLAS pool loaded (scipy's and numpy's OpenBLAS), as the libraries report them now."""
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]


def all_counts() -> dict[str, int]:
    return {p["filepath"]: p["num_threads"] for p in threadpoolctl.threadpool_info()}


@pytest.fixture
def asked(request):
    """torch on n threads (what lipcheck was given) with the BLAS pools deliberately elsewhere (n = 1: 2, n = 2: 1),
    so a call that left scipy's own count in place reads the other number. Yields (n, other); restores both."""
    n = request.param
    if n > CORES:
        pytest.skip(f"needs {n} cores")
    other = 2 if n == 1 else 1
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpoolctl.threadpool_limits(limits=other, user_api="blas"):
            assert set(blas_counts()) == {other}  # the premise: the pools do not already run n
            yield n, other
    finally:
        torch.set_num_threads(old)


def recording(monkeypatch, module, name, seen):
    """Replace module.name by a wrapper that appends the BLAS thread counts at each call to `seen`."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        seen.append(blas_counts())
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)


def test_blas_pools_are_found():
    """Both bundled OpenBLAS libraries (scipy's, numpy's) are among the pools limited; otherwise nothing is limited."""
    found = threads.blas_threads()
    assert any("scipy" in p for p in found) and len(found) == len(blas_counts()) >= 1


@pytest.mark.parametrize("asked", [1, 2], indirect=True)
def test_cholesky_check_runs_scipy_lapack_on_the_threads_asked(asked, monkeypatch):
    """norm2_upper of a 300 x 300 matrix: its Cholesky check calls scipy's dpotrf (order >= LAPACK_MIN_N) with every
    BLAS pool on n threads; after it the pools are back where they were. The bound itself is right."""
    n, other = asked
    seen = []
    recording(monkeypatch, scipy.linalg.lapack, "dpotrf", seen)
    M = torch.randn(300, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert M.shape[-1] >= rounding.LAPACK_MIN_N
    ub = float(rounding.norm2_upper(M))
    exact = float(torch.linalg.matrix_norm(M, ord=2))
    assert len(seen) >= 1 and all(c == [n] * len(c) for c in seen), seen
    assert set(blas_counts()) == {other}
    assert exact <= ub <= exact * (1 + 1e-9)


@pytest.mark.parametrize("asked", [1, 2], indirect=True)
def test_majorant_eigsh_runs_on_the_threads_asked(asked, monkeypatch):
    """The (target + 1)-th eigenpair of a 2116 x 2116 block Toeplitz matrix (beyond N = 2048: scipy's eigsh) with
    every BLAS pool on n threads. t separable and symmetric: T = T_y (x) T_x, whose eigenvalues are the products
    of the 46 x 46 factors' ones, so the second largest is known independently."""
    n, other = asked
    seen = []
    recording(monkeypatch, scipy.sparse.linalg, "eigsh", seen)
    H = W = 46
    k = torch.arange(-(H - 1), H, dtype=torch.float64)
    g = torch.exp(-k ** 2 / 8)
    t = g[:, None] * g[None, :]
    lam, v = majorant._top_eigen(t, H, W, None, 100, target=1)
    Ty = majorant.dense_toeplitz(g[:, None], H, 1)
    e = torch.linalg.eigvalsh(Ty)
    second = float(torch.sort((e[:, None] * e[None, :]).flatten(), descending=True).values[1])
    assert seen == [[n] * len(seen[0])], seen
    assert set(blas_counts()) == {other}
    assert lam == pytest.approx(second, rel=1e-8)
    T = majorant.dense_toeplitz(t, H, W)
    assert float(torch.linalg.vector_norm(T @ v - lam * v)) <= 1e-6 * lam


@pytest.mark.parametrize("asked", [1, 2], indirect=True)
def test_deflation_search_numpy_and_scipy_run_on_the_threads_asked(asked, monkeypatch):
    """top_eigenvalue (scipy's eigsh), the matrix products of its matvec and krylov_basis (numpy's BLAS), and
    choose_gram_shift (both) see n threads in every BLAS pool at every call; the estimates are right."""
    n, other = asked
    rng = np.random.default_rng(1)
    B = rng.standard_normal((200, 200))
    S = B @ B.T / 200
    exact = np.linalg.eigvalsh(S)[-1]
    inside = []

    def matvec(x):
        inside.append(blas_counts())
        return S @ x
    lam, _ = deflation_search.top_eigenvalue(matvec, 200, np.ones(200))
    assert lam == pytest.approx(exact, rel=1e-9)
    Q = deflation_search.krylov_basis(lambda X: (inside.append(blas_counts()), S @ X)[1], 200, 3, 4, 0)
    assert np.abs(Q.T @ Q - np.eye(12)).max() < 1e-12
    seen = []
    recording(monkeypatch, scipy.sparse.linalg, "eigsh", seen)
    M11 = torch.as_tensor(S)
    X = torch.as_tensor(np.outer(B[:, 0], B[:, 0]) / 200)
    g, lam_g = deflation_search.choose_gram_shift(M11, X, 0.5)
    assert len(inside) >= 10 and all(c == [n] * len(c) for c in inside), inside[:3]
    assert len(seen) >= 2 and all(c == [n] * len(c) for c in seen), seen
    assert set(blas_counts()) == {other}
    assert g > 0 and lam_g == pytest.approx(np.linalg.eigvalsh(S + X.numpy() / g)[-1], rel=1e-8)


def test_limited_defaults_to_torch_threads_and_restores():
    """limited() takes torch's count; limited(n) overrides it; both put every pool back, also after an error."""
    old = torch.get_num_threads()
    try:
        with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
            torch.set_num_threads(1)
            with threads.limited():
                assert set(blas_counts()) == {1}
                with threads.limited(3):  # nested: the inner block, then the outer count again
                    assert set(blas_counts()) == {3}
                assert set(blas_counts()) == {1}
            assert set(blas_counts()) == {2}
            with pytest.raises(RuntimeError), threads.limited(1):
                raise RuntimeError("inside")
            assert set(blas_counts()) == {2}
            with pytest.raises(ValueError, match="at least 1"), threads.limited(0):
                pass
    finally:
        torch.set_num_threads(old)


def test_set_threads_is_process_wide_and_restores():
    """set_threads(n): torch, the BLAS pools and the OpenMP pool all on n; restore() (or leaving its `with` block)
    puts every count back as it was, and a second restore() changes nothing. Pools loaded after an earlier search
    are among them."""
    threads.blas_threads()  # a search made before another pool is loaded: scikit-learn's OpenMP runtime
    import sklearn.datasets  # noqa: F401
    old_torch, old_pools = torch.get_num_threads(), all_counts()
    n = 3 if old_torch != 3 else 4  # differs from every count before, so a missed pool shows
    try:
        setting = threads.set_threads(n)
        assert torch.get_num_threads() == n
        now = all_counts()
        assert set(now.values()) == {n} and now.keys() == old_pools.keys()
        with threads.limited():  # torch's count, now n
            assert set(blas_counts()) == {n}
        setting.restore()
        assert torch.get_num_threads() == old_torch and all_counts() == old_pools
        torch.set_num_threads(1)
        setting.restore()  # once only: does not undo what came after
        assert torch.get_num_threads() == 1
        torch.set_num_threads(old_torch)
        with threads.set_threads(1):
            assert torch.get_num_threads() == 1 and set(all_counts().values()) == {1}
        assert torch.get_num_threads() == old_torch and all_counts() == old_pools
        with pytest.raises(ValueError, match="at least 1"):
            threads.set_threads(0)
    finally:
        torch.set_num_threads(old_torch)


def test_limited_searches_the_libraries_once(monkeypatch):
    """The pools are found once (threadpoolctl's search costs about 0.3 ms, the block about 5 us): a hundred blocks
    construct no controller and read no library list; after an import (a library may have come with it), one."""
    with threads.limited(1):
        pass
    built = []

    class Counting(threadpoolctl.ThreadpoolController):
        def __init__(self, *a, **k):
            built.append(1)
            super().__init__(*a, **k)
    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", Counting)
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: built.append(1) or [])
    for k in range(100):
        with threads.limited(1 + k % 2):
            pass
    assert built == []
    import types
    monkeypatch.setitem(sys.modules, "lipcheck_threads_probe", types.ModuleType("probe"))  # "a module imported"
    for k in range(100):
        with threads.limited(1 + k % 2):
            pass
    assert len(built) == 1  # searched again once, then kept
    monkeypatch.undo()
    threads.refresh()  # a new search on request: the same pools again
    assert set(threads.blas_threads()) == {p["filepath"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"}
