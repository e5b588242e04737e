"""The documentation's tables stay true to the code."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_environment_switch_is_in_the_table():
    """cpp/README.md lists every QWEN_RT_* variable that the runtime (C++ or Python) reads, and no other."""
    read = set()
    for path in list((ROOT / "cpp").rglob("*.c*")) + list((ROOT / "cpp").rglob("*.h")) + \
            list((ROOT / "python" / "qwen_rt").rglob("*.py")):
        text = path.read_text()
        # Every quoted QWEN_RT_* name counts (getenv, os.getenv, os.environ, either quote): the code names these
        # variables nowhere else.
        read |= set(re.findall(r"""["'](QWEN_RT_[A-Z0-9_]+)["']""", text))
    table = set(re.findall(r"^\| `(QWEN_RT_[A-Z0-9_]+)=", (ROOT / "cpp" / "README.md").read_text(), re.M))
    assert read, "no switches found: the pattern no longer matches the code"
    assert read == table, f"read but not listed: {sorted(read - table)}; listed but not read: {sorted(table - read)}"


def test_ci_runs_the_readme_test_command():
    """.ci/run ends with the README's test command, so what CI proves is what a user is told to run."""
    ci_last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert ci_last.startswith("pip install") and "pytest" in ci_last
    assert f"    {ci_last}\n" in (ROOT / "README.md").read_text()


def test_every_example_has_a_test():
    """Each program in examples/ is run by tests/test_examples.py (none rots unseen)."""
    tested = (ROOT / "tests" / "test_examples.py").read_text()
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert examples and [e for e in examples if f'"{e}"' not in tested] == []
