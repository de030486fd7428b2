"""`composer-jax rl` (the command line, process-group flags included) on the parity tasks of
tests/rl_parity.py (tests/test_distributed.py):

    python -m tests.rl_learner_process key=value ... --coordinator HOST:PORT --num-processes N --process-id I
"""

import sys

from composer_jax import cli
from composer_jax.rl import loop
from tests.rl_parity import parity_tasks

if __name__ == "__main__":
    loop.task_sets = lambda *args, **kwargs: parity_tasks()
    sys.exit(cli.main(["rl", *sys.argv[1:]]))
