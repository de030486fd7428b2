"""The `composer-jax` console script: the process restarts with huge pages for XLA:CPU's buffers
(`cpu_devices.restart_with_huge_pages`) before the CLI is imported, so the restart costs no imports; then
Python's garbage collector runs less often (`cpu_devices.collect_garbage_less_often`)."""

from __future__ import annotations

from composer_jax.cpu_devices import collect_garbage_less_often, restart_with_huge_pages


def main() -> int:
    restart_with_huge_pages()
    collect_garbage_less_often()
    from composer_jax.cli import main as cli_main

    return cli_main()
