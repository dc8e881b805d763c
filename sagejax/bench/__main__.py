"""``python -m sagejax.bench``: see :mod:`sagejax.bench.cli`."""

import sys

from sagejax.bench.cli import main

__all__ = ["main"]

if __name__ == "__main__":
  sys.exit(main())
