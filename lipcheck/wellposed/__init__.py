"""Picard-Lindelof on the Neural-ODE ViT (SPEC S5), checked numerically and proven by enclosure.

    x' = F(x) = Mixer(LN1(x)) + MLP(LN2(x)),  x(0) = x0 = embed(images),  t in [0, t1]

- `solve`: inputs, integration with exact step counts, the converged fixed-step dopri8 `reference_solution`;
- `sweep`: `tolerance_sweep`, every method and tolerance against that reference;
- `gronwall`: `perturbation_growth` against exp(L t) with the global and local Lipschitz constants;
- `certificate`: the sampled a-posteriori bound int exp(L (t - s)) ||delta(s)|| ds (kept for comparison);
- `enclosure`: `enclose`, the computer-assisted proof: a rigorous tube around the computed solution,
  with the defect bounded on whole steps and the logarithmic norm in place of L (proofs/S5.md);
- `gradients`: `gradient_check`, adjoint against backpropagation, NFE forward / backward counted separately.
"""
from .certificate import aposteriori_certificate
from .enclosure import Enclosure, EnclosureError, SSoGField, enclose, enclose_field, lognorm_envelope
from .gradients import gradient_check
from .gronwall import (auto_grid, envelope_violations, flow_map, perturbation_growth, segment_variance_floor, token_speed_bound,
                       vector_field_constants, worst_direction)
from .solve import (METHODS, RK4_STEPS, STAGES, TOLERANCES, CountingField, Reference, check_methods,
                    check_tolerances, prepare, reference_solution, relative_error, sample_norm, solve, token_std)
from .sweep import SweepResult, convergence_summary, tolerance_sweep

__all__ = ["METHODS", "TOLERANCES", "RK4_STEPS", "STAGES", "CountingField", "Reference", "SweepResult",
           "check_methods", "check_tolerances", "prepare", "sample_norm", "token_std", "solve", "relative_error",
           "reference_solution", "tolerance_sweep", "convergence_summary", "vector_field_constants",
           "token_speed_bound", "segment_variance_floor", "flow_map", "worst_direction", "auto_grid",
           "perturbation_growth", "aposteriori_certificate", "enclose", "Enclosure", "EnclosureError",
           "lognorm_envelope", "envelope_violations", "enclose_field", "SSoGField", "gradient_check"]
