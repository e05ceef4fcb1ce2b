import os

from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams

PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further,", "KING RICHARD III:\nNow is the",
           "JULIET:\nO Romeo, Romeo!"]


def run_demo(model_dir: str):
    """Offline generation on the bundled model; a tiny random-weight checkpoint stands in if it is absent."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return _random_weights_demo()
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=80, seed=0)
    for output in llm.generate(PROMPTS, params):
        print(f"\n=== {output.prompt!r}\n{output.prompt}{output.outputs[0].text}")
    print(f"\nstats: {llm.engine.get_stats()}")


def _random_weights_demo():
    import tempfile

    import torch
    import transformers
    path = os.path.join(tempfile.gettempdir(), "pagedmoe-random-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        transformers.Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    print("RANDOM WEIGHTS: no bundled model found; running a tiny random checkpoint (token ids in and out)")
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": list(range(1, n))} for n in (5, 17, 40)]
    for output in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)):
        print(output.prompt_token_ids, "->", output.outputs[0].token_ids)
