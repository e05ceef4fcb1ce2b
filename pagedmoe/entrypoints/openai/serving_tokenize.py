"""/tokenize and /detokenize with the server's tokenizer and chat template."""
from pagedmoe.entrypoints.openai.errors import APIError
from pagedmoe.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedmoe.entrypoints.openai.serving import ServingContext


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> dict:
    ctx.check_model(body.model)
    if body.messages is not None:
        prompt = ctx.chat_prompt(body.messages, body.add_generation_prompt)
    elif body.prompt is not None:
        prompt = ctx.text_prompt(body.prompt, body.add_special_tokens)
    else:
        raise APIError(400, "prompt or messages is required", param="prompt", code="invalid_value")
    ids = prompt["prompt_token_ids"]
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.client.max_model_len}


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict:
    ctx.check_model(body.model)
    vocab = len(ctx.tokenizer)
    if any(not 0 <= token < vocab for token in body.tokens):
        raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens", code="invalid_value")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
