"""What every entry point under scripts/ does alike: keep library chatter off the console, and end a
user's mistake with one `error:` line and exit status 2, never a traceback."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn


def quiet_logs() -> None:
    # Orbax logs every checkpoint step at INFO through absl; JAX reports at INFO that it found no
    # TPU, which reads as an error on a laptop.
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def fail(message: object) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
