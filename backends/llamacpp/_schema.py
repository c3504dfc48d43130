"""llama.cpp's structured-output rules: what its JSON-schema-to-grammar converter can follow.

``schema_problem(schema)`` names the first keyword the grammar cannot express (one sentence), so a request
is refused before a model loads; :func:`backends.llamacpp.source._grammar_for` builds the grammar itself.
"""

from __future__ import annotations

from typing import Any

SCHEMA_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
_NO_GRAMMAR = ("not", "if", "then", "else")  # keywords the JSON-schema-to-grammar converter cannot express
_SUB_SCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedItems")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def schema_problem(schema: Any, path: str = "") -> str | None:
    """The first thing in a JSON schema that the grammar constraining the output cannot express, as one
    sentence naming the keyword; None when the whole schema can be followed.

    >>> schema_problem({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    'the JSON schema keyword "not" (at properties.a) cannot be expressed by the grammar that constrains the output'
    >>> schema_problem({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}) is None
    True
    """
    where = f" (at {path})" if path else ""
    cannot = "cannot be expressed by the grammar that constrains the output"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a JSON schema{where} must be an object, not {type(schema).__name__}"
    for key in _NO_GRAMMAR:
        if key in schema:
            return f'the JSON schema keyword "{key}"{where} {cannot}'
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return (f'the JSON schema keyword "$ref"{where} may only point inside the schema (#/...), '
                f"not to {str(ref)[:60]!r}")
    kind = schema.get("type")
    for t in kind if isinstance(kind, list) else [kind] if kind is not None else []:
        if t not in SCHEMA_TYPES:
            return (f'the JSON schema keyword "type"{where} has {str(t)[:40]!r}, which is not one of '
                    f'{", ".join(SCHEMA_TYPES)}')
    pattern = schema.get("pattern")
    if pattern is not None and not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
        return (f'the JSON schema keyword "pattern"{where} must start with ^ and end with $ for the grammar to follow '
                f"it (got {str(pattern)[:60]!r})")
    dot = path + "." if path else ""
    for key in _SUB_SCHEMA:
        sub = schema.get(key)
        if isinstance(sub, dict) and (p := schema_problem(sub, dot + key)):
            return p
        if isinstance(sub, list) and key == "items":
            for i, x in enumerate(sub):
                if p := schema_problem(x, f"{dot}{key}[{i}]"):
                    return p
    for key in _SUB_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, x in enumerate(sub):
                if p := schema_problem(x, f"{dot}{key}[{i}]"):
                    return p
    for key in _SUB_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, x in sub.items():
                if p := schema_problem(x, f"{dot}{key}.{name}"):
                    return p
    return None

