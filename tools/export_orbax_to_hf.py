#!/usr/bin/env python
"""Thin wrapper: `composer-jax export SRC DST [options]` (orbax -> Hugging Face safetensors).

    python tools/export_orbax_to_hf.py /ckpt/kimi-k2.5 /models/kimi-k2.5-finetuned --dtype bfloat16
"""

import sys

from composer_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
