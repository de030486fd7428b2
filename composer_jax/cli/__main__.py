"""`python -m composer_jax.cli ...` is `composer-jax ...`: Python's garbage collector runs less often, and
the process restarts with huge pages as the script does (after importing the CLI once more)."""

import sys

from composer_jax.cpu_devices import collect_garbage_less_often, restart_with_huge_pages

collect_garbage_less_often()

from composer_jax.cli import main  # noqa: E402

restart_with_huge_pages()
sys.exit(main())
