"""qwen_rt: fast embeddable inference for Qwen language models."""
from . import _core
from ._native_libraries import nvidia_library_dirs

_core.set_cuda_library_dirs(nvidia_library_dirs())  # before anything loads the CUDA plugin

from .generator import Generator, GeneratorClosed, Request, SparseAttention  # noqa: E402
from .sampling import Completion, Delta, SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Generator", "GeneratorClosed", "Request", "SparseAttention", "SamplingParams", "Completion", "Delta", "__version__"]
