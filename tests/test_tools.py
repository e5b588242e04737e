"""Python functions as chat tools: qwen_rt.tools.tool_schema against transformers' get_json_schema, on chosen
shapes and on random type hints and docstrings."""
import enum
import inspect
import random
import typing
from typing import Any, Literal, Optional, Union

import pytest

from qwen_rt.tools import tool_schema

transformers_utils = pytest.importorskip("transformers.utils")
get_json_schema = transformers_utils.get_json_schema


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Mixed(enum.Enum):
    ONE = 1
    NAME = "name"
    NONE = None


def _func(hints: dict, doc: str, defaults: int = 0, first: str | None = None):
    """A function with these annotated arguments (the last `defaults` of them default to None), this
    docstring, and optionally an unannotated first argument (self, cls, ...)."""
    names = [n for n in hints if n != "return"]
    params = [inspect.Parameter(first, inspect.Parameter.POSITIONAL_OR_KEYWORD)] if first else []
    for i, n in enumerate(names):
        default = None if i >= len(names) - defaults else inspect.Parameter.empty
        params.append(inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                        annotation=hints[n]))

    def f(*args, **kwargs):
        pass

    f.__annotations__ = dict(hints)
    f.__signature__ = inspect.Signature(params)
    f.__doc__ = doc
    f.__name__ = "tool_fn"
    return f


def _same(f):
    """tool_schema(f) equals get_json_schema(f), or both refuse it (ours with ValueError)."""
    try:
        theirs = get_json_schema(f)
    except Exception:
        theirs = None
    if theirs is None:
        with pytest.raises(ValueError):
            tool_schema(f)
    else:
        ours = tool_schema(f)
        assert ours == theirs
        assert list(ours["function"]["parameters"]["properties"]) == list(theirs["function"]["parameters"]["properties"])
    return theirs


HINTS = [
    Optional[list[int]], list[str] | None, int | None, Union[str, int], Union[int, str, None], Union[list, tuple],
    Union[list[int], dict[str, int]], Literal["a", 1], Literal[2, "b", 2.5, True, None], Optional[Literal["x", "y"]],
    Color, Mixed, Optional[Color], dict[str, list[tuple[int, str]]], list[dict[str, int | None]], tuple[int, str],
    Any, Optional[Any], list, dict, tuple, typing.List[int], typing.Dict[str, float], float, bool,
]


@pytest.mark.parametrize("hint", HINTS, ids=[repr(h) for h in HINTS])
def test_type_hints(hint):
    doc = "Does it.\n\nArgs:\n    a: the a\n"
    assert _same(_func({"a": hint}, doc)) is not None
    _same(_func({"a": int, "return": hint}, doc + "\nReturns:\n    the result\n"))


@pytest.mark.parametrize("hint", [Literal[Color.RED], tuple[int, ...], tuple[int], object, Color | object])
def test_type_hints_without_a_schema_are_refused(hint):
    doc = "Does it.\n\nArgs:\n    a: the a\n"
    with pytest.raises(ValueError, match="argument 'a'"):
        tool_schema(_func({"a": hint}, doc))
    # a return hint without a schema is left out, as transformers leaves it
    assert "return" not in _same(_func({"a": int, "return": hint}, doc))["function"]


DOCS = {
    "returns keeps its lines, raises is cut":
        "Do.\n\nArgs:\n    a: A\n\nReturns:\n    first line\n      second line\n\nRaises:\n    ValueError: bad\n",
    "raises before returns": "Do.\n\nArgs:\n    a: A\n\nRaises:\n    ValueError: bad\n\nReturns:\n    num\n",
    "raises and no args": "Do.\n\nRaises:\n    ValueError: bad\n\nArgs:\n    a: A\n",
    "args indented under the description": "Do the thing.\nMore.\n\n    Args:\n        a: A\n",
    "continuation deeper, same indent, blank": "Do.\n\nArgs:\n    a: one\n        two\n    three\n\n   four\n",
    "typed argument, next-line description": "Do.\n\nArgs:\n    a (int):\n        the a\n",
    "choices any case": 'Do.\n\nArgs:\n    a: pick (Choices: [" x", 1, true])\n',
    "choices in the middle are text": 'Do.\n\nArgs:\n    a: pick (choices: ["x"]) of these\n',
    "note after args is an argument": "Do.\n\nArgs:\n    a: A\n\nNote:\n    careful\n",
    "section words mid-line": "Do: see Args: below.\n\nArgs:\n    a: A Returns: x\n",
    "one-line returns": "Do.\n\nArgs:\n    a: A\n\nReturns: the sum\n",
    "empty": "Args:\n    a: A\n",
}


@pytest.mark.parametrize("doc", DOCS.values(), ids=DOCS.keys())
def test_docstrings(doc):
    _same(_func({"a": str, "return": int}, doc))


