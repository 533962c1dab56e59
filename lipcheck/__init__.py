"""lipcheck: certified Lipschitz bounds, attention growth probes and Picard-Lindelof checks for SSoG."""
import importlib

from .mixers import DenseAttention, SSoG
from .models import IntegrationError, ViT, vit_from_preset

__all__ = ["SSoG", "DenseAttention", "ViT", "vit_from_preset", "IntegrationError", "load", "certify", "bounds",
           "probe", "wellposed"]
__version__ = "0.1.0"


def load(path, *, device="cpu", dtype=None):
    """The model of a checkpoint `lipcheck train` wrote (the file or its run directory), with its config and
    data info: a `lipcheck.checkpoint.Checkpoint` (.model .variant .mixer .config .data .grid .initial_model())."""
    from .checkpoint import load as _load
    return _load(path, device=device, dtype=dtype)


def __getattr__(name):  # lipcheck.bounds / .probe / .wellposed / certify load on first use (they pull in more)
    if name in ("bounds", "probe", "wellposed", "symbolic"):
        return importlib.import_module(f".{name}", __name__)
    if name == "certify":
        return importlib.import_module(".certification", __name__).certify
    raise AttributeError(f"module 'lipcheck' has no attribute {name!r}")
