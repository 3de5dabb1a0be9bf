"""pagedserve: an LLM inference engine with a paged KV cache, continuous batching and an OpenAI server."""

from pagedserve.llm import LLM
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
