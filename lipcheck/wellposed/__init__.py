"""Picard-Lindelof on the Neural-ODE ViT (SPEC S5), checked numerically and proven by enclosure.

    x' = F(x) = Mixer(LN1(x)) + MLP(LN2(x)),  x(0) = x0 = embed(images),  t in [0, t1]

- `solve`: inputs, integration with exact step counts, the converged fixed-step dopri8 `reference_solution`;
- `sweep`: `tolerance_sweep`, every method and tolerance against that reference;
- `gronwall`: `perturbation_growth` against exp(L t) with the global and local Lipschitz constants;
- `certificate`: the sampled a-posteriori bound int exp(L (t - s)) ||delta(s)|| ds (kept for comparison);
- `enclosure`: `enclose`, the computer-assisted proof: a rigorous tube around the computed solution,
  with the defect bounded on whole steps and the logarithmic norm in place of L (proofs/S5.md); its parts:
  `quartic` (the computed y), `defect`, `field` (point log-norms), `recurrence` (the radius), `direct`
  (Theorem 5), `distance` (Theorem 6), `envelope` (`lognorm_envelope`), `options`, `result`;
- `gradients`: `gradient_check`, adjoint against backpropagation, NFE forward / backward counted separately.
"""
from .attention_field import AttentionField, make_field
from .certificate import aposteriori_certificate
from .enclosure import LOGNORM_WORK, REF_WORK_BUDGET, enclose, enclose_field
from .envelope import lognorm_envelope
from .field import SSoGField
from .gradients import gradient_check
from .gronwall import (auto_grid, envelope_violations, flow_map, perturbation_growth,  # noqa: F401
                       segment_variance_floor, token_speed_bound, vector_field_constants, worst_direction)
from .options import EnclosureError
from .result import Enclosure
from .solve import (METHODS, RK4_STEPS, STAGES, TOLERANCES, CountingField, Reference,  # noqa: F401
                    check_methods, check_tolerances, prepare, reference_solution, relative_error, sample_norm, solve,
                    token_std)
from .sweep import SweepResult, convergence_summary, tolerance_sweep  # noqa: F401

__all__ = ["METHODS", "TOLERANCES", "RK4_STEPS", "prepare", "solve", "sample_norm", "reference_solution",
           "tolerance_sweep", "perturbation_growth", "vector_field_constants", "aposteriori_certificate",
           "enclose", "enclose_field", "REF_WORK_BUDGET", "LOGNORM_WORK", "Enclosure", "EnclosureError", "SSoGField",
           "lognorm_envelope", "gradient_check", "AttentionField", "make_field"]
