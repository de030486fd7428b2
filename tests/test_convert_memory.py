"""Streaming conversion memory: peak RSS grows with the work block size, not with the checkpoint.

A ~225 MB synthetic multi-shard bf16 checkpoint (largest tensor 64 MiB) is converted in a child process
with 8 MiB blocks; the child reports its RSS before converting and its peak RSS after (/proc:
VmRSS, VmHWM).
The full-size check (>= 2 GB, measured with /usr/bin/time -v) is `tools/bench_convert.py`.
"""

import json
import subprocess
import sys

from composer_jax import load_config
from composer_jax.checkpoint.synthetic import write_synthetic_hf
from composer_jax.model import abstract_params

CHILD = """
import json, sys
from composer_jax.checkpoint.convert import convert
from composer_jax.checkpoint.hf import open_hf, plan_leaves
from composer_jax.model import abstract_params
cfg = open_hf(sys.argv[1]).cfg
plan_leaves(abstract_params(cfg), cfg)  # warm up: imports, abstract model
status = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0])  # kB
before = status("VmRSS")  # current RSS (the peak so far is the warm-up's)
convert(sys.argv[1], sys.argv[2], workers=2, chunk_bytes=8 << 20, params_of=abstract_params)
after = status("VmHWM")  # peak RSS of this process image (ru_maxrss would include the parent's at fork)
print(json.dumps({"before_mb": before / 1024, "after_mb": after / 1024}))
"""


def test_peak_rss_is_bounded_by_blocks_not_checkpoint(tmp_path):
    cfg = load_config("tiny", ["vocab_size=32768", "hidden_size=1024", "intermediate_size=2048",
                               "moe.moe_intermediate_size=512", "moe.n_routed_experts=8", "moe.n_group=1",
                               "moe.topk_group=1", "mtp.num_layers=0", "dtype=bfloat16", "param_dtype=bfloat16"])
    size = write_synthetic_hf(tmp_path / "hf", cfg, shard_bytes=80 << 20, params_of=abstract_params)
    assert size > 200e6 and len(list((tmp_path / "hf").glob("*.safetensors"))) >= 3
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "hf"), str(tmp_path / "out")],
                         capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    growth = rss["after_mb"] - rss["before_mb"]
    print(f"checkpoint {size / 1e6:.0f} MB: peak RSS {rss['before_mb']:.0f} -> {rss['after_mb']:.0f} MB")
    # 2 workers x (block read + transposed copy + tensorstore's chunk copy) x 8 MiB, plus allocator slack.
    assert growth < 2 * 3 * 8 + 64, f"peak RSS grew by {growth:.0f} MB converting {size / 1e6:.0f} MB"


LOAD_CHILD = """
import json, sys
from composer_jax.cpu_devices import use_cpu_devices
use_cpu_devices(8)
import jax
from composer_jax.config import MeshConfig
from composer_jax.model_dirs import open_source
from composer_jax.parallel import DualMesh
from composer_jax.source_weights import load_model
source = open_source(sys.argv[1])
dual = DualMesh(MeshConfig(fsdp=8, ep=8), jax.devices(), model=source.model)
status = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0])  # kB
jax.block_until_ready(jax.numpy.zeros(8))   # the backend up
before = status("VmRSS")
model = load_model(source, source.model, dual, chunk_bytes=8 << 20)
jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
print(json.dumps({"before_mb": before / 1024, "after_mb": status("VmHWM") / 1024}))
"""


def test_loading_a_source_onto_the_dual_grid_holds_the_weights_once(tmp_path):
    """`init_from`'s streaming load of a ~225 MB checkpoint onto 8 CPU devices (whose memory is host memory):
    the peak grows by the weights on the devices plus a bounded working set (a leaf's shards at a time, an
    8 MiB read block), not by a second copy of the checkpoint (a whole-model read would double it)."""
    cfg = load_config("tiny", ["vocab_size=32768", "hidden_size=1024", "intermediate_size=2048",
                               "moe.moe_intermediate_size=512", "moe.n_routed_experts=8", "moe.n_group=1",
                               "moe.topk_group=1", "mtp.num_layers=0", "dtype=bfloat16", "param_dtype=bfloat16"])
    size = write_synthetic_hf(tmp_path / "hf", cfg, shard_bytes=80 << 20, params_of=abstract_params)
    out = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(tmp_path / "hf")], capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    growth = rss["after_mb"] - rss["before_mb"]
    print(f"checkpoint {size / 1e6:.0f} MB: peak RSS {rss['before_mb']:.0f} -> {rss['after_mb']:.0f} MB")
    # the weights once (size), the largest leaf's host shards (the 64 MiB embedding or head), read blocks
    assert growth < size / 2**20 + 64 + 2 * 8 + 64, f"peak RSS grew by {growth:.0f} MB loading {size / 1e6:.0f} MB"
