import dataclasses
import itertools
import time

from tqdm import tqdm

from pagedmoe.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedmoe.engine.llm_engine import LLMEngine, PromptType
from pagedmoe.metrics import Metric, engine_metrics
from pagedmoe.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                              RequestOutput)
from pagedmoe.pooling import pooled_embedding
from pagedmoe.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """vLLM's offline API: LLM(model=DIR, **engine_args).generate(prompts, sampling_params)."""

    def __init__(self, model: str, **engine_args):
        self.llm_engine = LLMEngine.from_engine_args(model, **engine_args)
        self._request_ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """pagedmoe's older name of llm_engine."""
        return self.llm_engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_ids.append(self._add(prompt, _final_only(p)))
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """As vLLM's: the template arguments go to the tokenizer's apply_chat_template. continue_final_message
        leaves the last (assistant) message open for the model to continue, with no generation prompt."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: set add_generation_prompt=False with it (both True)")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template (skip_tokenizer_init=True)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template_args = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, tools=tools,
                             **(chat_template_kwargs or {}))
        prompts = [tokenizer.apply_chat_template(c, tokenize=False, **template_args) for c in conversations]
        return self.generate([{"prompt": p, "prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids}
                              for p in prompts], sampling_params, use_tqdm)

    def beam_search(self, prompts: list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: the beams of each prompt are forks of one sequence sharing KV blocks. As vLLM's,
        each sequence's tokens and text hold the prompt and the output."""
        request_ids = [self._add(prompt, params) for prompt in _as_list(prompts)]
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + o.token_ids, o.cumulative_logprob,
                                                     self._prompt_text(out) + o.text, o.finish_reason)
                                  for o in out.outputs])
                for out in self._run(request_ids, use_tqdm)]

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None or self.get_tokenizer() is None:
            return out.prompt or ""
        return self.get_tokenizer().decode(out.prompt_token_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges as vLLM's metric objects, under vLLM's names (vllm:...)."""
        return engine_metrics(self.engine.get_stats(), {"model_name": self.engine.config.model})

    def embed(self, prompts: PromptType | list[PromptType], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """vLLM's default pooling of a decoder LM: each prompt's last final hidden state, L2-normalised."""
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                                       out.prompt_token_ids)
                for out in self.encode(prompts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)]

    def encode(self, prompts: PromptType | list[PromptType], truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """As embed, with the embedding as a tensor (outputs.data). The engine's KV pool is not used."""
        outputs = []
        for prompt in tqdm(_as_list(prompts), desc="Pooling prompts", disable=not use_tqdm):
            token_ids = self.engine.pooling_prompt(prompt, truncate_prompt_tokens)
            outputs.append(PoolingRequestOutput(str(next(self._request_ids)),
                                                PoolingOutput(pooled_embedding(self.engine.runner, token_ids)),
                                                token_ids))
        return outputs

    def _add(self, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> str:
        request_id = str(next(self._request_ids))
        self.engine.add_request(request_id, prompt, params)
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        start, num_tokens = time.perf_counter(), 0
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        num_tokens += sum(len(o.token_ids) for o in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {num_tokens / (time.perf_counter() - start):.1f} tok/s")
        return [finished[request_id] for request_id in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    """As vLLM's LLM.generate: only each request's final output is wanted, whatever the params say."""
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)
