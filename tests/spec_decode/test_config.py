import pytest

from pagedmoe.spec_decode.config import SpeculativeConfig, parse_speculative_config


def test_dict_and_json_as_vllm_spells_them():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 5, 5)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(config) is config


@pytest.mark.parametrize("value, match", [
    ("{not json", "not valid JSON"),
    ([1], "must be a dict"),
    ({"method": "ngram"}, "missing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs the draft's directory"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/dir"}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_configs_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(value)


def test_the_dataclass_validates_too():
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig("ngram", 2, prompt_lookup_min=0)
