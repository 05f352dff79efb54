"""Whether a JSON schema allows a finite JSON value: a schema whose references only lead back to themselves (`{"$ref":
"#/$defs/a"}` with `a` referring to `a`), or require a value inside itself (an object whose required property is the
object again, an array of at least one of itself), allows none, and output under it could never end.

The grammar library compiles such a schema without complaint; generation under it then either finds no token to
write or writes forever. This check runs before a grammar is built: each local reference is productive where its
schema can be met by a finite value once the productive references are known, found by iterating from none to a fixed
point (the productive nonterminals of a grammar). It is lenient where it cannot tell (remote references, keywords it
does not follow count as satisfiable): it refuses only what certainly cannot end, and the library refuses what it
finds unsatisfiable itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote


def endless_reference(schema: Any) -> str | None:
    """The first local reference (in document order) through which `schema` allows no finite value, or "#" where the
    schema itself allows none without one; None where a finite value may satisfy it."""
    references = list(dict.fromkeys(_references(schema)))
    productive: set[str] = set()
    grown = True
    while grown:
        grown = False
        for reference in references:
            if reference not in productive and _finite(_resolve(schema, reference), productive, schema):
                productive.add(reference)
                grown = True
    if _finite(schema, productive, schema):
        return None
    return next((r for r in _references(schema) if r not in productive and _local(schema, r)), "#")


def _references(node: Any) -> Iterator[str]:
    """Every local `$ref` in the schema, in document order."""
    if isinstance(node, dict):
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith("#"):
            yield reference
        for value in node.values():
            yield from _references(value)
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)


def _local(root: Any, reference: Any) -> bool:
    """Whether `reference` points into the schema itself (a remote or dangling one is the library's to judge)."""
    return isinstance(reference, str) and reference.startswith("#") and _resolve(root, reference) is not None


def _resolve(root: Any, reference: str) -> Any:
    """The schema a local reference points to (a JSON pointer after '#'), or None where it points nowhere."""
    node = root
    for part in reference[1:].split("/")[1:] if reference != "#" else ():
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _finite(node: Any, productive: set[str], root: Any) -> bool:
    """Whether a finite value may satisfy `node`, its local references counted as satisfiable where productive."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True  # `true`, or something the library judges
    reference = node.get("$ref")
    if _local(root, reference) and reference not in productive:
        return False
    if "const" in node or "enum" in node:
        return True  # given values: finite
    every = [_finite(part, productive, root) for part in _schemas(node, "allOf")]
    some = [[_finite(part, productive, root) for part in _schemas(node, key)] for key in ("anyOf", "oneOf")]
    if not all(every) or any(parts and not any(parts) for parts in some):
        return False
    kinds = node.get("type")
    if kinds is None:
        return True  # any type: a value of another type than the keywords constrain
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(_finite_of_type(node, kind, productive, root) for kind in kinds)


def _finite_of_type(node: dict[str, Any], kind: Any, productive: set[str], root: Any) -> bool:
    """Whether a finite value of JSON type `kind` may satisfy `node`: an object's required properties and an array's
    leading items must allow one."""
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        other = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_finite(properties.get(name, other), productive, root) for name in required if isinstance(name, str))
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = node.get("prefixItems")
        prefix = (
            prefix if isinstance(prefix, list) else node.get("items") if isinstance(node.get("items"), list) else []
        )
        rest = node.get("additionalItems", True) if isinstance(node.get("items"), list) else node.get("items", True)
        needed = [prefix[i] if i < len(prefix) else rest for i in range(min(least, len(prefix) + 1))]
        return all(_finite(item, productive, root) for item in needed)
    return True


def _schemas(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []
