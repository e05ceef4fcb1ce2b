"""The token-id parameters of a request checked against the vocab, and bad_words turned into token ids."""
from pagedmoe.sampling_params import SamplingParams


def check_token_params(params: SamplingParams, vocab_size: int):
    for name in ("logit_bias", "allowed_token_ids"):
        ids = list(getattr(params, name) or [])
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {sorted(ids)[-1]}")


def bad_words_token_ids(params: SamplingParams, tokenizer) -> list[list[int]]:
    """As vLLM: each word as it tokenizes alone and after a space (its two likely spellings mid-text)."""
    if not params.bad_words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer (the engine has skip_tokenizer_init=True)")
    words = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in words:
                words.append(ids)
    return words
