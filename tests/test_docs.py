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
