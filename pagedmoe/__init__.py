from pagedmoe.beam_search import BeamSearchParams
from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from pagedmoe.inputs import TextPrompt, TokensPrompt
from pagedmoe.llm import LLM
from pagedmoe.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                              PoolingRequestOutput, RequestOutput)
from pagedmoe.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["DEFAULT_MODEL", "LLM", "BeamSearchParams", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "TextPrompt", "TokensPrompt", "EmbeddingOutput", "EmbeddingRequestOutput",
           "PoolingOutput", "PoolingRequestOutput"]
