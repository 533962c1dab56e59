"""Token mixers: SSoG and its matched dense-attention baseline, selectable by name."""
from .attention import DenseAttention
from .ssog import SSoG

__all__ = ["MIXERS", "DenseAttention", "SSoG", "make_mixer"]

MIXERS = ("ssog", "attention")


def make_mixer(name: str, dim: int, num_heads: int, *, num_components: int = 4, ssog_backend: str = "matmul",
               attn_backend: str = "sdpa", device=None, dtype=None):
    """Build a mixer by name, so that SSoG and attention blocks differ in nothing else."""
    if name == "ssog":
        return SSoG(dim, num_heads, num_components, backend=ssog_backend, device=device, dtype=dtype)
    if name == "attention":
        return DenseAttention(dim, num_heads, backend=attn_backend, device=device, dtype=dtype)
    raise ValueError(f"unknown mixer {name!r}; choose one of {MIXERS}")
