"""lipcheck: certified Lipschitz bounds, attention growth probes and Picard-Lindelof checks for SSoG."""
import importlib

from .mixers import DenseAttention, SSoG
from .models import IntegrationError, ViT, vit_from_preset

__all__ = ["SSoG", "DenseAttention", "ViT", "vit_from_preset", "IntegrationError", "bounds", "probe", "wellposed"]
__version__ = "0.1.0"


def __getattr__(name):  # lipcheck.bounds / .probe / .wellposed load on first use (they pull in more)
    if name in ("bounds", "probe", "wellposed", "symbolic"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lipcheck' has no attribute {name!r}")
