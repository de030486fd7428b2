"""The `composer-jax` console script: the process restarts with huge pages for XLA:CPU's buffers
(`cpu_devices.restart_with_huge_pages`) before the CLI is imported, so the restart costs no imports."""

from __future__ import annotations

from composer_jax.cpu_devices import restart_with_huge_pages


def main() -> int:
    restart_with_huge_pages()
    from composer_jax.cli import main as cli_main

    return cli_main()
