"""How the installed package finds its CUDA plugin's libraries and says why CUDA is unavailable (no GPU needed)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qwen_rt
from qwen_rt import _core, cli
from qwen_rt._native_libraries import nvidia_library_dirs

PLUGIN = Path(_core.__file__).with_name("_cuda_backend.so")


def test_nvidia_library_dirs_finds_pip_packages_on_every_path(tmp_path, monkeypatch):
    """Each sys.path entry's nvidia/<package>/lib is found (a venv over another environment's packages has two),
    in sys.path order; folders without lib/ are not."""
    first, second = tmp_path / "venv_site", tmp_path / "parent_site"
    (first / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    (second / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (second / "nvidia" / "cusparse").mkdir(parents=True)  # no lib/: not named
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.setattr(sys, "path", [str(first), str(second)])
    assert nvidia_library_dirs() == [str(first / "nvidia" / "nccl" / "lib"), str(second / "nvidia" / "cu13" / "lib")]


def test_no_nvidia_packages_gives_no_dirs(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert nvidia_library_dirs() == []


@pytest.mark.skipif(_core.cuda_device_count() > 0, reason="a GPU is usable here")
def test_without_a_gpu_the_reason_is_said(capsys):
    """No usable GPU: the runtime says which of the three causes it is, and `qwen-rt info` prints it."""
    reason = _core.cuda_unavailable_reason()
    if PLUGIN.exists():  # the plugin loads (its libraries found) and the driver reports no device
        assert reason.startswith(("the CUDA driver reports no usable device", "the CUDA plugin cannot load")), reason
    else:
        assert reason.startswith("this qwen_rt was built without the CUDA backend ("), reason
    assert cli.main(["info"]) == 0
    assert reason in capsys.readouterr().out
    with pytest.raises(ValueError, match="no CUDA device is usable: " + reason[:30]):
        qwen_rt.Generator("qwen3-0.6b", load_format="dummy", device="cuda", progress=False)


@pytest.mark.skipif(not PLUGIN.exists(), reason="built without the CUDA plugin")
@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf")
def test_the_plugin_finds_its_libraries_relative_to_itself():
    """The plugin names cuBLASLt and NCCL by soname and looks for them beside qwen_rt (pip's nvidia packages in the
    same site-packages), never in a folder of the machine that built it; the CUDA runtime is linked in."""
    dynamic = subprocess.run(["readelf", "-d", str(PLUGIN)], capture_output=True, text=True, check=True).stdout
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line}
    assert {"libcublasLt.so.13", "libnccl.so.2"} <= needed
    assert not any(n.startswith("libcudart") for n in needed)
    runpath = next(line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "RUNPATH" in line)
    assert "$ORIGIN/../nvidia/cu13/lib" in runpath.split(":") and "$ORIGIN/../nvidia/nccl/lib" in runpath.split(":")
    assert all(p.startswith("$ORIGIN") for p in runpath.split(":")), runpath
