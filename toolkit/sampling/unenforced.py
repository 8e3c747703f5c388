"""The JSON-schema keywords xgrammar accepts but does not enforce: a schema using one compiles, and the output is
not held to it (`uniqueItems` can yield [1, 1]), so StructuredOutputs refuses it. Found by compiling a schema with
each keyword and feeding its matcher a JSON text that breaks it (xgrammar 0.2.8; the table is in docs/decoding.md).

xgrammar reads one thing per schema object, the first of $ref, const, enum, anyOf, oneOf, allOf, type (else
properties / additionalProperties / unevaluatedProperties: an object, items / prefixItems / unevaluatedItems: an
array, else any value), and drops every other constraint there; within a type it drops those listed below.
Plain data, walked without recursion (a hostile schema may be deeply nested)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

NUMERIC = {"multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"}
STRING = {"maxLength", "minLength", "pattern", "format"}
ARRAY = {"items", "prefixItems", "unevaluatedItems", "additionalItems", "maxItems", "minItems"}
ARRAY |= {"uniqueItems", "contains", "minContains", "maxContains"}
OBJECT = {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "propertyNames"}
OBJECT |= {"required", "maxProperties", "minProperties", "dependentRequired", "dependentSchemas", "dependencies"}
GENERAL = {"type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"}
GENERAL |= {"$ref", "$dynamicRef", "$recursiveRef"}
CONSTRAINTS = NUMERIC | STRING | ARRAY | OBJECT | GENERAL  # the rest (title, default, $defs, ...) constrains nothing
# never enforced, wherever they are
NEVER = {"not", "if", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems", "contains"}
NEVER |= {"minContains", "maxContains", "$dynamicRef", "$recursiveRef"}
SHADOWING = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # xgrammar's order: the first present is all it reads
# JSON Schema's formats (others are annotations, checked by no validator); xgrammar has a rule for all but these
FORMATS = {"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference"}
FORMATS |= {"uuid", "uri-template", "json-pointer", "relative-json-pointer"}
FORMATS_IGNORED = {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
MAX_MULTIPLE_OF = 1024  # xgrammar's largest integer multipleOf


def unenforced_keyword(schema: Any) -> tuple[str, str, str] | None:
    """(keyword, its dotted path, why) for the first constraint of `schema` that xgrammar would not enforce,
    shallowest first; None when it enforces them all. Walked: what xgrammar reads (a property's schema, not its
    name; where a `$ref` points) and every $defs / definitions entry."""
    # (schema object, its path as a (key, parent) chain, the type xgrammar gives it when it names none)
    todo: deque[tuple[Any, Any, str | None]] = deque([(schema, None, None)])
    seen: set[int] = set()
    while todo:
        node, path, default = todo.popleft()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        shadow, types = _reads(node, default)
        found = _first_unenforced(node, shadow, types)
        if found is not None:
            return found[0], _dotted((found[0], path)), found[1]
        maps, ones, lists = ["$defs", "definitions"], [], []
        if shadow in ("anyOf", "oneOf", "allOf"):
            lists.append(shadow)
        if shadow is None and "object" in types:
            maps += ["properties", "patternProperties"]
            ones += [
                "propertyNames",
                "additionalProperties" if "additionalProperties" in node else "unevaluatedProperties",
            ]
        if shadow is None and "array" in types:
            lists.append("prefixItems")
            ones.append("items" if "items" in node else "unevaluatedItems")
        for key in maps:
            if isinstance(node.get(key), dict):
                todo.extend((sub, (name, (key, path)), None) for name, sub in node[key].items())
        for key in ones:
            if isinstance(node.get(key), dict):
                todo.append((node[key], (key, path), "string" if key == "propertyNames" else None))
        for key in lists:
            if isinstance(node.get(key), list):
                todo.extend((sub, (str(i), (key, path)), None) for i, sub in enumerate(node[key]))
        target = _pointed(schema, node.get("$ref")) if shadow == "$ref" else None
        if target is not None:
            todo.append((*target, None))
    return None


def _reads(node: dict, default: str | None) -> tuple[str | None, set[str]]:
    """What xgrammar reads of a schema object: the keyword shadowing all others (None: none does) and its types
    (none: any value); `default`: the type it gives one that names none (a propertyNames schema: a string)."""
    shadow = next((k for k in SHADOWING if k in node), None)
    types = node.get("type")
    if isinstance(types, str):
        return shadow, {types}
    if isinstance(types, list) and types:
        return shadow, {t for t in types if isinstance(t, str)}
    if default is not None and "type" not in node:
        return shadow, {default}
    if any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
        return shadow, {"object"}
    if any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
        return shadow, {"array"}
    return shadow, set()


def _first_unenforced(node: dict, shadow: str | None, types: set[str]) -> tuple[str, str] | None:
    """(keyword, why) for the first key of one schema object that xgrammar drops."""
    fmt = node.get("format") if isinstance(node.get("format"), str) else None
    for key, value in node.items():
        if key not in CONSTRAINTS or _no_op(key, value, node):
            continue
        if key in NEVER:
            return key, ""
        if key in ("type", "enum", "anyOf", "oneOf", "allOf") and value == []:
            return key, ", which reads an empty list as any value or as an empty text; JSON Schema allows none"
        if key == "$ref" and isinstance(value, str) and value != "#" and not value.startswith("#/"):
            return key, ", which follows only '#' and '#/...' pointers"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return key, ", which takes an allOf of one schema only"
        if shadow is not None:
            if key != shadow and not (key == "type" and shadow in ("const", "enum") and _typed_values(node)):
                return key, f", which reads only the {shadow!r} next to it"
            continue
        if not types:
            if key in NUMERIC | STRING | ARRAY | OBJECT and (key != "format" or fmt in FORMATS | FORMATS_IGNORED):
                return key, ", which applies it only under a 'type'"
            continue
        if key == "multipleOf" and _positive(value) and ("number" in types or "integer" in types and not _whole(value)):
            return key, f", which applies it only to integers, as a whole number up to {MAX_MULTIPLE_OF}"
        if "string" in types:
            if key == "pattern" and isinstance(value, str) and (construct := ignored_in_regex(value)) is not None:
                return key, f", which ignores {construct} in a pattern"
            if key == "format" and fmt in FORMATS_IGNORED:
                return key, f", which has no rule for the format {value!r}"
            if key == "pattern" and fmt in FORMATS:
                return key, f", which applies only the 'format' {fmt!r} next to it"
            if key in ("minLength", "maxLength") and ("pattern" in node or fmt in FORMATS):
                return key, ", which drops length limits next to a 'pattern' or a 'format'"
        if "object" in types and key == "required" and isinstance(value, list):
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            missing = next((name for name in value if isinstance(name, str) and name not in properties), None)
            if missing is not None:
                return key, f", which drops a required name not among its 'properties' ({str(missing)[:100]!r})"
    return None


def ignored_in_regex(pattern: str) -> str | None:
    """The first construct of a regex that xgrammar compiles without holding the output to it (it warns, and a
    pattern "^(?!a)[ab]{3}$" yields "abb"): a lookahead, or an escape it matches as the letter (\\A, \\Z, \\z,
    \\Q, \\E, \\G); None if there is none. A server also refuses whatever else xgrammar warns of as it compiles
    (toolkit.sampling.grammar_process)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1 : i + 2] in ("A", "Z", "z", "Q", "E", "G"):
                return f"the escape '{pattern[i : i + 2]}' (it matches the letter)"
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (pattern[i + 1 : i + 2] == "^")  # a "]" first in a class is a character
            i += pattern[i : i + 1] == "]"
            continue
        elif pattern.startswith(("(?=", "(?!"), i):
            return f"the lookahead {pattern[i : i + 3]!r}"
        i += 1
    return None


