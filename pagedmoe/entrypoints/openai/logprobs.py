"""Engine logprobs ({token_id: Logprob} per position) in the completions and chat formats."""
from pagedmoe.outputs import Logprob

MIN_LOGPROB = -9999.0  # JSON has no -inf


def completion_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], text_offset: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        token = _text(entry[token_id], token_id)
        tokens.append(token)
        token_logprobs.append(_value(entry[token_id]))
        top_logprobs.append(_top_by_text(entry))
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _top_by_text(entry: dict[int, Logprob]) -> dict[str, float]:
    """Several ids can decode to the same text (e.g. partial UTF-8 as U+FFFD): keep the likeliest."""
    top = {}
    for token_id, logprob in _by_rank(entry):
        top.setdefault(_text(logprob, token_id), _value(logprob))
    return top


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], num_top: int) -> dict:
    content = [{**_chat_token(entry[token_id], token_id),
                "top_logprobs": [_chat_token(lp, tid) for tid, lp in _by_rank(entry) if lp.rank <= num_top]}
               for token_id, entry in zip(token_ids, entries)]
    return {"content": content}


def _chat_token(logprob: Logprob, token_id: int) -> dict:
    token = _text(logprob, token_id)
    return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode())}


def _by_rank(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: item[1].rank or 0)


def _text(logprob: Logprob, token_id: int) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_LOGPROB)


def echo_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int], first_token: str) -> dict:
    """The prompt's logprobs for echo; its first token has none (nothing precedes it)."""
    rest = completion_logprobs(entries[1:], token_ids[1:], len(first_token))
    return {"tokens": [first_token] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def joined_logprobs(prompt: dict | None, output: dict) -> dict:
    if prompt is None:
        return output
    return {key: prompt[key] + output[key] for key in output}


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: logprob, rank, decoded_token}."""
    if entries is None:
        return None
    return [None if entry is None else {str(token_id): {"logprob": _value(logprob), "rank": logprob.rank,
                                                        "decoded_token": logprob.decoded_token}
                                        for token_id, logprob in entry.items()}
            for entry in entries]
