"""Training data: tokenizers, grain sources, packing, SFT conversations."""
