import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def one_thread():
    """Tiny batched kernels: one thread avoids oversubscribing the shared cores (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
