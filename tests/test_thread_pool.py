"""The CPU backend's thread pool (cpp/backend/cpu/thread_pool.cpp) under exceptions, built here from its sources
(tests/thread_pool_check.cpp): one thrown on a worker reaches run()'s caller instead of ending the process."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_worker_exceptions_reach_the_caller(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler is needed (the package itself builds with one)"
    exe = tmp_path / "thread_pool_check"
    r = subprocess.run([cxx, "-O1", "-g", "-std=c++17", "-pthread", f"-I{ROOT / 'cpp'}",
                        str(ROOT / "tests" / "thread_pool_check.cpp"), str(ROOT / "cpp" / "backend" / "cpu" / "thread_pool.cpp"),
                        "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
