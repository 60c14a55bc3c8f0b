"""The Decoupled DiLoCo algorithm as pure functions and state machines (arXiv 2604.21428)."""
