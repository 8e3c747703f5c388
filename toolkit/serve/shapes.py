"""What a request's JSON costs to walk or compile, read before the work: a value's depth and size (the body's
nesting; a response_format schema's), and the text a schema's grammar holds."""

from __future__ import annotations

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


def schema_text(schema: Any) -> int:
    """Characters of the text a JSON schema's grammar holds (walked without recursion, once json_shape bounds it):
    property and definition names, enum and const values (nested too) and patterns, not keywords or annotations.
    xgrammar's compile of alternatives sharing a prefix grows with its length squared (docs/serving.md)."""
    chars, todo = 0, [(schema, "schema")]
    while todo:
        item, role = todo.pop()
        if isinstance(item, list):
            todo.extend((child, role) for child in item)
        elif isinstance(item, str):
            chars += len(item) if role == "literal" else 0
        elif isinstance(item, dict) and role == "schema":
            for key, child in item.items():
                if key == "pattern" and isinstance(child, str):
                    chars += len(child)
                else:
                    todo.append((child, "names" if key in NAMES else "literal" if key in LITERALS else "schema"))
        elif isinstance(item, dict):  # a names' map (its keys, then subschemas) or a literal object
            chars += sum(map(len, item))
            todo.extend((child, "schema" if role == "names" else role) for child in item.values())
    return chars
