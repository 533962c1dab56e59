"""Thread control: the one place that sets how many threads lipcheck's linear algebra runs on.

torch's thread count does not reach the BLAS/LAPACK libraries that scipy and numpy bundle (each an OpenBLAS with
its own pool, sized to the machine's cores). On a machine with other work running, those pools spin for cores they
do not get: 30 Cholesky factorisations of order 768 through scipy took 59 s with the default pool against 1.7 s on
one thread. Hence:

- `set_threads(n)`: process-wide, torch and every BLAS/OpenMP pool threadpoolctl finds; returns a handle whose
  `restore()` (or a `with` block) puts back the previous counts.
- `limited(n=None)`: around a call into scipy/numpy, their BLAS pools limited to n, by default torch's current
  count (so inside `spectral.single_thread()` it is 1).
"""
from __future__ import annotations

import contextlib
import sys

import torch

_controller = None  # every pool threadpoolctl found (set_threads)
_blas_libs: list = []  # the BLAS ones among them (limited)
_modules_seen = -1  # len(sys.modules) at that search


def _pools(fresh: bool = False):
    """The thread pools of the loaded libraries. threadpoolctl's search costs about 0.3 ms and a limit through its
    own API about 10 us per block, so the search is kept, and made again only once more modules are imported (a new
    extension module may bring its own pool: scikit-learn's OpenMP runtime, say) or when `fresh`."""
    global _controller, _blas_libs, _modules_seen
    if fresh or _controller is None or len(sys.modules) != _modules_seen:
        import numpy  # noqa: F401  (load both bundled BLAS libraries before the search, so it finds them)
        import scipy.linalg  # noqa: F401
        from threadpoolctl import ThreadpoolController
        _controller = ThreadpoolController()
        _blas_libs = list(_controller.select(user_api="blas").lib_controllers)
        _modules_seen = len(sys.modules)
    return _controller


def refresh() -> None:
    """Search the loaded libraries again (one loaded without an import, through ctypes, say)."""
    _pools(fresh=True)


def blas_threads() -> dict[str, int]:
    """{library path: thread count} of the BLAS pools `limited` acts on (what a call into scipy/numpy gets)."""
    _pools()
    return {lib.filepath: lib.num_threads for lib in _blas_libs}


class ThreadSetting:
    """The previous state behind `set_threads`: `restore()` puts it back (once); also a context manager."""

    def __init__(self, torch_threads: int, limiter):
        self._torch, self._limiter, self._done = torch_threads, limiter, False

    def restore(self) -> None:
        if self._done:
            return
        self._done = True
        self._limiter.restore_original_limits()
        torch.set_num_threads(self._torch)  # last: it also sets torch's OpenMP pool back

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def set_threads(n: int) -> ThreadSetting:
    """Run lipcheck on n threads, process-wide: torch.set_num_threads(n) and every BLAS and OpenMP pool
    threadpoolctl sees (scipy's and numpy's OpenBLAS, torch's OpenMP) limited to n. Returns the handle that
    restores the previous counts (`.restore()` or `with set_threads(n): ...`). A library loaded later keeps its own
    count, except the BLAS ones that `limited` reaches (lipcheck's own calls into scipy and numpy)."""
    n = int(n)
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    old = torch.get_num_threads()
    limiter = _pools(fresh=True).limit(limits=n)
    torch.set_num_threads(n)
    return ThreadSetting(old, limiter)


@contextlib.contextmanager
def limited(n: int | None = None):
    """scipy's and numpy's BLAS pools limited to n threads (default: torch.get_num_threads(), the count lipcheck
    runs on) for the block, restored after. The limit is process-wide while the block runs. Also a decorator."""
    n = torch.get_num_threads() if n is None else int(n)
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _pools()
    # set and reset through the libraries directly (a few us, against threadpoolctl's 10); a pool at n is left alone
    changed = [(lib, k) for lib in _blas_libs if (k := lib.get_num_threads()) != n]
    for lib, _ in changed:
        lib.set_num_threads(n)
    try:
        yield
    finally:
        for lib, k in changed:
            lib.set_num_threads(k)
