"""CPU capability dispatch (pagedmoe/cpu_info.py): every machine's path driven here through PAGEDMOE_CPU_FLAGS."""
import json
import logging
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams, cpu_info
from pagedmoe.config import EngineConfig
from pagedmoe.cpu_info import FLAGS_ENV, can_prepack_bf16, cpu_flags, describe_cpu, has_native_bf16
from pagedmoe.layers import linear
from pagedmoe.layers.linear import Linear

AVX2_ONLY = "avx avx2 fma f16c bmi1 bmi2 abm movbe"  # AMD EPYC Zen 2 / 3
AVX512_NO_BF16 = AVX2_ONLY + " avx512f avx512bw avx512vl avx512dq avx512cd"  # Skylake-SP, Cascade Lake
ZEN4 = AVX512_NO_BF16 + " avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " avx512_fp16 amx_tile amx_bf16"
SIERRA_FOREST = AVX2_ONLY + " avx_vnni avx_vnni_int8 avx_ne_convert"  # AVX2 with bf16 conversions
MACHINES = {"avx2": (AVX2_ONLY, False, False), "avx512": (AVX512_NO_BF16, False, True), "zen4": (ZEN4, True, True),
            "spr": (SAPPHIRE_RAPIDS, True, True), "srf": (SIERRA_FOREST, True, True)}
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 12, 40, 41, 42, 43]]


@pytest.fixture(autouse=True)
def fresh_detection():
    cpu_info.detected_cpu_flags.cache_clear()
    cpu_info._compute_dtype.cache_clear()
    yield
    cpu_info.detected_cpu_flags.cache_clear()


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Qwen3 saved in bfloat16, and the same weights as an HF float32 model."""
    path = tmp_path_factory.mktemp("qwen3-bf16")
    model = save_random_model(tiny_dense_config("qwen3"), path)
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path), model.float()


@pytest.mark.parametrize("machine", list(MACHINES))
def test_predicates_on_each_machine(monkeypatch, machine):
    flags, native, prepack = MACHINES[machine]
    monkeypatch.setenv(FLAGS_ENV, flags)
    monkeypatch.setattr(cpu_info, "_torch_can_prepack_bf16", lambda: True)
    assert has_native_bf16() == native and can_prepack_bf16() == prepack
    assert cpu_info.bf16_is_emulated() == (cpu_info.is_x86() and not native)


@pytest.mark.parametrize("vendor, tuned", [("GenuineIntel", True), ("AuthenticAMD", False), ("HygonGenuine", False)])
def test_blas_is_tuned_on_intel_only(monkeypatch, vendor, tuned):
    """MKL's tuned GEMMs are Intel's; PAGEDMOE_CPU_VENDOR stands in for /proc/cpuinfo's vendor_id. Off x86
    torch's BLAS is another library, taken as tuned."""
    monkeypatch.setenv(cpu_info.VENDOR_ENV, vendor)
    assert cpu_info.cpu_vendor() == vendor and cpu_info.blas_is_tuned() == (tuned or not cpu_info.is_x86())
    monkeypatch.setattr(cpu_info.platform, "machine", lambda: "aarch64")
    assert cpu_info.blas_is_tuned()


def test_forced_flags_take_prepacking_away_never_grant_it(monkeypatch):
    monkeypatch.setenv(FLAGS_ENV, SAPPHIRE_RAPIDS)
    monkeypatch.setattr(cpu_info, "_torch_can_prepack_bf16", lambda: False)
    assert has_native_bf16() and not can_prepack_bf16()


def test_override_replaces_the_detected_flags(monkeypatch):
    monkeypatch.setenv(FLAGS_ENV, "AVX2, fma  avx512f")
    assert cpu_flags() == {"avx2", "fma", "avx512f"}
    assert cpu_info.detected_cpu_flags() != cpu_flags()  # what built code may execute stays the real set
    monkeypatch.setenv(FLAGS_ENV, "")
    assert cpu_flags() == frozenset() and not has_native_bf16()


@pytest.mark.skipif(not cpu_info.is_x86(), reason="reads x86 cpuid flags")
def test_detected_flags_agree_with_torch(monkeypatch):
    monkeypatch.delenv(FLAGS_ENV, raising=False)
    flags = cpu_info.detected_cpu_flags()
    assert set(cpu_info.CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ())) <= flags
    if hasattr(torch.cpu, "_is_avx512_bf16_supported"):
        assert torch.cpu._is_avx512_bf16_supported() == ("avx512_bf16" in flags)
    assert can_prepack_bf16() == cpu_info._torch_can_prepack_bf16()


