from pagedmoe.llm import LLM
from pagedmoe.outputs import CompletionOutput, RequestOutput
from pagedmoe.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
