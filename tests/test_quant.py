"""Quantized checkpoints: K2.5 INT4 (compressed-tensors pack-quantized) and DeepSeek FP8 blocks.

The packers and the numpy dequantization references below are written here from each format's
published description, independently of composer_jax.checkpoint.quant: compressed-tensors' own packing
code for INT4, DeepSeek-V3's block-scale description for FP8.
A tiny random model is quantized, converted, exported back as float32 and compared bit for bit with
the reference dequantization; its logits are compared with transformers' on the dequantized weights.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from composer_jax import config, from_pretrained, load_config
from composer_jax.checkpoint.convert import convert
from composer_jax.checkpoint.export import export
from composer_jax.checkpoint.orbax_io import SIDE_FILE
from composer_jax.checkpoint.quant import QuantConfig, TensorReader, dequant_int4
from composer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from composer_jax.model import abstract_params
from composer_jax.model_dirs import load_converted
from tests.hf_reference import hf_logits, save_random_hf_model

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
FP8_BLOCK = (16, 8)  # not square and smaller than the tiny weights, so blocks tile and get cropped
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK)}


# INT4 as compressed-tensors publishes it (vllm-project/compressed-tensors,
# compressors/quantized_compressors/pack_quantized.py `pack_to_int32` / `unpack_from_int32` with
# packed_dim=1, and quantization/lifecycle/forward_helpers.py `_process_group`): a value v in [-8, 7] is
# stored as the unsigned nibble v + 2**(bits-1); the 32 // bits values of inputs 8j..8j+7 sit in int32
# column j, input 8j + i in bits 4i..4i+3; padding past the last input is zero. Symmetric groups of
# `group_size` consecutive inputs share a scale: W[o, i] = v[o, i] * scale[o, i // group_size].
NUM_BITS = 4
PACK_FACTOR = 32 // NUM_BITS
OFFSET = 1 << (NUM_BITS - 1)


def pack_to_int32(values):
    """int8 [rows, cols] in [-8, 7] -> int32 [rows, ceil(cols / 8)]."""
    rows, cols = values.shape
    padded = np.zeros((rows, -(-cols // PACK_FACTOR) * PACK_FACTOR), np.int64)
    padded[:, :cols] = values.astype(np.int64) + OFFSET
    shifts = np.arange(PACK_FACTOR, dtype=np.int64) * NUM_BITS
    packed = (padded.reshape(rows, -1, PACK_FACTOR) << shifts).sum(axis=2)  # < 2**32: no carries
    return packed.astype(np.uint32).view(np.int32)


def unpack_from_int32(packed, cols):
    """int32 [rows, n] -> int8 [rows, cols]."""
    mask = (1 << NUM_BITS) - 1
    bits = packed.astype(np.int64) & 0xFFFFFFFF
    unpacked = np.zeros((packed.shape[0], packed.shape[1] * PACK_FACTOR), np.int64)
    for i in range(PACK_FACTOR):
        unpacked[:, i::PACK_FACTOR] = (bits >> (NUM_BITS * i)) & mask
    return (unpacked[:, :cols] - OFFSET).astype(np.int8)


def pack_int4(w, group=32):
    """float [out, in] -> (int32 [out, ceil(in/8)] packed, bf16 [out, ceil(in/group)] scales)."""
    out, n = w.shape
    groups = -(-n // group)
    padded = np.zeros((out, groups * group), np.float32)
    padded[:, :n] = w
    scale = (np.abs(padded.reshape(out, groups, group)).max(-1) / 7).astype(BF16)
    s = np.repeat(np.where(scale == 0, 1, scale).astype(np.float32), group, axis=1)
    values = np.clip(np.rint(padded / s), -8, 7).astype(np.int8)[:, :n]
    return pack_to_int32(values), scale


def ref_dequant_int4(packed, scale, shape, group=32):
    """float32 [out, in]: exact (4-bit value x bf16 scale fits float32; compressed-tensors' torch path
    multiplies in the scale's dtype, which would round to bf16)."""
    out, n = shape
    values = unpack_from_int32(packed, n).astype(np.float64)
    return (values * np.repeat(scale.astype(np.float64), group, axis=1)[:, :n]).astype(np.float32)


def quant_fp8(w, block=FP8_BLOCK):
    """float [out, in] -> (fp8 [out, in], f32 [ceil(out/bo), ceil(in/bi)] scale_inv)."""
    (out, n), (bo, bi) = w.shape, block
    so, si = -(-out // bo), -(-n // bi)
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[:out, :n] = w
    amax = np.abs(padded.reshape(so, bo, si, bi)).max(axis=(1, 3))
    scale_inv = np.where(amax == 0, 1, amax / 448).astype(np.float32)
    q = padded / np.kron(scale_inv, np.ones((bo, bi), np.float32))
    return q[:out, :n].astype(FP8), scale_inv


def ref_dequant_fp8(q, scale_inv, block=FP8_BLOCK):
    out, n = q.shape
    return q.astype(np.float32) * np.kron(scale_inv, np.ones(block, np.float32))[:out, :n]


def test_int4_nibble_order_and_offset():
    # 0x76543210: nibbles 0..7 from the low end -> values -8..-1; 0xFEDCBA98 -> 0..7.
    packed = np.array([[0x76543210, np.uint32(0xFEDCBA98).view(np.int32)]], np.int32)
    got = dequant_int4(packed, np.array([[1.0]], BF16), 16, 32)
    np.testing.assert_array_equal(got, [np.arange(-8, 8, dtype=np.float32)])
    got = dequant_int4(packed, np.array([[0.5]], BF16), 12, 32)  # cropped to 12 inputs, scaled
    np.testing.assert_array_equal(got, [0.5 * np.arange(-8, 4, dtype=np.float32)])


@pytest.mark.parametrize("rows, cols, group", [(3, 64, 32), (4, 20, 32), (2, 100, 32), (2, 256, 128), (5, 48, 16)])
def test_int4_dequant_matches_the_published_decoder(rows, cols, group):
    """Random int32 words (every nibble pattern, the sign bit, non-zero padding nibbles) and random
    signed bf16 scales: our dequantization equals compressed-tensors' unpack-and-scale bit for bit, and
    values packed by compressed-tensors' packer come back unchanged."""
    rng = np.random.default_rng(cols)
    packed = rng.integers(-2 ** 31, 2 ** 31, size=(rows, -(-cols // 8)), dtype=np.int64).astype(np.int32)
    scale = rng.uniform(-0.05, 0.05, size=(rows, -(-cols // group))).astype(BF16)
    np.testing.assert_array_equal(dequant_int4(packed, scale, cols, group),
                                  ref_dequant_int4(packed, scale, (rows, cols), group))
    values = rng.integers(-8, 8, size=(rows, cols)).astype(np.int8)
    ones = np.ones((rows, -(-cols // group)), BF16)
    np.testing.assert_array_equal(dequant_int4(pack_to_int32(values), ones, cols, group), values)


def _tiny_hf(tmp_path):
    cfg = config.replace(load_config("tiny"), **{"mtp.num_layers": 0})
    src = tmp_path / "hf"
    save_random_hf_model(cfg, src)
    return cfg, load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())


def _write(path, tensors, cfg_json):
    path.mkdir()
    keys = sorted(tensors)
    half = len(keys) // 2  # two shards, so the reader's multi-file indexing is exercised
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file({k: tensors[k] for k in keys[:half]}, str(path / names[0]), {"format": "pt"})
    save_file({k: tensors[k] for k in keys[half:]}, str(path / names[1]), {"format": "pt"})
    weight_map = {k: names[i >= half] for i, k in enumerate(keys)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg_json))
    return path


def _check_against_reference(tmp_path, quantized, reference_tensors, ref_config, prefix=""):
    """Convert `quantized`, export as float32, compare with `reference_tensors`; compare logits."""
    want = {k[len(prefix):]: v for k, v in reference_tensors.items() if k.startswith(prefix)}
    ref_dir = _write(tmp_path / "reference", want, ref_config)
    convert(quantized, tmp_path / "orbax", chunk_bytes=2048, params_of=abstract_params)  # small blocks: row ranges cut FP8 blocks
    export(tmp_path / "orbax", tmp_path / "exported", params_of=abstract_params)
    exported = {}
    for f in (tmp_path / "exported").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    assert set(exported) == set(want)
    for key, value in want.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key

    from transformers import DeepseekV3ForCausalLM

    ref_model = DeepseekV3ForCausalLM.from_pretrained(ref_dir).float().eval()
    model = load_converted(tmp_path / "orbax")
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 40), dtype=np.int32)
    diff = np.abs(np.asarray(model(tokens)) - hf_logits(ref_model, tokens)).max()
    assert diff <= 1e-4, f"max |logit diff| = {diff:.2e}"
    return model


def test_kimi_k25_int4_checkpoint(tmp_path):
    """K2.5 layout: text_config wrapper, `language_model.` prefix, INT4 routed experts, a vision tower."""
    cfg, tensors, text = _tiny_hf(tmp_path)
    quantized, reference = {}, {}
    for key, w in tensors.items():
        full = "language_model." + key
        if ".mlp.experts." in key:
            packed, scale = pack_int4(w)
            stem = full  # `...experts.{j}.gate_proj.weight` + `_packed` / `_scale` / `_shape`
            quantized.update({stem + "_packed": packed, stem + "_scale": scale,
                              stem + "_shape": np.array(w.shape, np.int32)})
            reference[full] = ref_dequant_int4(packed, scale, w.shape)
            assert np.abs(reference[full] - w).max() > 0  # quantization really changed the weights
        else:
            quantized[full] = reference[full] = w
    vision = {"vision_tower.patch_embed.proj.weight": np.random.default_rng(1).normal(size=(8, 3, 2, 2)).astype(BF16),
              "mm_projector.proj.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}
    quantized.update(vision)
    wrapper = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
               "text_config": {**text, "quantization_config": INT4_CONFIG}, "quantization_config": INT4_CONFIG,
               "vision_config": {}}
    src = _write(tmp_path / "k25", quantized, wrapper)
    model = _check_against_reference(tmp_path, src, reference, text, prefix="language_model.")

    side = load_file(str(tmp_path / "orbax" / SIDE_FILE))  # vision tower kept aside, bit for bit
    assert set(side) == set(vision) and all(side[k].tobytes() == vision[k].tobytes() for k in vision)
    # from_pretrained reads the same checkpoint through the same dequantizing reader.
    direct = from_pretrained(src)
    np.testing.assert_array_equal(np.asarray(direct.moe_layers.mlp.down_proj[...]),
                                  np.asarray(model.moe_layers.mlp.down_proj[...]))


def test_deepseek_fp8_block_checkpoint(tmp_path):
    """FP8 e4m3 linear weights (attention, dense MLP, shared and routed experts) with block scales."""
    cfg, tensors, text = _tiny_hf(tmp_path)
    quantized, reference = {}, {}
    for key, w in tensors.items():
        linear = w.ndim == 2 and not key.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))
        if linear:
            q, scale_inv = quant_fp8(w)
            quantized.update({key: q, key + "_scale_inv": scale_inv})
            reference[key] = ref_dequant_fp8(q, scale_inv)
        else:
            quantized[key] = reference[key] = w
    src = _write(tmp_path / "fp8", quantized, {**text, "quantization_config": FP8_CONFIG})
    _check_against_reference(tmp_path, src, reference, text)


def test_row_ranges_match_whole_reads(tmp_path):
    """Any row range equals the same rows of a whole read, which equals the reference; 20 inputs leave
    partial FP8 blocks, a partial packed int32 and a partial INT4 group."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(40, 20)).astype(np.float32)
    q, s = quant_fp8(w)
    packed, scale = pack_int4(w)
    for name in ("fp8", "int4"):
        (tmp_path / name).mkdir()
    save_file({"a.weight": q, "a.weight_scale_inv": s}, str(tmp_path / "fp8" / "m.safetensors"))
    fp8 = TensorReader(SafetensorsDir(tmp_path / "fp8"), QuantConfig("fp8", block=FP8_BLOCK))
    save_file({"b.weight_packed": packed, "b.weight_scale": scale, "b.weight_shape": np.array([40, 20], np.int32)},
              str(tmp_path / "int4" / "m.safetensors"))
    int4 = TensorReader(SafetensorsDir(tmp_path / "int4"), QuantConfig("int4", group_size=32))
    for reader, key, ref in ((fp8, "a.weight", ref_dequant_fp8(q, s)),
                             (int4, "b.weight", ref_dequant_int4(packed, scale, w.shape))):
        whole = reader.read(key)
        np.testing.assert_array_equal(whole, ref)
        for r0, r1 in ((0, 40), (3, 17), (15, 16), (16, 40), (39, 40)):
            np.testing.assert_array_equal(reader.read(key, (r0, r1)), whole[r0:r1])


@pytest.mark.parametrize("case, match", [
    ("no_scale", r"INT4 weight 'x\.weight' lacks tensor\(s\) 'x\.weight_scale'"),
    ("no_config", r"'x\.weight_packed' is INT4-packed but config\.json has no compressed-tensors"),
    ("fp8_no_scale", r"FP8 tensor 'y\.weight' has no 'y\.weight_scale_inv'"),
    ("bad_scale_shape", r"'y\.weight_scale_inv' has shape \[1, 1\], expected \[2, 3\]"),
    ("orphan_scale", r"quantization tensor 'z\.weight_scale_inv' has no matching quantized weight"),
])
def test_bad_quantized_tensors_are_named(tmp_path, case, match):
    w = np.ones((32, 24), np.float32)
    packed, scale = pack_int4(w)
    q, s = quant_fp8(w)
    tensors, quant = {
        "no_scale": ({"x.weight_packed": packed, "x.weight_shape": np.array([32, 24], np.int32)}, "int4"),
        "no_config": ({"x.weight_packed": packed, "x.weight_scale": scale,
                       "x.weight_shape": np.array([32, 24], np.int32)}, None),
        "fp8_no_scale": ({"y.weight": q}, "fp8"),
        "bad_scale_shape": ({"y.weight": q, "y.weight_scale_inv": s[:1, :1].copy()}, "fp8"),
        "orphan_scale": ({"z.weight": w, "z.weight_scale_inv": s}, "fp8"),
    }[case]
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        TensorReader(SafetensorsDir(tmp_path), QuantConfig(quant, block=FP8_BLOCK))


def test_unsupported_quantization_configs():
    where = "x/config.json"
    with pytest.raises(CheckpointError, match=r"num_bits=8 is not supported"):
        bad = json.loads(json.dumps(INT4_CONFIG))
        bad["config_groups"]["group_0"]["weights"]["num_bits"] = 8
        QuantConfig.from_hf({"quantization_config": bad}, where)
    with pytest.raises(CheckpointError, match=r"quant_method='awq' is not supported"):
        QuantConfig.from_hf({"quantization_config": {"quant_method": "awq"}}, where)
    with pytest.raises(CheckpointError, match=r"weight_block_size=None"):
        QuantConfig.from_hf({"quantization_config": {"quant_method": "fp8"}}, where)
    assert QuantConfig.from_hf({"quantization_config": INT4_CONFIG}, where) == QuantConfig("int4", 32)
    assert QuantConfig.from_hf({"quantization_config": FP8_CONFIG}, where).block == FP8_BLOCK
