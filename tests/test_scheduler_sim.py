"""The scheduler under the engine's step bookkeeping over thousands of random configurations
(tests/scheduler_sim.cpp, built here from the real scheduler and page sources): every token fed and every K/V row
read is checked, outputs equal each request's run alone, no page or slot leaks, and requests that share a prefix
share its cached pages without writing into them; with a recurrent state (hybrid models), every step starts each
sequence from a state of exactly its own tokens (a snapshot restored on a hit); with a host tier (kv/tiers.h), steps
write device frames only and read every page where its frame is, after the frames' moves, and the moves marked to
run beside the step in flight never touch a frame it uses; with speculation, drafts
(right half of the time) are fed, verified and rolled back as the engine does, and outputs stay the run alone's."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "scheduler_sim.cpp", ROOT / "cpp" / "engine" / "scheduler.cpp", ROOT / "cpp" / "kv" / "pages.cpp",
           ROOT / "cpp" / "kv" / "tiers.cpp"]


def _build(tmp_path: Path) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler is needed (the package itself builds with one)"
    exe = tmp_path / "scheduler_sim"
    base = [cxx, "-O1", "-g", "-std=c++17", f"-I{ROOT / 'cpp'}", *map(str, SOURCES), "-o", str(exe)]
    # With the sanitizers where the toolchain has them: an out-of-bounds read or a use after free fails the run.
    for flags in (["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"], []):
        r = subprocess.run(base[:1] + flags + base[1:], capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            return exe
    raise AssertionError(f"building the scheduler simulation failed:\n{r.stderr[-3000:]}")


def test_scheduler_simulation(tmp_path):
    exe = _build(tmp_path)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    r = subprocess.run([str(exe), "15000"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok ("), r.stdout[-3000:] + r.stderr[-3000:]
    # The workloads share prefixes: the cache must have been used, and its pages read by other requests.
    counts = [int(w) for w in r.stdout.replace("(", " ").split() if w.isdigit()]
    assert counts[1] > 0 and counts[2] > 0, r.stdout
    # State models (hybrid): prefix hits resumed from state snapshots.
    assert counts[3] > 0, r.stdout
    # Host tiers: frames moved between the tiers, some beside the step in flight (checked: never a frame it uses).
    assert counts[4] > 0 and counts[7] > 0, r.stdout
    # Speculation: draft tokens fed, and confirmed where they were the run alone's.
    assert counts[5] > 0 and 0 < counts[6] < counts[5], r.stdout