def test_methods_and_varargs():
    class Tool:
        def method(self, a: int) -> int:
            """Do.

            Args:
                a: A
            """

        @classmethod
        def build(cls, a: int):
            """Do.

            Args:
                a: A
            """

    for f in (Tool.method, Tool().method, Tool.build, _func({"a": int}, "Do.\n\nArgs:\n    a: A\n", first="self")):
        assert list(_same(f)["function"]["parameters"]["properties"]) == ["a"]
    with pytest.raises(ValueError, match="argument 'this' has no type hint"):
        tool_schema(_func({"a": int}, "Do.\n\nArgs:\n    a: A\n", first="this"))

    def varargs(*args: int, **kwargs: str):
        """Do.

        Args:
            args: numbers
            kwargs: names
        """

    _same(varargs)


def test_clear_errors():
    for f, msg in ((_func({"a": int}, ""), "no docstring"),
                   (_func({"a": int}, "Do.\n\nArgs:\n    b: B\n"), "does not describe 'a'"),
                   (_func({"a": int}, "Do.\n\nParameters:\n    a: A\n"), "does not describe 'a'"),
                   (_func({"a": str}, "Do.\n\nArgs:\n    a: A (choices: [x])\n"), r"\(choices: ...\) is not a JSON list"),
                   (_func({"a": Literal[Color.RED]}, "Do.\n\nArgs:\n    a: A\n"), "is not a JSON scalar")):
        with pytest.raises(ValueError, match=msg):
            tool_schema(f)


# -- random shapes ---------------------------------------------------------------------------------

def _random_hint(rng: random.Random, depth: int = 0):
    scalars = [int, float, str, bool, type(None), Any, list, dict, tuple, Color, Mixed]
    if depth >= 2 or rng.random() < 0.4:
        return rng.choice(scalars)
    kind = rng.choice(["list", "dict", "tuple", "union", "optional", "literal", "pep604"])
    sub = lambda: _random_hint(rng, depth + 1)  # noqa: E731
    if kind == "list":
        return list[sub()]
    if kind == "dict":
        return dict[str, sub()]
    if kind == "tuple":
        return tuple[tuple(sub() for _ in range(rng.randint(1, 3)))]
    if kind == "literal":
        values = [rng.choice(["a", "b", 1, 2, 2.5, True, False, None]) for _ in range(rng.randint(1, 4))]
        return Literal[tuple(values)]
    if kind == "optional":
        return Optional[sub()]
    members = tuple(sub() for _ in range(rng.randint(2, 3)))
    return Union[members] if kind == "union" else (members[0] | None if rng.random() < 0.5 else Union[members])


def _random_doc(rng: random.Random, names: list[str]) -> str:
    ind = lambda: " " * rng.choice([0, 2, 4, 8])  # noqa: E731
    word = lambda: rng.choice(["the", "value", "Args:", "note", "x: y", "(int)", "Returns:", "end."])  # noqa: E731
    lines = [" ".join(word() if rng.random() < 0.1 else "text" for _ in range(rng.randint(0, 4)))]
    sections = ["args", "args", "returns", "raises", "other", "blank"]
    rng.shuffle(sections)
    for s in sections[:rng.randint(1, len(sections))]:
        base = ind()
        if s == "blank":
            lines.append("")
        elif s == "args":
            lines += ["", base + "Args:" + rng.choice(["", "", " "])]
            arg_ind = base + rng.choice(["  ", "    ", "\t"])
            for n in rng.sample(names + ["extra"], k=rng.randint(1, len(names) + 1)):
                typ = rng.choice(["", "", " (int)", "(list[str])"])
                desc = rng.choice(["the " + n, "", "pick (choices: [\"a\", \"b \"])", "x (CHOICES: [1, 2]) ",
                                   "bad (choices: [a])", "see: this"])
                lines.append(f"{arg_ind}{n}{typ}:{rng.choice([' ', '', '  '])}{desc}")
                for _ in range(rng.choice([0, 0, 1, 2])):
                    lines.append(arg_ind + rng.choice(["    more", "", "same indent", "  deeper: yes", "    q: z"]))
        elif s == "returns":
            lines += ["", base + rng.choice(["Returns:", "Returns: inline", "Return:"])]
            lines += [base + "    " + rng.choice(["the result", "line two", "  indented"]) for _ in range(rng.randint(0, 2))]
        elif s == "raises":
            lines += ["", base + "Raises:", base + "    ValueError: bad"]
        else:
            lines += ["", base + rng.choice(["Example:", "Note:", "Yields:"]), base + "    f(1)"]
    return "\n".join(lines)


def test_random_hints_and_docstrings_match_transformers():
    """2,000 random functions: the same schema as transformers, or both refuse."""
    rng = random.Random(1234)
    matched = refused = 0
    for _ in range(2000):
        names = rng.sample(["a", "b", "city", "n"], k=rng.randint(1, 3))
        hints = {n: _random_hint(rng) for n in names}
        if rng.random() < 0.5:
            hints["return"] = _random_hint(rng)
        f = _func(hints, _random_doc(rng, names), defaults=rng.randint(0, len(names)),
                  first=rng.choice([None, None, "self", "cls"]))
        if _same(f) is None:
            refused += 1
        else:
            matched += 1
    assert matched > 300 and refused > 300, (matched, refused)  # both paths are exercised
