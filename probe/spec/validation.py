"""The validation primitives shared by study files and claim files (pydantic v2 + PyYAML, no torch).

A schema is a tree of frozen :class:`SpecModel` classes. A validator that finds a problem calls
:func:`fail` with the finished sentence; :func:`read_yaml_mapping` reads the file with one-line
errors of its own; :func:`located_error` turns pydantic's errors into one
:class:`~probe.errors.InputError` line naming the file, the line, the key path and the bad value::

    studies/x.yaml line 3: model.dtype: 'fp64' is not one of fp32, bf16, fp16
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import yaml
from pydantic import BaseModel, ConfigDict, Strict, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from probe.data import BUILTIN_PREFIX, USER_FILE_SUFFIXES, builtin_dataset_names
from probe.data.planted_texts import PREFIX as PLANTED_PREFIX
from probe.data.planted_texts import planted_dataset_names
from probe.errors import InputError
from probe.names import ALL_METHODS

__all__ = [
    "Bool", "Float", "Int", "LAYER_WORDS", "SpecFile", "SpecModel", "check_dataset_name", "check_duplicate_keys", "check_node_graph",
    "describe", "dotted", "error_context", "error_line", "fail", "find_model", "first_error", "layer_value",
    "line_of", "located_error", "method_list", "model_at", "read_yaml_mapping", "show", "suggest", "unknown_method",
    "walk",
]

Int = Annotated[int, Strict()]          # no bools, no floats, no numeric strings
Float = Annotated[float, Strict()]      # ints are accepted (1 -> 1.0), strings are not
Bool = Annotated[bool, Strict()]

LAYER_WORDS = ("first", "last")


class SpecModel(BaseModel):
    """A frozen schema node that refuses unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class SpecFile:
    """What a validated file is called in messages, and the schema of its top level."""

    schema: type[BaseModel]
    #: the top level where a key path is empty ("study", "the claim file")
    top: str
    #: the top level as the object of "add KEY: to ..." ("the study", "the claim file")
    the_top: str


# ------------------------------------------------------------------------------------ small helpers


def fail(message: str, at: Sequence[str | int] = (), item: Sequence[str | int] = ()) -> NoReturn:
    """Raise a validation error with a finished ``message``.

    ``at`` extends the error's location (shown in the message and used for the line number);
    ``item`` extends it for the line number only (e.g. the index of a bad list entry).
    """
    raise PydanticCustomError("study", "{message}", {"message": message, "at": list(at), "item": list(item)})


def show(value: Any) -> str:
    """A value as a message shows it: YAML's null/true/false, else its repr cut to 60 characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def suggest(word: Any, options: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``options``, or ``""``."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def dotted(loc: Sequence[str | int]) -> str:
    """``("metrics", "erasure", "bins", 0)`` -> ``metrics.erasure.bins[0]``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def unknown_method(name: Any) -> str:
    if not isinstance(name, str):
        return f"{show(name)} is not a method name (valid: {', '.join(ALL_METHODS)})"
    return f"unknown method {name!r} (valid: {', '.join(ALL_METHODS)}, or all){suggest(name, ALL_METHODS)}"


