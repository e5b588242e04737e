"""qwen_rt's build backend: scikit-build-core's, plus the CUDA plugin's libraries (pip's nvidia-cublas and
nvidia-nccl-cu13: headers to compile against, libraries to link) as build requirements where the build will look
for them, that is, where nvcc is and QWEN_RT_CUDA is not OFF. So `pip install .` and `pip wheel .` on a machine
with nvcc build the plugin under pip's build isolation, without the user installing those first. Elsewhere (no
plugin) the wheel and its prepared metadata leave those libraries out of the dependencies (cuda_requirements.py):
a CPU-only install does not download them."""
from __future__ import annotations

import os
import platform
import shutil

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403 - the PEP 517 hooks this module does not change

import cuda_requirements

CUDA_BUILD_REQUIREMENTS = ["nvidia-cublas>=13,<14", "nvidia-nccl-cu13>=2.27"]


def _builds_cuda() -> bool:
    mode = os.environ.get("QWEN_RT_CUDA", "AUTO").upper()
    if mode == "OFF" or platform.system() != "Linux":
        return False
    has_nvcc = bool(os.environ.get("CUDACXX")) or shutil.which("nvcc") is not None
    return mode == "ON" or has_nvcc


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    extra = CUDA_BUILD_REQUIREMENTS if _builds_cuda() else []
    return list(_scikit_build.get_requires_for_build_wheel(config_settings)) + extra


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    extra = CUDA_BUILD_REQUIREMENTS if _builds_cuda() else []
    return list(_scikit_build.get_requires_for_build_editable(config_settings)) + extra


# Without the plugin: the prepared metadata and the wheel leave the plugin's libraries out. scikit-build-core then
# writes the wheel's metadata itself (it would refuse the prepared metadata, which differs from its own), and the
# wheel is rewritten to match it.
def _prepare(prepare, metadata_directory, config_settings) -> str:
    name = prepare(metadata_directory, config_settings)
    if not _builds_cuda():
        cuda_requirements.drop_in_dist_info(os.path.join(metadata_directory, name))
    return name


def _build(build, wheel_directory, config_settings, metadata_directory) -> str:
    if _builds_cuda():
        return build(wheel_directory, config_settings, metadata_directory)
    name = build(wheel_directory, config_settings, None)
    cuda_requirements.drop_in_wheel(os.path.join(wheel_directory, name))
    return name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    return _prepare(_scikit_build.prepare_metadata_for_build_wheel, metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None) -> str:
    return _prepare(_scikit_build.prepare_metadata_for_build_editable, metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    return _build(_scikit_build.build_wheel, wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    return _build(_scikit_build.build_editable, wheel_directory, config_settings, metadata_directory)
