"""SamplingParams.output_kind: what each RequestOutput that LLMEngine.step returns holds, for a consumer that
streams. CUMULATIVE: everything so far; DELTA: only what is new since the request's last output (its
prompt_logprobs in the first one only); FINAL_ONLY: one output, when the request finishes."""
import dataclasses

from pagedmoe.engine.sequence import Request
from pagedmoe.outputs import CompletionOutput, RequestOutput
from pagedmoe.sampling_params import RequestOutputKind


def wants_output(request: Request) -> bool:
    return request.params.output_kind != RequestOutputKind.FINAL_ONLY or request.is_finished


def as_output_kind(request: Request, output: RequestOutput) -> RequestOutput:
    if request.params.output_kind != RequestOutputKind.DELTA:
        return output
    first = not request.num_sent
    outputs = [_delta(request.num_sent, o) for o in output.outputs]
    return dataclasses.replace(output, outputs=outputs, prompt_logprobs=output.prompt_logprobs if first else None)


def _delta(num_sent: dict[int, tuple[int, int, int]], out: CompletionOutput) -> CompletionOutput:
    """The tokens, text and logprobs of out past those already sent for its index."""
    num_tokens, num_chars, num_logprobs = num_sent.get(out.index, (0, 0, 0))
    num_sent[out.index] = (len(out.token_ids), len(out.text), len(out.logprobs or []))
    logprobs = out.logprobs[num_logprobs:] if out.logprobs is not None else None
    return dataclasses.replace(out, token_ids=out.token_ids[num_tokens:], text=out.text[num_chars:],
                               logprobs=logprobs)
