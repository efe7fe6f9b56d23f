"""``python -m ray_goodput.cli``."""

import sys

from ray_goodput.cli import main

sys.exit(main())
