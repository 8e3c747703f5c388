"""What a request's JSON costs to walk or compile, read before the work: a value's depth and size (the body's
nesting; a response_format schema's), and the text a schema's grammar holds."""

from __future__ import annotations

import math
import re
import re._parser as _sre  # Python's own regex parser: what a pattern's repeats are
from collections.abc import Iterator
from typing import Any


def json_shape(value: Any, max_depth: int, max_nodes: int) -> tuple[int, int]:
    """(depth, nodes) of a parsed JSON value, walked a level at a time without recursion (a hostile value may be
    deep) and no further than the level past either bound (a hostile value may be large). No object is made per
    node: a million empty lists cost one pass over them, not a million tuples for the collector to scan."""
    depth, nodes, level = 0, 0, [value]
    while level and depth <= max_depth and nodes <= max_nodes:
        depth, nodes, below = depth + 1, nodes + len(level), []
        for item in level:
            if isinstance(item, dict):
                below.extend(item.values())
            elif isinstance(item, list):
                below.extend(item)
            if nodes + len(below) > max_nodes:
                break
        level = below
    return depth, nodes


NAMES, LITERALS = frozenset({"properties", "patternProperties", "$defs", "definitions"}), frozenset({"enum", "const"})


def schema_strings(schema: Any) -> Iterator[tuple[str, str]]:
    """(what, text) for each text a JSON schema's grammar holds, walked without recursion once json_shape bounds it:
    "pattern" (a `pattern`, or a patternProperties key), "name" (a property or definition name), "literal" (an
    enum or const value, nested too, or a key inside one); not keywords or annotations."""
    todo = [(schema, "schema")]
    while todo:
        item, role = todo.pop()
        if isinstance(item, list):
            todo.extend((child, role) for child in item)
        elif isinstance(item, str) and role == "literal":
            yield "literal", item
        elif isinstance(item, dict) and role == "schema":
            for key, child in item.items():
                if key == "pattern" and isinstance(child, str):
                    yield "pattern", child
                else:
                    todo.append((child, key if key in NAMES else "literal" if key in LITERALS else "schema"))
        elif isinstance(item, dict):  # a names' map (its keys, then subschemas) or a literal object
            what = "pattern" if role == "patternProperties" else "literal" if role == "literal" else "name"
            yield from ((what, key) for key in item)
            todo.extend((child, "literal" if role == "literal" else "schema") for child in item.values())


def schema_text(schema: Any) -> int:
    """Characters of the text a JSON schema's grammar holds (schema_strings'). xgrammar's compile of alternatives
    sharing a prefix grows with its length squared (docs/serving.md)."""
    return sum(len(text) for _, text in schema_strings(schema))


def schema_patterns(schema: Any) -> list[str]:
    """The regular expressions a JSON schema holds: each `pattern`, and each patternProperties key."""
    return [text for what, text in schema_strings(schema) if what == "pattern"]


def schema_pattern_cost(schema: Any) -> int:
    """What a JSON schema's patterns cost to compile together (pattern_cost's sum)."""
    return sum(map(pattern_cost, schema_patterns(schema)))


def pattern_cost(pattern: str) -> int:
    """About the states xgrammar's JSON-schema compile makes of a `pattern` (its milliseconds, measured): E x V^1.25,
    E the positions its bounded repeats expand to ({m,n}: n copies of its body; + and *: loops, one copy) and V
    the product of the counts of the repeats of variable count over a body of variable length, nested (each
    such repeat multiplies the ambiguity the compile resolves). Measured on AMD EPYC (avx2 avx512f ):
    [a-z]{1,100} 0.10 s; ([a-z]{1,k}){1,k} 0.68 / 1.34 / 9.75 s at k = 8 / 10 / 20; (([a-z]{1,k}){1,k}){1,k}
    2.3 / 17.8 s at k = 4 / 6, where the compile of any regex alone (compile_regex) takes milliseconds. A pattern
    Python's parser cannot read (ECMA syntax it lacks) counts as its length times every repeat count in it."""
    try:
        parsed = _sre.parse(re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern))
    except (re.error, RecursionError, OverflowError, ValueError):
        bounds = [int(n or m) for m, n in re.findall(r"\{(\d{1,6})(?:,(\d{0,6}))?\}", pattern)]
        return len(pattern) * math.prod(max(b, 1) for b in bounds)
    positions, _, _, ambiguity = _expanded(parsed)
    return int(positions * ambiguity**1.25)


def _expanded(items) -> tuple[int, int, float, int]:
    """(positions, shortest, longest, nested ambiguity) of a parsed regex sequence (pattern_cost)."""
    positions, shortest, longest, ambiguity = 0, 0, 0.0, 1
    for op, arg in items:
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            low, high, body = arg
            p, s, most, a = _expanded(body)
            bounded = high != _sre.MAXREPEAT
            positions += (high if bounded else max(low, 1)) * p
            shortest, longest = shortest + low * s, longest + (high * most if bounded else math.inf)
            ambiguity = max(ambiguity, high * a if bounded and high > low and s != most else a)
        elif op is _sre.BRANCH:
            parts = [_expanded(branch) for branch in arg[1]]
            positions += sum(p for p, _, _, _ in parts)
            shortest += min(s for _, s, _, _ in parts)
            longest += max(most for _, _, most, _ in parts)
            ambiguity = max(ambiguity, *(a for _, _, _, a in parts))
        elif op is _sre.SUBPATTERN or op in (_sre.ASSERT, _sre.ASSERT_NOT):
            p, s, most, a = _expanded(arg[-1])
            inside = op is _sre.SUBPATTERN
            positions, ambiguity = positions + p, max(ambiguity, a)
            shortest, longest = shortest + (s if inside else 0), longest + (most if inside else 0)
        elif op not in (_sre.AT,):  # a character, a class, any: one position
            positions, shortest, longest = positions + 1, shortest + 1, longest + 1
    return positions, shortest, longest, ambiguity
