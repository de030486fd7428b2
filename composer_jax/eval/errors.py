"""The evaluation's one error type."""


class EvalError(ValueError):
    """Bad evaluation input (task set, agent spec, settings, run directory); the message names the culprit."""
