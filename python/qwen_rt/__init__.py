"""qwen_rt: fast embeddable inference for Qwen language models."""
from .generator import Generator, Request
from .sampling import Completion, Delta, SamplingParams

__version__ = "0.1.0"
__all__ = ["Generator", "Request", "SamplingParams", "Completion", "Delta", "__version__"]
