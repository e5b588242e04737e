"""The CUDA kernels without a GPU: tests/cuda_emu/*.cpp run kernels cut out of cpp/backend/cuda as they are
(cut.py) on a host emulation of CUDA (emu.h: a block is a set of threads with a barrier, mma.sync and warp
shuffles are warp-wide exchanges in PTX's fragment layouts), each against an fp64 reference: the FP8 GEMVs
(CUDA cores at 1 row, tensor cores at 2-32, every epilogue), the gated delta rule (the token loop and the
chunked form), the tensor-core decode attention (head_dim 64-256, 16-bit and e4m3 caches, the host tier, splits),
the prefill tile kernel (mma.sync and ldmatrix; the same), and sparse decode's page lists (against a sort) and
staging kernel (against the CPU backend's stage_pages: the same lists, slots and bytes). This checks their logic
and indexing on every CPU run; speed and the hardware's own behaviour (and the wgmma kernel) need the GPU tests.
QRT_EMU_SANITIZE=address or thread builds with that sanitizer (thread: a missing __syncthreads is a data race)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EMU = ROOT / "tests" / "cuda_emu"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@pytest.fixture(scope="module")
def cut_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda_emu")
    subprocess.run([sys.executable, str(EMU / "cut.py"), str(ROOT / "cpp" / "backend" / "cuda"), str(out)], check=True)
    return out


@pytest.mark.parametrize("harness", ["fp8_gemv", "gdn", "attn_decode", "attn_tile", "sparse"])
def test_kernel_on_the_host_emulator(cut_dir, harness):
    sanitize = os.environ.get("QRT_EMU_SANITIZE")
    flags = ["-O1", "-g", f"-fsanitize={sanitize}"] if sanitize else ["-O2"]
    exe = cut_dir / harness
    subprocess.run(["g++", "-std=c++20", "-Wno-unknown-pragmas", *flags, f"-I{ROOT / 'cpp'}", f"-I{EMU}",
                    f"-I{cut_dir}", "-o", str(exe), str(EMU / f"{harness}.cpp"), "-lpthread"], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("ok")
    assert "WARNING: ThreadSanitizer" not in run.stderr, run.stderr
