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


def _cuda_requirements():
    """build_backend/cuda_requirements.py, loaded alone (it imports no build tools)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cuda_requirements",
                                                  Path(__file__).resolve().parent.parent / "build_backend" /
                                                  "cuda_requirements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


METADATA = """Metadata-Version: 2.2
Name: qwen_rt
Version: 0.1.0
Requires-Dist: numpy>=1.24
Requires-Dist: nvidia-cublas<14,>=13; platform_system == "Linux" and platform_machine == "x86_64"
Requires-Dist: nvidia_nccl_cu13>=2.27; platform_system == "Linux"
Requires-Dist: nvidia-cuda-runtime>=13
Provides-Extra: test
Requires-Dist: pytest>=8; extra == "test"

README text naming nvidia-cublas stays.
"""


def test_a_build_without_the_plugin_drops_its_libraries_from_the_metadata():
    """A wheel without the CUDA plugin does not depend on cuBLAS and NCCL (~0.7 GB a CPU-only install would
    download): their Requires-Dist lines go, in any spelling of the names; every other line stays."""
    cr = _cuda_requirements()
    out = cr.drop_cuda_requirements(METADATA)
    assert "nvidia-cublas<14" not in out and "nvidia_nccl_cu13" not in out
    kept = [line for line in METADATA.splitlines() if "cublas<14" not in line and "nccl_cu13" not in line]
    assert out.splitlines() == kept


def test_the_wheel_and_its_record_are_rewritten_together(tmp_path):
    import base64
    import hashlib
    import zipfile
    cr = _cuda_requirements()
    wheel = tmp_path / "qwen_rt-0.1.0-cp311-cp311-linux_x86_64.whl"
    meta = "qwen_rt-0.1.0.dist-info/METADATA"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("qwen_rt/__init__.py", "x = 1\n")
        z.writestr(meta, METADATA)
        z.writestr("qwen_rt-0.1.0.dist-info/RECORD", f"qwen_rt/__init__.py,sha256=abc,6\n{meta},sha256=old,9\n"
                                                     "qwen_rt-0.1.0.dist-info/RECORD,,\n")
    cr.drop_in_wheel(str(wheel))
    with zipfile.ZipFile(wheel) as z:
        new_meta = z.read(meta)
        record = z.read("qwen_rt-0.1.0.dist-info/RECORD").decode().splitlines()
        assert z.read("qwen_rt/__init__.py") == b"x = 1\n"
    assert new_meta.decode() == cr.drop_cuda_requirements(METADATA)
    digest = base64.urlsafe_b64encode(hashlib.sha256(new_meta).digest()).rstrip(b"=").decode()
    assert f"{meta},sha256={digest},{len(new_meta)}" in record
    assert "qwen_rt/__init__.py,sha256=abc,6" in record
    dist_info = tmp_path / "qwen_rt-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(METADATA)
    cr.drop_in_dist_info(str(dist_info))
    assert (dist_info / "METADATA").read_text() == cr.drop_cuda_requirements(METADATA)
