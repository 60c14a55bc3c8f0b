"""diloco: Decoupled DiLoCo training on JAX (Douillard et al., arXiv 2604.21428)."""

__version__ = "0.1.0"
