"""Readable names for pytree paths (`jax.tree_util` key paths and nnx State paths)."""

from __future__ import annotations


def path_keys(path) -> tuple[str, ...]:
    """('moe_layers', 'mlp', 'gate_proj') from a key path of DictKey / GetAttrKey / SequenceKey entries
    (or of plain strings and ints, as nnx State paths hold)."""
    keys = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                keys.append(str(getattr(key, attr)))
                break
        else:
            keys.append(str(key))
    return tuple(keys)


def path_str(path, sep: str = "/") -> str:
    """'moe_layers/mlp/gate_proj' ('<root>' for the empty path)."""
    return sep.join(path_keys(path)) or "<root>"
