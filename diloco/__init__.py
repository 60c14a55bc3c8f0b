"""diloco: Decoupled DiLoCo training on JAX (Douillard et al., arXiv 2604.21428)."""

import jax as _jax

__version__ = "0.1.0"

# Arrays a jitted function closes over become arguments of the executable instead of literals in
# its HLO (JAX's newer constant handling; the default of the pinned jax embeds them). A LoRA model
# closes over its frozen checkpoint weights (diloco/model/lora.py): embedded, SmolLM2-135M's 540 MB
# of them took the train step's compile past 7 minutes and 9 GB; hoisted, 17 s
# (docs/design.md#lora).
_jax.config.update("jax_use_simplified_jaxpr_constants", True)
