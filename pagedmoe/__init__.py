from pagedmoe.beam_search import BeamSearchParams
from pagedmoe.llm import LLM
from pagedmoe.outputs import CompletionOutput, RequestOutput
from pagedmoe.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "RequestOutput", "CompletionOutput"]
