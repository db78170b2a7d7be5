"""`kvstore bench` subcommands (docs/benchmarks.md)."""
from __future__ import annotations

import os
import tempfile

from kvstore.errors import ConfigError


def scratch_dir(prefix: str, directory: str | None) -> str:
    """A new scratch directory for one bench run, under `directory` (the user's --dir, made
    when it does not exist yet) or the system temp directory."""
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--dir {directory}: cannot make it ({exc.strerror}); name a "
                              f"directory kvstore can write") from None
    return tempfile.mkdtemp(prefix=prefix, dir=directory)
