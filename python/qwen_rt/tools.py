"""Python functions as chat tools: the JSON schema of a function's type hints and Google-style docstring,
made as transformers' `get_json_schema` makes it (so a chat template renders the same prompt)."""
from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing

__all__ = ["tool_schema"]

_JSON_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE_TYPES = {**{t: {"type": name} for t, name in _JSON_SCALARS.items()},
               list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}}


def _values_schema(values: list, what: str) -> dict:
    """An "enum" of JSON scalars; its "type" names each value's JSON type once, in order of first appearance."""
    bad = [v for v in values if type(v) not in _JSON_SCALARS]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} is not a JSON scalar (int, float, str, bool or None)")
    kinds = list(dict.fromkeys(_JSON_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint_schema(hint, where: str) -> dict:
    """The JSON schema of a type hint: scalars, Any, Enum classes, Literal, list, tuple, dict and unions of
    them; ValueError for anything else."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [m.value for m in hint]
            if not values:
                raise ValueError(f"{where}: the Enum {hint.__name__} has no members")
            return _values_schema(values, f"{where}: the Enum {hint.__name__}")
        if hint is typing.Any:
            return {}
        try:
            return dict(_BARE_TYPES[hint])
        except (KeyError, TypeError):
            raise ValueError(f"{where}: type hint {hint!r} has no JSON schema (use scalars, Enum, Literal, "
                             "list, tuple, dict and unions of them, or pass the schema as a dict)") from None
    if origin is typing.Union or origin is types.UnionType:
        parts = [_hint_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            kinds = sorted({p["type"] for p in parts})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        return _values_schema(list(args), f"{where}: Literal")
    if origin is list:
        return {"type": "array", **({"items": _hint_schema(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _hint_schema(args[1], where)} if len(args) == 2 else {})}
    if origin is tuple:
        if len(args) == 1 or Ellipsis in args:
            raise ValueError(f"{where}: {hint!r} has no JSON schema (a tuple of fixed types takes two or more; "
                             "use list[...] for a variable length)")
        return {"type": "array", **({"prefixItems": [_hint_schema(a, where) for a in args]} if args else {})}
    raise ValueError(f"{where}: type hint {hint!r} has no JSON schema")


_SECTIONS = ("Args:", "Returns:", "Raises:")
_ARG_LINE = re.compile(r"([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*)")


def _section(doc: str, header: str, skip_blank: bool) -> str | None:
    """The text after the first line that is `header` alone (any indentation, not the first line) up to the
    next "Returns:" or "Raises:"; None when there is no such line."""
    m = re.search(rf"\n[ \t]*{header}\n", doc)
    if m is None:
        return None
    rest = doc[m.end():]
    if skip_blank:
        rest = rest.lstrip()
    ends = [i for i in (rest.find(h) for h in _SECTIONS[1 if header == "Args:" else 2:]) if i >= 0]
    return rest[:min(ends)].rstrip() if ends else rest.rstrip()


def _parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {argument: description}, returns description) of a Google-style docstring.

    The description is the text before the first "Args:", "Returns:" or "Raises:". In the `Args:` section a
    line `name: text` or `name (type): text` starts an argument unless it is indented deeper than the
    argument before it (or follows an argument with no text yet); other lines continue it, joined by single
    spaces. `Returns:` keeps its lines."""
    cut = [i for i in (doc.find(h) for h in _SECTIONS) if i >= 0]
    description = (doc[:min(cut)] if cut else doc).strip()
    args: dict[str, list[str]] = {}
    indent, name = None, None
    for line in (_section(doc, "Args:", skip_blank=False) or "").splitlines():
        if not line.strip():
            continue
        m = _ARG_LINE.fullmatch(line)
        # an argument whose first line has no text takes the next line as its text, whatever it looks like
        if m and (indent is None or len(m.group(1)) <= indent) and (name is None or any(args[name])):
            indent, name = len(m.group(1)), m.group(2)
            args[name] = [m.group(3).strip()]
        elif name is not None:
            args[name].append(line.strip())
    arg_docs = {k: " ".join(x for x in v if x) for k, v in args.items()}
    returns = _section(doc, "Returns:", skip_blank=True)
    return description, arg_docs, None if returns is None else returns.strip()


def tool_schema(func) -> dict:
    """A Python function as a chat tool ({"type": "function", "function": {...}}), from its type hints and its
    Google-style docstring: a description, `Args:` with one `name: description` per argument (an ending
    `(choices: [...])` becomes its enum), and optionally `Returns:`. An unannotated first `self`/`cls` is
    skipped. ValueError names what is missing or has no JSON schema."""
    name = getattr(func, "__name__", "operation")
    doc = (inspect.getdoc(func) or "").strip()
    if not doc:
        raise ValueError(f"tool {name}: no docstring (its description and each argument's come from it)")
    description, arg_docs, returns = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(func)
    except Exception as e:  # a string annotation naming what the function's module does not define
        raise ValueError(f"tool {name}: cannot resolve its type hints ({type(e).__name__}: {e})") from e
    params = list(inspect.signature(func).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]
    properties, required = {}, []
    for p in params:
        if p.name not in hints:
            raise ValueError(f"tool {name}: argument {p.name!r} has no type hint")
        properties[p.name] = _hint_schema(hints[p.name], f"tool {name}, argument {p.name!r}")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    for arg, prop in properties.items():
        if arg not in arg_docs:
            raise ValueError(f"tool {name}: the docstring's Args: section does not describe {arg!r}")
        text = arg_docs[arg]
        m = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.IGNORECASE)
        if m:
            try:
                choices = json.loads(m.group(1))
            except json.JSONDecodeError as e:
                raise ValueError(f"tool {name}, argument {arg!r}: (choices: ...) is not a JSON list: {e}") from None
            if not isinstance(choices, list):
                raise ValueError(f"tool {name}, argument {arg!r}: (choices: ...) is not a JSON list")
            prop["enum"] = [c.strip() if isinstance(c, str) else c for c in choices]
            text = text[:m.start()].strip()
        prop["description"] = text
    out = {"name": name, "description": description,
           "parameters": {"type": "object", "properties": properties, **({"required": required} if required else {})}}
    if "return" in hints:
        try:  # the model never writes the return value: a return hint without a schema is left out
            ret = _hint_schema(hints["return"], f"tool {name}, return")
        except ValueError:
            ret = None
        if ret is not None:
            if returns is not None:
                ret["description"] = returns
            out["return"] = ret
    return {"type": "function", "function": out}
