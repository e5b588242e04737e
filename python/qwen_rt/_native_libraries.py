"""Where pip's NVIDIA packages keep the libraries the CUDA plugin needs (cuBLASLt, NCCL), told to the native
module before the plugin first loads: the plugin's RPATH finds them only beside qwen_rt in the same
site-packages, and an environment may hold them elsewhere (a venv over system site-packages, a user site)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

# nvidia-cublas (CUDA 13) installs under nvidia/cu13, nvidia-nccl-cu13 under nvidia/nccl.
_PACKAGE_FOLDERS = ("cu13", "cublas", "nccl")


def nvidia_library_dirs() -> list[str]:
    """The lib folders of pip's nvidia-* packages that Python can import from, in sys.path order."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    dirs = [Path(root) / folder / "lib" for root in roots for folder in _PACKAGE_FOLDERS]
    return [str(d) for d in dirs if d.is_dir()]
