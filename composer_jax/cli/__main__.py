"""`python -m composer_jax.cli ...` is `composer-jax ...` (restarted with huge pages as it is, after
importing the CLI once more)."""

import sys

from composer_jax.cli import main
from composer_jax.cpu_devices import restart_with_huge_pages

restart_with_huge_pages()
sys.exit(main())
