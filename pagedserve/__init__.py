"""pagedserve: an LLM inference engine with a paged KV cache, continuous batching and an OpenAI server."""

from pagedserve import logging_setup

logging_setup.configure()

from pagedserve.entrypoints.llm import LLM  # noqa: E402
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.structured_output import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
