"""`python -m composer_jax.cli ...` is `composer-jax ...`."""

import sys

from composer_jax.cli import main

sys.exit(main())
