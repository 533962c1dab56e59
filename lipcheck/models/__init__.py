from .ode import IntegrationError, ODEFlow, VectorField, integrate
from .vit import PRESETS, VARIANTS, Block, ViT, vit_from_preset
