"""Whether an engine decodes speculatively: the `speculative` setting (off / on / auto, or a bool)
against the model's MTP depths and the platform, and how many tokens it drafts per step.

`auto` is on where the model has MTP depths and the decode bench measured speculative decoding faster
than plain decoding on the platform (MEASURED_FASTER, one entry per platform with the measurement it
records); a platform without an entry has not been measured, and stays off.
"""

from __future__ import annotations

SETTINGS = ("off", "on", "auto")
DEFAULT_DRAFT_TOKENS = 2    # drafts per step when the setting gives none: see docs/inference.md's Measured table

# platform -> speculative decoding faster than plain? Each from `python tools/bench_decode.py` (bench/decode.py:
# the trained tiny run and self-drafting models of the peer bench's sizes; docs/inference.md, Measured).
MEASURED_FASTER = {
    # 2-core CPU, 2026-12-03, every draft accepted (self-drafting weight_bound), after plain decoding read
    # its weights in place (ba06bdd): batch 1 0.70x / 0.74x at 1 / 2 drafts (a speculative step costs 2.9x /
    # 4.0x a plain one), batch 8 1.10x / 1.06x; the trained tiny run accepts 76-85%, so below those. Off.
    "cpu": False,
}


def setting(value) -> str:
    """The setting a config value names: off / on / auto, YAML's booleans (on / off / true / false) as on / off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in SETTINGS:
        raise ValueError(f"must be one of {', '.join(SETTINGS)} (or a bool), got {value!r}")
    return value


def draft_tokens(value, mtp_depths: int, platform: str, drafts: int = 0) -> int:
    """Tokens an engine drafts per decode step under setting `value` (0: plain decoding) for a model of
    `mtp_depths` MTP depths on `platform` (jax.default_backend()); `drafts` 0: DEFAULT_DRAFT_TOKENS.
    ValueError for `on` without MTP depths or a negative `drafts`."""
    try:
        choice = setting(value)
    except ValueError as e:
        raise ValueError(f"speculative {e}") from None
    if drafts < 0:
        raise ValueError(f"draft_tokens must be >= 0 (0: {DEFAULT_DRAFT_TOKENS}), got {drafts}")
    if choice == "on" and not mtp_depths:
        raise ValueError("speculative=on drafts with the MTP depths, and this model has none (mtp.num_layers=0)")
    use = choice == "on" or (choice == "auto" and mtp_depths > 0 and MEASURED_FASTER.get(platform, False))
    return (drafts or DEFAULT_DRAFT_TOKENS) if use else 0
