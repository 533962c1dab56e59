import os

import matplotlib
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (default "ci"):
#   ci        derandomised: every run draws the same examples, so a red CI run is reproducible and a green
#             one is not luck; the per-test max_examples in the files stay as written (kept modest).
#   thorough  random draws, THOROUGH_SCALE x each test's own max_examples (also where a test sets it),
#             no deadline: HYPOTHESIS_PROFILE=thorough python -m pytest
#   mutation  derandomised, no shrinking, no example database: a mutant only needs one failing example,
#             and shrinking it can take minutes (experiments/mutation.py sets it).
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("thorough", derandomize=False, deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("mutation", derandomize=True, deadline=None, database=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate],
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
THOROUGH_SCALE = 20

# pytest-xdist (addopts: one worker per core): each worker gets its share of the cores for torch and for every
# BLAS pool scipy and numpy bring (the tests' own references too), so the workers' threads do not wait on each
# other's cores. Tests that need a thread count set their own.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    from lipcheck import threads
    threads.set_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    """Under the thorough profile, scale every hypothesis test's own max_examples (a decorator's explicit
    max_examples would otherwise win over the profile) and draw at random."""
    if PROFILE != "thorough":
        return
    for item in items:
        test = getattr(item, "obj", None)
        s = getattr(test, "_hypothesis_internal_use_settings", None)
        if s is not None:
            test._hypothesis_internal_use_settings = settings(s, max_examples=s.max_examples * THOROUGH_SCALE,
                                                              derandomize=False, deadline=None)


@pytest.fixture
def one_thread():
    """Tiny batched kernels: one thread avoids oversubscribing the shared cores (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_block(C, heads=2, seed=0, use_mlp=True, dtype=torch.float64, **kw):
    """A frozen SSoG ViT block with N(0, 0.4^2) weights: the test field of the log-norm and enclosure tests."""
    from lipcheck.models.vit import Block
    torch.manual_seed(seed)
    blk = Block(C, heads, "ssog", dtype=dtype, mlp_ratio=1.5, use_mlp=use_mlp, **kw).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(std=0.4)
            p.requires_grad_(False)
    return blk


def layer_norm(z, norm):
    """nn.LayerNorm `norm` written out in elementary operations. Nested forward-mode autograd through torch's
    native layer_norm returns a wrong second derivative (measured: -0.31 where finite differences, the reverse-mode
    Hessian and the closed form of proofs/S5.md Lemma 1 agree on -0.19), so second derivatives go through this."""
    mu = z.mean(-1, keepdim=True)
    zc = z - mu
    out = zc / ((zc * zc).mean(-1, keepdim=True) + norm.eps).sqrt()
    if norm.weight is not None:
        out = out * norm.weight
    return out + norm.bias if norm.bias is not None else out


def block_field(blk, mixer=None):
    """The block's vector field Mixer(LN1 x) + MLP(LN2 x) with `layer_norm` (second derivatives by nested forward
    mode); mixer: another module with the block's mixer weights (e.g. attention's written-out softmax)."""
    m = blk.mixer if mixer is None else mixer
    return lambda z: m(layer_norm(z, blk.norm1)) + (blk.mlp(layer_norm(z, blk.norm2)) if blk.mlp is not None else 0)
