"""Certified Lipschitz bounds: fixed-kernel SSoG (`ssog_lipschitz`, lipschitz.py over spectral.py, deflation.py,
majorant.py) and the block / ODE vector field (network.py)."""
from .network import VectorFieldBound, mixer_lipschitz, mlp_lipschitz, vector_field_lipschitz
from .lipschitz import CertifyOptions, SSoGBound, certify_options, plan, ssog_lipschitz

__all__ = ["ssog_lipschitz", "SSoGBound", "CertifyOptions", "certify_options", "plan", "vector_field_lipschitz",
           "VectorFieldBound", "mlp_lipschitz", "mixer_lipschitz"]
