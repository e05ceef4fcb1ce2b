"""The bundled default model: transformers loads it, and its greedy continuation equals pagedmoe's."""
import torch
import transformers

from conftest import assert_all_blocks_free
from pagedmoe import LLM, SamplingParams
from pagedmoe.entrypoints.cli import DEFAULT_MODEL

PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "JULIET:\nO Romeo,", "KING HENRY:\nNow"]


def test_default_model_greedy_matches_transformers():
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    llm = LLM(DEFAULT_MODEL, dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist()
        assert any(c.isalpha() for c in out.outputs[0].text)
    assert_all_blocks_free(llm.engine)
