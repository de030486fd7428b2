"""Helpers shared by the RL step tests."""

import jax
import optax


def adam_first_moment(opt_state):
    """Adam's first moment as a params-shaped tree (after one step: (1 - b1) x the clipped gradient the
    step applied), joined from the per-mesh optimizer states."""
    def mu(group_state):
        is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
        return next(s for s in jax.tree.leaves(group_state, is_leaf=is_adam) if is_adam(s)).mu

    return opt_state.groups.join([mu(inner) for inner in opt_state.inner])
