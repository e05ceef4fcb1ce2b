"""The MXFP4, NVFP4 and FP8-block formats byte by byte: hand-made tensors decode to the values their producers
define, the encoders round as those producers do, and bad scales are refused with the tensor's name."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedmoe.layers.quantization.config import QuantizationConfig, read_quantization_config
from pagedmoe.layers.quantization.fp4 import E2M1_VALUES, encode_e2m1, pack_fp4, unpack_fp4
from pagedmoe.layers.quantization.fp8 import check_fp8, dequantize_fp8, quantize_fp8
from pagedmoe.layers.quantization.mxfp4 import check_mxfp4, dequantize_mxfp4, quantize_mxfp4
from pagedmoe.layers.quantization.nvfp4 import check_nvfp4, dequantize_nvfp4, quantize_nvfp4


def test_e2m1_codes_low_nibble_first():
    assert unpack_fp4(torch.tensor([0x72, 0xF8], dtype=torch.uint8)).tolist() == [1.0, 6.0, -0.0, -6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), torch.tensor(E2M1_VALUES))


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 100.0, -0.74, -7.0])
    assert unpack_fp4(pack_fp4(encode_e2m1(x))).tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5,
                                                             -6.0]


def test_mxfp4_scale_is_a_power_of_two_per_32():
    blocks = torch.zeros(2, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[1, 15] = 0x72, 0x1A  # elements 0, 1 of block 0; elements 30, 31 of block 1
    values = dequantize_mxfp4(blocks, torch.tensor([128, 125], dtype=torch.uint8))
    assert values[:2].tolist() == [2.0, 12.0] and values[62:].tolist() == [-0.25, 0.125]
    assert values.count_nonzero() == 4


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), spread=st.floats(1e-3, 1e3), seed=st.integers(0, 99))
def test_mxfp4_round_trip_is_within_half_a_step_and_stable(rows, groups, spread, seed):
    w = torch.randn(rows, groups * 32, generator=torch.Generator().manual_seed(seed)) * spread
    blocks, scales = quantize_mxfp4(w)
    decoded = dequantize_mxfp4(blocks, scales)
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, -1)  # grid step <= 2
    assert bool(((decoded - w).abs() <= step + 1e-30).all())
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(decoded)), decoded)


def test_nvfp4_multiplies_block_and_tensor_scales():
    weight = torch.full((1, 8), 0x72, dtype=torch.uint8)  # 16 elements: 1.0, 6.0 repeated
    scale = torch.tensor([[0.5]]).to(torch.float8_e4m3fn)
    values = dequantize_nvfp4(weight, scale, torch.tensor(3.0))
    assert values.tolist() == [[1.5, 9.0] * 8]


def test_nvfp4_round_trip_is_close_as_modelopt_rounds():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q = quantize_nvfp4(w)
    assert q["weight"].shape == (8, 32) and q["weight_scale"].dtype == torch.float8_e4m3fn
    decoded = dequantize_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])
    block_amax = w.view(8, 4, 16).abs().amax(-1, keepdim=True)
    assert bool(((decoded - w).view(8, 4, 16).abs() <= block_amax / 6 * 1.1).all())


def test_fp8_blocks_are_128_square_with_ragged_edges():
    weight = torch.ones(576, 200).to(torch.float8_e4m3fn)
    scale_inv = torch.arange(1.0, 11.0).view(5, 2)
    values = dequantize_fp8(weight, scale_inv)
    assert values[0, 0] == 1 and values[127, 128] == 2 and values[575, 199] == 10 and values[512, 0] == 9
    q, s = quantize_fp8(torch.randn(576, 200))
    assert s.shape == (5, 2) and q.dtype == torch.float8_e4m3fn


def test_bad_scales_are_refused_with_the_tensor_name():
    blocks, scales = quantize_mxfp4(torch.randn(4, 64))
    scales[1, 0] = 255
    with pytest.raises(ValueError, match="experts.down_proj_scales.*NaN"):
        check_mxfp4("experts.down_proj", blocks, scales)
    q = quantize_nvfp4(torch.randn(4, 32))
    for bad in (None, torch.tensor(0.0), torch.tensor(float("nan")), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match="q_proj.weight_scale_2"):
            check_nvfp4("q_proj", q["weight"], q["weight_scale"], bad)
    with pytest.raises(ValueError, match="q_proj.weight_scale: non-finite"):
        check_nvfp4("q_proj", q["weight"], torch.full_like(q["weight_scale"], float("nan")), q["weight_scale_2"])
    weight, scale_inv = quantize_fp8(torch.randn(130, 8))
    for bad in (None, scale_inv * 0, scale_inv * float("inf")):
        with pytest.raises(ValueError, match="o_proj.weight_scale_inv"):
            check_fp8("o_proj", weight, bad)


class Config:
    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


def test_quantization_config_is_read_from_the_checkpoint(tmp_path):
    assert read_quantization_config(str(tmp_path), Config()) is None
    mxfp4 = read_quantization_config(str(tmp_path), Config({"quant_method": "mxfp4", "modules_to_not_convert":
                                                            ["model.layers.*.self_attn", "lm_head"]}))
    assert mxfp4.method == "mxfp4"
    assert mxfp4.is_excluded("model.layers.3.self_attn.q_proj") and mxfp4.is_excluded("layers.0.self_attn")
    assert not mxfp4.is_excluded("model.layers.3.mlp.experts")
    modelopt = {"quant_method": "modelopt", "quant_algo": "nvfp4", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 16}}}}
    assert read_quantization_config(str(tmp_path), Config(modelopt)) == QuantizationConfig("nvfp4", ("lm_head",))
    (tmp_path / "hf_quant_config.json").write_text(
        '{"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.mlp.gate"]}}')
    legacy = read_quantization_config(str(tmp_path), Config())
    assert legacy.method == "nvfp4" and legacy.is_excluded("model.layers.1.mlp.gate")


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size"),
])
def test_unsupported_quantization_configs_name_the_field(tmp_path, config, field):
    with pytest.raises(ValueError, match=field):
        read_quantization_config(str(tmp_path), Config(config))
