"""The agents' one error type."""


class AgentError(ValueError):
    """Bad agent input (agent spec, scripts, settings, task set); the message names the culprit."""
