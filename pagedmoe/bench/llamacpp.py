"""llama.cpp baseline: llama-cpp-python (an optional extra) on a GGUF conversion of the same checkpoint.

llama-cpp-python's `Llama` runs one sequence at a time, so requests go one after another (greedy,
exactly output_len tokens each), like hf-sequential. The GGUF is `--gguf PATH` if given, else written next
to a temporary copy by `convert_to_gguf` (dense Llama / Qwen2 / Qwen3, weights in the run's dtype, no
tokenizer: the bench feeds token ids). Other architectures: convert with llama.cpp's convert_hf_to_gguf.py
and pass --gguf."""
import importlib.util
import math
import os
import tempfile
import time

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

from pagedmoe.bench.baselines import figures
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.worker.model_loader import weight_files

INSTALL_HINT = ("the llama.cpp baseline needs llama-cpp-python, an optional extra that is not installed: "
                "`pip install llama-cpp-python gguf` (it compiles llama.cpp from source, several minutes; "
                "set CMAKE_ARGS, e.g. -DGGML_CUDA=on, for a GPU build)")
ROPE_FREQS = "rope_freqs.weight"  # GGUF's own name: not an HF tensor
ARCHS = {"LlamaForCausalLM": "LLAMA", "Qwen2ForCausalLM": "QWEN2", "Qwen3ForCausalLM": "QWEN3"}


def check_llama_cpp():
    """Fails early when the extra is missing, without loading llama.cpp's native library (and its threads)
    into the process before pagedmoe's own run."""
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError(INSTALL_HINT)


def require_llama_cpp():
    try:
        import gguf  # noqa: F401  (the converter's writer)
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    return llama_cpp


def llama_cpp_baseline(model_dir: str, workload: list[BenchRequest], args) -> dict:
    llama_cpp = require_llama_cpp()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = args.gguf or convert_to_gguf(model_dir, os.path.join(tmp, "model.gguf"), args.dtype)
        n_ctx = max(len(r.prompt_token_ids) + r.output_len for r in workload)
        llm = llama_cpp.Llama(gguf_path, n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_threads=torch.get_num_threads(),
                              n_gpu_layers=-1 if args.device.startswith("cuda") else 0, verbose=False)
        start = time.perf_counter()
        generated = [greedy_tokens(llm, r) for r in tqdm(workload, desc="llama.cpp")]
        elapsed = time.perf_counter() - start
    return figures("llama.cpp", workload, elapsed, generated) | {"gguf": args.gguf or "converted"}


def greedy_tokens(llm, req: BenchRequest) -> int:
    """Feeds the prompt, then takes argmax tokens until output_len of them (no EOS in a no-vocab GGUF)."""
    llm.reset()
    count = 0
    for _ in llm.generate(req.prompt_token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                          reset=True):
        count += 1
        if count == req.output_len:
            break
    return count


def convert_to_gguf(model_dir: str, path: str, dtype: str = "float32") -> str:
    """A minimal HF -> GGUF writer for dense Llama / Qwen2 / Qwen3 with a no-vocab tokenizer section."""
    import gguf
    config = AutoConfig.from_pretrained(model_dir)
    arch = next((ARCHS[a] for a in config.architectures or [] if a in ARCHS), None)
    if arch is None:
        raise RuntimeError(f"llama.cpp: no built-in GGUF conversion for {config.architectures}; convert with "
                           "llama.cpp's convert_hf_to_gguf.py and pass --gguf PATH")
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
    _write_hparams(writer, config)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), config.num_hidden_layers)
    float_type = torch.float16 if dtype in ("float16", "half", "bfloat16") else torch.float32
    for name, tensor in _hf_tensors(model_dir, config, arch):
        gguf_name = name if name == ROPE_FREQS else names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise RuntimeError(f"llama.cpp conversion: no GGUF name for {name}")
        keep_f32 = tensor.dim() == 1  # norms and biases stay float32, as llama.cpp's converter keeps them
        writer.add_tensor(gguf_name, tensor.to(torch.float32 if keep_f32 else float_type).numpy())
    _finish(writer)
    return path


def _write_hparams(writer, config):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope(config).get("rope_theta", 10000.0))
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("none")


def _rope(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _hf_tensors(model_dir: str, config, arch: str):
    """(HF name, tensor) pairs as llama.cpp expects them: Llama q/k rows permuted back to interleaved rope,
    the tied LM head written out, llama3 rope scaling as a rope_freqs tensor."""
    seen = set()
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                seen.add(name)
                yield name, _permuted(f.get_tensor(name), name, config, arch)
    if "lm_head.weight" not in seen:
        with safe_open(_file_of(model_dir, "model.embed_tokens.weight"), framework="pt") as f:
            yield "lm_head.weight", f.get_tensor("model.embed_tokens.weight")
    if _rope(config).get("rope_type") == "llama3":
        yield ROPE_FREQS, llama3_rope_factors(config)


def _permuted(tensor: torch.Tensor, name: str, config, arch: str) -> torch.Tensor:
    if arch != "LLAMA" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return tensor
    heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
    return tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(
        tensor.shape)


def _file_of(model_dir: str, tensor_name: str) -> str:
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt") as f:
            if tensor_name in f.keys():
                return file
    raise RuntimeError(f"llama.cpp conversion: {tensor_name} not in {model_dir}")


def llama3_rope_factors(config) -> torch.Tensor:
    """Per-frequency divisors of llama3 rope scaling, as llama.cpp's converter computes them."""
    rope = _rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        smooth = (old_len / wavelen - low) / (high - low)
        factors.append(1.0 if wavelen < old_len / high else factor if wavelen > old_len / low
                       else 1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _finish(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
