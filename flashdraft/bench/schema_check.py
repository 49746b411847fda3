"""Does an answer parse as JSON and satisfy its schema? Checked apart from the grammar engine.

The bench counts violations of constrained answers with this checker rather than with
llguidance itself, so a bug in how a schema becomes a grammar would show up as a
violation instead of being checked by the same code that produced it. It covers the JSON
Schema keywords the bench's schemas use; :func:`unsupported_keywords` lists any others, so
a prompt file with a schema this checker cannot judge is refused up front instead of
passing unchecked.
"""

from __future__ import annotations

import json
import re

#: keywords that only annotate a schema (nothing to check)
ANNOTATIONS = {"title", "description", "$schema", "$id", "default", "examples", "$comment"}
CHECKED = {"type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems",
           "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
           "multipleOf", "pattern", "anyOf", "oneOf", "allOf"}


def unsupported_keywords(schema: dict) -> set[str]:
    """Keywords anywhere in ``schema`` that :func:`violation` does not check."""
    found = set(schema) - CHECKED - ANNOTATIONS
    subs = list((schema.get("properties") or {}).values())
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            subs.append(schema[key])
    for key in ("anyOf", "oneOf", "allOf"):
        subs += schema.get(key) or []
    for sub in subs:
        found |= unsupported_keywords(sub)
    return found


def check_answer(text: str, schema: dict) -> str | None:
    """None when ``text`` is one JSON value satisfying ``schema``, else why not (one line)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    return violation(value, schema)


def _type_ok(value, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}
    if name not in kinds:
        raise ValueError(f"unknown JSON schema type {name!r}")
    return isinstance(value, kinds[name])


def violation(value, schema: dict, path: str = "$") -> str | None:
    """None when the parsed ``value`` satisfies ``schema``, else the first failure with its
    JSON path (``$.items[2].price: 12 > maximum 10``).

    Raises:
        ValueError: an unknown ``type`` name in the schema.
    """
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, n) for n in names):
            return f"{path}: {type(value).__name__} is not {'/'.join(names)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        return f"{path}: {value!r} is not {schema['const']!r}"
    for check in (_number, _string, _array, _object, _combined):
        why = check(value, schema, path)
        if why:
            return why
    return None


def _number(value, schema: dict, path: str) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    for key, bad in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b),
                     ("exclusiveMinimum", lambda v, b: v <= b), ("exclusiveMaximum", lambda v, b: v >= b)):
        if key in schema and bad(value, schema[key]):
            return f"{path}: {value} breaks {key} {schema[key]}"
    if "multipleOf" in schema:
        steps = value / schema["multipleOf"]
        # 0.29 / 0.01 is 28.999999999999996 in binary floating point: allow that much
        if abs(steps - round(steps)) > 1e-9 * max(1.0, abs(steps)):
            return f"{path}: {value} is not a multiple of {schema['multipleOf']}"
    return None


def _string(value, schema: dict, path: str) -> str | None:
    if not isinstance(value, str):
        return None
    if len(value) < schema.get("minLength", 0):
        return f"{path}: shorter than minLength {schema['minLength']}"
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        return f"{path}: longer than maxLength {schema['maxLength']}"
    if "pattern" in schema and not re.search(schema["pattern"], value):
        return f"{path}: {value!r} does not match {schema['pattern']!r}"
    return None


def _array(value, schema: dict, path: str) -> str | None:
    if not isinstance(value, list):
        return None
    if len(value) < schema.get("minItems", 0):
        return f"{path}: fewer than minItems {schema['minItems']}"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{path}: more than maxItems {schema['maxItems']}"
    if isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            why = violation(item, schema["items"], f"{path}[{i}]")
            if why:
                return why
    return None


def _object(value, schema: dict, path: str) -> str | None:
    if not isinstance(value, dict):
        return None
    props = schema.get("properties") or {}
    for key in schema.get("required") or []:
        if key not in value:
            return f"{path}: missing required {key!r}"
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            why = violation(item, props[key], f"{path}.{key}")
        elif extra is False:
            why = f"{path}: unexpected key {key!r}"
        elif isinstance(extra, dict):
            why = violation(item, extra, f"{path}.{key}")
        else:
            why = None
        if why:
            return why
    return None


def _combined(value, schema: dict, path: str) -> str | None:
    if "allOf" in schema:
        for sub in schema["allOf"]:
            why = violation(value, sub, path)
            if why:
                return why
    if "anyOf" in schema and all(violation(value, sub, path) for sub in schema["anyOf"]):
        return f"{path}: matches none of anyOf"
    if "oneOf" in schema and sum(violation(value, sub, path) is None for sub in schema["oneOf"]) != 1:
        return f"{path}: does not match exactly one of oneOf"
    return None
