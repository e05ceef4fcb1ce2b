import pytest
import torch

from conftest import assert_all_blocks_free, hf_greedy, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams
from pagedmoe.entrypoints.cli import main as cli_main

PROMPTS = ["ROMEO: But soft", "JULIET: O Romeo, Romeo, wherefore", "Deny thy father"]


def test_text_generate_in_order_with_metrics(text_model):
    path, model, tokenizer = text_model
    llm = LLM(path, dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=True)
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(model, ids, 12)
        assert isinstance(out.outputs[0].text, str)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert_all_blocks_free(llm.engine)


def test_incremental_detokenization_matches_decode(text_model):
    from conftest import TEXT
    from pagedmoe.engine.detokenizer import Detokenizer
    from pagedmoe.engine.sequence import Request, Sequence
    tokenizer = text_model[2]
    prompt, completion = "ROMEO: But", " soft, what light through yonder window breaks? Juliet is the sun."
    prompt_ids, ids = tokenizer(prompt).input_ids, tokenizer(prompt + completion).input_ids
    seq = Sequence(0, Request("r", prompt, prompt_ids, SamplingParams()), list(prompt_ids))
    detokenizer = Detokenizer(tokenizer)
    for token_id in ids[len(prompt_ids):]:
        seq.token_ids.append(token_id)
        detokenizer.append(seq, token_id)
    assert prompt + seq.output_text == prompt + completion


def test_stop_strings_truncate_text(text_model):
    llm = LLM(text_model[0], dtype="float32")
    full = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[5:7]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)
    cut = out[0].outputs[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                   include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == full[:full.index(stop) + len(stop)]


def test_chat_uses_template(text_model):
    path, _, tokenizer = text_model
    llm = LLM(path, dtype="float32")
    messages = [{"role": "user", "content": "wherefore art thou"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.prompt == "user: wherefore art thou\nassistant:"
    assert out.prompt_token_ids == tokenizer(out.prompt, add_special_tokens=False).input_ids


def test_bfloat16_and_sharded_checkpoint(tmp_path):
    model = save_random_model(tiny_dense_config("llama"), tmp_path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sharded = LLM(str(tmp_path / "sharded"), dtype="float32", skip_tokenizer_init=True)
    assert sharded.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(
        model, prompt["prompt_token_ids"], 8)
    bf16 = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True)
    assert next(bf16.engine.runner.model.parameters()).dtype == torch.bfloat16
    assert bf16.engine.runner.kv_cache.device_cache.dtype == torch.bfloat16
    assert len(bf16.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_cli_generate(text_model, capsys):
    cli_main(["generate", "--model", text_model[0], "--prompt", "ROMEO:", "--max-tokens", "6", "--dtype",
              "float32", "--temperature", "0"])
    assert "ROMEO:" in capsys.readouterr().out


@pytest.mark.parametrize("dtype,kernel", [("bfloat16", True), ("bfloat16", False), ("float16", True)])
def test_16_bit_decode_logprobs_track_float32_reference(tmp_path, dtype, kernel):
    """16-bit paths against HF in float32: bf16 through the CPU decode kernel or the PyTorch path (packed
    bf16 weights, 16-bit KV gathers, chunked decode attention); float16, which the kernel leaves to PyTorch."""
    model = save_random_model(tiny_dense_config("qwen3"), tmp_path)
    prompts = [[5 + i, 6, 7, 8, 9 + i] * (2 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(str(tmp_path), dtype=dtype, skip_tokenizer_init=True, cpu_attention_kernel=kernel)
    assert (llm.engine.runner.decode_kernel is not None) == (dtype == "bfloat16" and kernel)
    errors = []
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
        errors += [abs(entry[token].logprob - ref[len(prompt) - 1 + i, token].item())
                   for i, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs))]
    # bf16 keeps ~3 significant digits: single tokens of this random model drift by up to ~0.1 (0.106 through
    # the kernel on an AVX2 EPYC, 0.071 through PyTorch), the mean by ~0.02; a broken path drifts by whole units
    assert max(errors) < 0.15 and sum(errors) / len(errors) < 0.04
