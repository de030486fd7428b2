"""Errors for bad training inputs (kept import-light: the CLI catches them without loading grain)."""


class DataError(ValueError):
    """A data path, file, record or tokenizer cannot be used; the message names the culprit."""