def method_list(value: Any) -> list[str]:
    """A list (or comma-separated string) of method names -> validated names, ``all`` expanded, no duplicates."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        fail(f"{show(value)} is not a list of methods; write e.g. [attention, rollout] "
             f"(valid: {', '.join(ALL_METHODS)}, or all)")
    names: list[str] = []
    for i, name in enumerate(value):
        if name == "all":
            names.extend(ALL_METHODS)
        elif isinstance(name, str) and name in ALL_METHODS:
            names.append(name)
        else:
            fail(unknown_method(name), item=[i])
    if not names:
        fail(f"no method given; list at least one (valid: {', '.join(ALL_METHODS)}, or all)")
    return list(dict.fromkeys(names))


def layer_value(value: Any, i: int | None = None) -> int | str:
    """A layer entry of a list: an index >= 0 (digits in text are read as one), first or last."""
    item = [] if i is None else [i]
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not (isinstance(value, int) or value in LAYER_WORDS):
        fail(f"layer {show(value)} is not a layer; give a layer index (0, 1, ...), first or last", item=item)
    if isinstance(value, int) and value < 0:
        fail(f"layer {value} is negative; give a layer index >= 0, or last for the last layer", item=item)
    return value


def check_dataset_name(value: str, info: ValidationInfo) -> str:
    """A validator body: ``builtin:NAME``, ``planted:NAME`` or a CSV/JSONL path (relative paths resolved against the
    file's folder, ``info.context["base_dir"]``, when they exist there)."""
    value = value.strip()
    valid_builtins = ", ".join(BUILTIN_PREFIX + n for n in builtin_dataset_names())
    if not value:
        fail(f"is empty; give builtin:NAME ({valid_builtins}) or a .csv/.jsonl file")
    if value.startswith(BUILTIN_PREFIX):
        if value[len(BUILTIN_PREFIX):] not in builtin_dataset_names():
            fail(f"unknown built-in dataset {value!r} (valid: {valid_builtins})"
                 f"{suggest(value, [BUILTIN_PREFIX + n for n in builtin_dataset_names()])}")
        return value
    if value.startswith(PLANTED_PREFIX):
        valid_planted = [PLANTED_PREFIX + n for n in planted_dataset_names()]
        if value not in valid_planted:
            fail(f"unknown planted dataset {value!r} (valid: "
                 f"{', '.join(valid_planted)}){suggest(value, valid_planted)}")
        return value
    if Path(value).suffix.lower() not in USER_FILE_SUFFIXES:
        fail(f"{value!r} is neither builtin:NAME ({valid_builtins}) nor a file ending in "
             f"{', '.join(USER_FILE_SUFFIXES)}")
    base = (info.context or {}).get("base_dir")
    if base is not None and not Path(value).is_absolute() and not value.startswith("~"):
        candidate = Path(base) / value
        if candidate.exists():
            return str(candidate)
    return value


# ------------------------------------------------------------------------------------ reading YAML


def read_yaml_mapping(path: Path, what: str, top: str, empty_hint: str, keys_hint: str) -> tuple[dict, yaml.Node]:
    """Read a YAML file whose top level is a mapping, with one-line errors naming the file and line:
    a missing file, a folder, bad encoding, bad YAML, an empty file, a top level that is not a
    mapping, a duplicate key. ``what``: e.g. "study file"; ``top``: what the document is called
    ("study"); ``empty_hint`` / ``keys_hint``: what to write instead.
    """
    if not path.exists():
        raise InputError(f"{what} not found: {path}")
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a {what}; give the path of a .yaml {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8 text; save the {what} as UTF-8 YAML") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    root, data = _parse_yaml(text, path)
    if root is None or data is None:
        raise InputError(f"{path} is empty; {empty_hint}")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"the value {show(data)}"
        raise InputError(f"{path} line {root.start_mark.line + 1}: the {top} is {kind}, not a mapping; "
                         f"write it as key: value lines ({keys_hint})")
    check_duplicate_keys(root, str(path), top=top)
    return data, root


#: a study or claim file, with its aliases expanded, holds at most this many YAML nodes (a few
#: thousand in the largest shipped file); an alias bomb is refused before anything walks it
MAX_YAML_NODES = 200_000
#: and is at most this long
MAX_YAML_BYTES = 16 * 2**20


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_node_graph(root: yaml.Node, source: str) -> None:
    """Refuse a node graph whose aliases make it recursive, or larger than :data:`MAX_YAML_NODES`
    once expanded; iterative, and each node is visited once however often it is aliased."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise InputError(f"{source} line {node.start_mark.line + 1}: the YAML aliases (*name) here expand to "
                                 f"more than {MAX_YAML_NODES} values; write the values out, or use fewer aliases")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise InputError(f"{source} line {node.start_mark.line + 1}: a YAML alias refers to a value that holds "
                             "it (a recursive anchor); write the value out")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


#: and nests at most this deep (the shipped files nest a few levels); PyYAML composes nodes recursively,
#: so a deeper file would end in a RecursionError
MAX_YAML_DEPTH = 100


class _DepthBoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses, in one line, a document nested deeper than :data:`MAX_YAML_DEPTH`."""

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self._source = source
        self._depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_YAML_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise InputError(f"{self._source} line {line}: the YAML nests more than {MAX_YAML_DEPTH} levels deep; "
                             "a study or claim file needs a few: flatten it")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _unprintable(text: str, exc: yaml.reader.ReaderError, path: Path) -> str:
    """One line for a character YAML does not allow (ESC, NUL, ...): where it is, and what to do."""
    position = min(max(int(exc.position), 0), len(text))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    code = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
    return (f"{path} line {line} column {column}: the control character U+{code:04X} is not allowed in a YAML "
            f"file; remove it, or write it as an escape inside double quotes (\"\\x{code:02x}\")"
            if code < 0x100 else
            f"{path} line {line} column {column}: the character U+{code:04X} is not allowed in a YAML file; remove it, "
            f"or write it as an escape inside double quotes (\"\\u{code:04x}\")")


def _parse_yaml(text: str, path: Path) -> tuple[yaml.Node | None, Any]:
    """(the node tree, the data) of one YAML document; bad YAML is one line with its line number."""
    if len(text) > MAX_YAML_BYTES:
        raise InputError(f"{path} is {len(text) / 2**20:.0f} MiB; a study or claim file is at most "
                         f"{MAX_YAML_BYTES // 2**20} MiB (put long data in a .csv/.jsonl dataset file)")
    try:
        # the reader checks every character when it is made: a control character is refused here
        loader = _DepthBoundedLoader(text, str(path))
    except yaml.reader.ReaderError as exc:
        raise InputError(_unprintable(text, exc, path)) from None
    try:
        root = loader.get_single_node()
        if root is not None:
            check_node_graph(root, str(path))
        return root, (loader.construct_document(root) if root is not None else None)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = str(exc.problem or exc.context or "unreadable")
        if exc.problem and exc.context and str(exc.context).startswith("expected"):
            problem = f"{exc.context}, {exc.problem}"  # e.g. "expected a single document ..., but found another"
        problem = " ".join(problem.split())
        raise InputError(f"{path}{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()


def check_duplicate_keys(node: yaml.Node, source: str, trail: tuple[str | int, ...] = (), top: str = "study") -> None:
    """YAML keeps the last of two equal keys silently; a study (or claim) file must not have any.
    Iterative, each node checked once (an aliased node is not walked again)."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[str | int, ...]]] = [(node, trail)]
    while stack:
        current, where = stack.pop()
        if id(current) in seen_nodes:
            continue
        seen_nodes.add(id(current))
        if isinstance(current, yaml.MappingNode):
            seen: set[str] = set()
            children = []
            for key, value in current.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and name in seen:
                    raise InputError(f"{source} line {key.start_mark.line + 1}: duplicate key {name!r} in "
                                     f"{dotted(where) or top}; keep only one of them")
                if name is not None:
                    seen.add(name)
                children.append((value, where + (name if name is not None else "?",)))
            stack.extend(reversed(children))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(reversed([(item, where + (i,)) for i, item in enumerate(current.value)]))


def walk(root: yaml.Node, path: Sequence[str | int]) -> tuple[yaml.Node, yaml.Node | None, bool]:
    """Follow ``path`` down the node tree: ``(deepest node reached, its key node if it is a mapping value,
    whether the whole path was followed)``."""
    node, key = root, None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)),
                         None)
            if found is None:
                return node, key, False
            key, node = found
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            key, node = None, node.value[part]
        else:
            return node, key, False
    return node, key, True


def line_of(root: yaml.Node | None, path: Sequence[str | int]) -> int | None:
    """The line of the key (or, in a list, the item) at ``path``, as far as the file has it."""
    if root is None:
        return None
    node, key, _ = walk(root, path)
    return (key if key is not None else node).start_mark.line + 1


# ------------------------------------------------------------------------------------ error messages


def error_context(error: dict, key: str) -> list:
    """The ``at`` or ``item`` location parts a :func:`fail` call added to ``error``."""
    return list((error.get("ctx") or {}).get(key) or [])


def error_line(error: dict, root: yaml.Node | None) -> int | None:
    """The line in the file a pydantic error points at (None without a node tree)."""
    if root is None:
        return None
    loc = tuple(error["loc"]) + tuple(error_context(error, "at")) + tuple(error_context(error, "item"))
    if error["type"] == "missing":
        if len(loc) <= 1:
            return None
        return line_of(root, loc[:-1])
    return line_of(root, loc)


def first_error(errors: list[dict], root: yaml.Node | None) -> tuple[dict, int | None]:
    """The problem that comes first in the file (errors without a line come last), and its line."""
    lines = [error_line(e, root) for e in errors]
    order = sorted(range(len(errors)), key=lambda i: (lines[i] is None, lines[i] or 0, i))
    return errors[order[0]], lines[order[0]]


def located_error(exc: ValidationError, document: SpecFile, source: str, root: yaml.Node | None,
                  prefix: tuple = ()) -> InputError:
    """The first problem of ``exc`` (by line) as one InputError line: ``SOURCE line N: what to do``.

    ``prefix``: where in the file the validated part sits (e.g. ``("claims", 2)``); the schema
    ``document.schema`` is then that part's model.
    """
    errors = [{**e, "loc": prefix + tuple(e["loc"])} for e in exc.errors()]
    error, line = first_error(errors, root)
    where = f"{source} line {line}" if line is not None else source
    return InputError(f"{where}: {describe(error, document, skip=len(prefix))}")


def find_model(annotation: Any) -> type[BaseModel] | None:
    """The schema model in a field's annotation (through ``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = find_model(arg)
        if found is not None:
            return found
    return None


def section_keys(model: type[BaseModel]) -> list[str]:
    """A section's keys in the order a user reads them: a dataset section's source key first."""
    keys = list(model.model_fields)
    lead = getattr(model, "source_key", "")
    return [lead] + [k for k in keys if k != lead] if lead in keys else keys


def model_at(model: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The schema model found at ``loc`` below ``model`` (e.g. Study, ``("metrics", "erasure")`` -> ErasureSpec)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        nested = find_model(field.annotation)
        if nested is None:
            return None
        model = nested
    return model


def describe(error: dict, document: SpecFile, skip: int = 0) -> str:
    """One line: the key path, the bad value and what to do. ``skip``: how many leading parts of the
    error's location lie above ``document.schema`` (their keys are not that schema's)."""
    kind, loc, value = error["type"], tuple(error["loc"]), error.get("input")
    own = loc[skip:]  # the location inside ``document.schema``
    if kind == "study":
        path = dotted(loc + tuple(error_context(error, "at")))
        message = error["ctx"]["message"]
        return f"{path}: {message}" if path else message
    if kind in ("extra_forbidden", "invalid_key"):
        model = model_at(document.schema, own[:-1])
        keys = section_keys(model) if model is not None else []
        where = dotted(loc[:-1]) or document.top
        hint = suggest(loc[-1], keys) or "; remove it or fix its spelling"
        return f"unknown key {show(loc[-1])} in {where} (valid keys: {', '.join(keys)}){hint}"
    if kind == "missing":
        where = dotted(loc[:-1])
        prefix = f"{where}: " if where else ""
        return f"{prefix}missing required key {loc[-1]!r}; add {loc[-1]}: to {where or document.the_top}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        model = model_at(document.schema, own)
        keys = f" with keys such as {', '.join(section_keys(model))}" if model is not None else ""
        return f"{dotted(loc)}: {show(value)} is not a mapping; write key: value pairs{keys}"
    return _describe_value(kind, dotted(loc), value, error)


_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def _describe_value(kind: str, path: str, value: Any, error: dict) -> str:
    """A value of the wrong type or out of range, as one line."""
    shown = show(value)
    ctx = error.get("ctx") or {}
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"{path}: {shown} is not one of {', '.join(options)}{suggest(value, options)}"
    if kind == "list_type":
        return f"{path}: {shown} is not a list; write [a, b, ...]"
    if kind == "string_type":
        return f"{path}: {shown} is not text; write a string (quote it if YAML reads it as something else)"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{path}: {shown} is not a whole number; give an integer such as 1"
    if kind in ("float_type", "float_parsing"):
        return f"{path}: {shown} is not a number; give one such as 0.5"
    if kind in ("bool_type", "bool_parsing"):
        return f"{path}: {shown} is not true or false"
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"{path}: {shown} is out of range; give a value {sign} {ctx.get(key)}"
    message = str(error.get("msg", "invalid value"))
    message = message[:1].lower() + message[1:]
    return f"{path}: {shown} is not valid: {' '.join(message.split())}"
