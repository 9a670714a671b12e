"""`python -m dpfit ...` (what `torchrun -m dpfit train ...` runs on every rank)."""

import sys

from dpfit.cli import main

if __name__ == "__main__":
    sys.exit(main())
