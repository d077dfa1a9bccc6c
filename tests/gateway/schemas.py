"""Validators for the OpenAI API description (``/work/shared/openai/openapi.json``, see its README).

The description still uses OpenAPI 3.0 ``nullable: true``, which JSON Schema 2020-12 ignores; it is rewritten
to ``type: [X, "null"]`` (and ``None`` added to an ``enum``) before validating. The spec sits in a
``referencing.Registry`` under a URN; each validator checks
``{"$ref": "urn:openai#/components/schemas/NAME"}``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(os.environ.get("ETHEN_OPENAPI", "/work/shared/openai/openapi.json"))
_URN = "urn:openai"

__all__ = ["SPEC_PATH", "validator"]


def _denull(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _denull(v) for k, v in node.items()}
        if out.pop("nullable", False) is True:
            t = out.get("type")
            if isinstance(t, str):
                out["type"] = [t, "null"]
            elif isinstance(t, list) and "null" not in t:
                out["type"] = [*t, "null"]
            elif t is None and ("anyOf" in out or "oneOf" in out or "allOf" in out or "$ref" in out):
                out = {"anyOf": [out, {"type": "null"}]}
            if isinstance(out.get("enum"), list) and None not in out["enum"]:
                out["enum"] = [*out["enum"], None]
        return out
    if isinstance(node, list):
        return [_denull(v) for v in node]
    return node


def _response_usage_nullable(spec: dict[str, Any]) -> None:
    """``Response.usage`` may be null: OpenAI's own streams send ``"usage": null`` until it is known, and the
    Open Responses schema (llm-comply's) requires the key with a null value there; the description only
    marks it optional."""
    for part in spec["components"]["schemas"]["Response"]["allOf"]:
        props = part.get("properties", {})
        if "usage" in props:
            props["usage"] = {"anyOf": [props["usage"], {"type": "null"}]}


@functools.cache
def _registry() -> Registry:
    spec = _denull(json.loads(SPEC_PATH.read_text()))
    _response_usage_nullable(spec)
    return Registry().with_resource(_URN, Resource.from_contents(spec, default_specification=DRAFT202012))


@functools.cache
def validator(name: str) -> Draft202012Validator:
    """A validator for ``components/schemas/<name>``."""
    return Draft202012Validator({"$ref": f"{_URN}#/components/schemas/{name}"}, registry=_registry())
