"""Quickstart: train with 2 Ray Train workers, kill one, resume from the last committed
checkpoint. Same as ``ray-goodput demo``; see ``--help``."""

import sys

from ray_goodput.demo import main

if __name__ == "__main__":
    sys.exit(main())
