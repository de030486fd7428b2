#!/usr/bin/env python
"""Thin wrapper: `composer-jax convert SRC DST [key=value ...] [options]` (Hugging Face -> orbax).

    python tools/convert_hf_to_orbax.py /models/Kimi-K2.5 /ckpt/kimi-k2.5 --workers 8 --devices 64 --mesh replica=8,fsdp=8,ep=64
"""

import sys

from composer_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
