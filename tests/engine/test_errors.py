import os

import pytest
from safetensors.torch import save_file

from conftest import assert_all_blocks_free, make_prompts
from pagedmoe import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model[0], dtype="float32", max_model_len=128)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(n=0), "n"), (dict(min_tokens=9, max_tokens=3), "min_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_and_engine_keeps_serving(llm):
    good = {"prompt_token_ids": make_prompts(1)[0]}
    params = SamplingParams(temperature=0, max_tokens=4)
    for bad, message in [("", "empty"), ({"prompt_token_ids": []}, "empty"),
                         ({"prompt_token_ids": [1] * 200}, "max_model_len"),
                         ({"prompt_token_ids": [10**6]}, "prompt_token_ids")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, bad], params, use_tqdm=False)
    engine = llm.engine
    engine.add_request("ok", good, params)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("ok", good, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "ok" and outputs[-1].finished
    assert_all_blocks_free(engine)


def test_request_larger_than_pool_is_rejected(text_model):
    llm = LLM(text_model[0], dtype="float32", num_kv_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=10), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=10, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10
    assert_all_blocks_free(llm.engine)


def test_missing_model_dir_and_pickled_weights(tmp_path, text_model):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "pickled"
    bad.mkdir()
    with open(os.path.join(text_model[0], "config.json")) as f:
        (bad / "config.json").write_text(f.read())
    (bad / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(bad), skip_tokenizer_init=True)
    save_file({"model.embed_tokens.weight": __import__("torch").zeros(3, 3)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(bad), skip_tokenizer_init=True)


def test_unknown_engine_argument(text_model):
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(text_model[0], max_num_sequences=3)
