"""Test setup: 8 simulated CPU devices, so sharded code paths run without accelerators."""

import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