def test_not_x86_has_no_x86_flags(monkeypatch):
    monkeypatch.delenv(FLAGS_ENV, raising=False)
    monkeypatch.setattr(cpu_info.platform, "machine", lambda: "aarch64")
    assert cpu_info.detected_cpu_flags() == frozenset()
    assert not has_native_bf16() and not can_prepack_bf16()
    assert "no x86 extensions (aarch64)" in describe_cpu()


def test_without_proc_cpuinfo_torch_capability_decides(monkeypatch):
    monkeypatch.delenv(FLAGS_ENV, raising=False)
    monkeypatch.setattr(cpu_info.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(cpu_info, "_proc_cpuinfo", lambda: {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_info.detected_cpu_flags() == {"avx", "avx2", "fma"}
    assert not can_prepack_bf16() and cpu_info.cpu_model_name()


def test_describe_cpu_names_the_model_and_the_isa(monkeypatch):
    monkeypatch.setenv(FLAGS_ENV, SAPPHIRE_RAPIDS)
    line = describe_cpu()
    assert line.startswith(cpu_info.cpu_model_name()) and "amx_bf16" in line and "avx512_bf16" in line
    assert f"from {FLAGS_ENV}" in line and "\n" not in line


@pytest.mark.parametrize("machine,expected", [("avx2", torch.float32), ("avx512", torch.float32),
                                              ("zen4", torch.bfloat16), ("spr", torch.bfloat16),
                                              ("srf", torch.bfloat16)])
def test_auto_dtype_of_a_bf16_checkpoint(bf16_checkpoint, monkeypatch, machine, expected):
    assert json.loads((Path(bf16_checkpoint[0]) / "config.json").read_text())["dtype"] == "bfloat16"
    monkeypatch.setenv(FLAGS_ENV, MACHINES[machine][0])
    assert EngineConfig(bf16_checkpoint[0]).torch_dtype == expected


def test_auto_float32_says_so_once(bf16_checkpoint, monkeypatch, caplog):
    monkeypatch.setenv(FLAGS_ENV, AVX2_ONLY)
    config = EngineConfig(bf16_checkpoint[0])
    with caplog.at_level(logging.INFO, logger="pagedmoe.cpu_info"):
        assert all(config.torch_dtype == torch.float32 for _ in range(5))
        assert EngineConfig(bf16_checkpoint[0]).torch_dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records if "computed in float32" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("bfloat16 checkpoint computed in float32: this CPU (") and "avx2" in lines[0]
    assert lines[0].endswith("has no native bf16 arithmetic; pass --dtype bfloat16 to force it")


def test_auto_dtype_of_other_checkpoints_and_devices(bf16_checkpoint, monkeypatch):
    monkeypatch.setenv(FLAGS_ENV, AVX2_ONLY)
    config = EngineConfig(bf16_checkpoint[0])
    config.hf_config.dtype = "float16"
    assert config.torch_dtype == torch.float32
    config.hf_config.dtype = torch.float32
    assert config.torch_dtype == torch.float32
    assert EngineConfig(bf16_checkpoint[0], dtype="bfloat16").torch_dtype == torch.bfloat16
    assert EngineConfig(bf16_checkpoint[0], device="cuda").torch_dtype == torch.bfloat16
    monkeypatch.setenv(FLAGS_ENV, SAPPHIRE_RAPIDS)
    config.hf_config.dtype = torch.float16
    assert config.torch_dtype == torch.float16


def linear_layers(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]


def greedy(llm: LLM, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_auto_bf16_checkpoint_on_avx2_runs_packed_float32_and_matches_hf(bf16_checkpoint, monkeypatch):
    monkeypatch.setenv(FLAGS_ENV, AVX2_ONLY)
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    path, model = bf16_checkpoint
    llm = LLM(path, skip_tokenizer_init=True)
    assert next(llm.engine.runner.model.parameters()).dtype == torch.float32
    if torch.backends.mkldnn.is_available():  # oneDNN's packed copy, or the tile kernel's, which replaces it
        assert all(layer.packed_weight is not None or layer.cpu_kernel is not None for layer in linear_layers(llm))
    assert greedy(llm) == [hf_greedy(model, p, 12) for p in PROMPTS]


def test_explicit_bf16_on_avx2_is_unpacked_and_matches_the_exact_path(bf16_checkpoint, monkeypatch):
    """Where oneDNN would refuse bf16 weights at load, --dtype bfloat16 still loads and runs: its linears on the
    tile kernel, which widens bf16 to float32 (no oneDNN pack), with the unpacked F.linear path's tokens."""
    monkeypatch.setenv(FLAGS_ENV, AVX2_ONLY)
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    path, _ = bf16_checkpoint
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True)
    assert next(llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    assert linear_layers(llm) and all(layer.packed_weight is None for layer in linear_layers(llm))
    assert any(layer.cpu_kernel is not None for layer in linear_layers(llm))
    exact = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, prepack_weights=False)
    assert greedy(llm) == greedy(exact)