def _no_op(key: str, value: Any, node: dict) -> bool:
    """A constraint that allows everything anyway: nothing for xgrammar to drop."""
    if key in ("uniqueItems", "minLength", "minItems", "minProperties"):
        return not value and value is not None
    if key in ("required", "dependentRequired", "dependentSchemas", "dependencies", "properties", "patternProperties"):
        return value == [] or value == {}
    if key in ("then", "else"):  # their `if` is what is reported, or without it they do nothing
        return True
    if key == "if":
        return "then" not in node and "else" not in node
    if key in ("minContains", "maxContains"):  # without `contains` they do nothing; with it, it is reported
        return "contains" not in node
    return False


def _typed_values(node: dict) -> bool:
    """Every value of a const / enum is of the `type` next to it (a `type` xgrammar drops there, but need not keep)."""
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    values = [node["const"]] if "const" in node else node["enum"] if isinstance(node.get("enum"), list) else []
    return all(any(_is_type(v, t) for t in types) for v in values)


def _is_type(value: Any, kind: Any) -> bool:
    if kind == "integer":
        return _whole(value, limit=None)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "null": type(None), "array": list, "object": dict}
    return kind in kinds and isinstance(value, kinds[kind])


def _positive(value: Any) -> bool:
    """A number above 0 (xgrammar refuses any other multipleOf itself)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _whole(value: Any, limit: int | None = MAX_MULTIPLE_OF) -> bool:
    """An integer (1.0 too), positive and up to `limit` when there is one (xgrammar's multipleOf for integers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        return False
    return limit is None or 0 < value <= limit


def _pointed(root: dict, ref: Any) -> tuple[Any, Any] | None:
    """Where a '#/a/b' $ref points, as xgrammar follows it (object keys, no unescaping), with its path; None for
    '#' (the root, read already), another form, or a place that is not there (xgrammar refuses that itself)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node, path = root, None
    for part in filter(None, ref[2:].split("/")):
        if not isinstance(node, dict) or part not in node:
            return None
        node, path = node[part], (part, path)
    return node, path


def _dotted(path: Any) -> str:
    """A (key, parent) chain as a.b.c, its last 200 characters when longer."""
    parts = []
    while path is not None:
        parts.append(path[0])
        path = path[1]
    text = ".".join(reversed(parts))
    return text if len(text) <= 200 else "..." + text[-200:]
