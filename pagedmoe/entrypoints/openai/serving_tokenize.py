"""/tokenize and /detokenize with the server's tokenizer and chat template. Inputs may be megabytes,
so the tokenizer and the JSON rendering of the answer run off the event loop."""
import asyncio

from fastapi.responses import JSONResponse

from pagedmoe.entrypoints.openai.errors import APIError
from pagedmoe.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedmoe.entrypoints.openai.serving import ServingContext


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> JSONResponse:
    ctx.check_model(body.model)
    if body.messages is not None:
        prompt = await ctx.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
    elif body.prompt is not None:
        prompt = await ctx.text_prompt(body.prompt, body.add_special_tokens)
    else:
        raise APIError(400, "prompt or messages is required", param="prompt", code="invalid_value")
    ids = prompt["prompt_token_ids"]
    return await _json_off_loop({"tokens": ids, "count": len(ids), "max_model_len": ctx.client.max_model_len})


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> JSONResponse:
    ctx.check_model(body.model)
    tokenizer = ctx.tokenizer
    vocab = len(tokenizer)
    if not await asyncio.to_thread(_all_in_range, body.tokens, vocab):
        raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens", code="invalid_value")
    return await _json_off_loop({"prompt": await ctx.in_tokenizer_thread(tokenizer.decode, body.tokens)})


def _all_in_range(tokens: list[int], vocab: int) -> bool:
    return all(0 <= token < vocab for token in tokens)


async def _json_off_loop(content: dict) -> JSONResponse:
    """A JSONResponse renders its body when built; FastAPI's own encoder would walk every id on the loop."""
    return await asyncio.to_thread(JSONResponse, content)
