"""Structured outputs over HTTP -> the SDK's keyword arguments (json_schema, regex, choice, json_object).

Accepted on /v1/chat/completions and /v1/completions, as OpenAI and vLLM spell them:
- OpenAI `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's extension fields `guided_json` (a schema, dict or JSON text), `guided_regex`,
  `guided_choice` (list of strings), and the newer `structured_outputs: {"json" | "regex" |
  "choice" | "json_object": ...}`.
At most one constraint per request: several, or a shape we do not know, is a 400 naming the field.
Whether a schema or regex compiles is the metadata service's call (INVALID_ARGUMENT -> 400 with
xgrammar's reason). Pure functions: no I/O."""
from __future__ import annotations

import json
from typing import Any

from .errors import REQUEST_PARAMS, bad_request

_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "json_object": "json_object"}
# vLLM's StructuredOutputsParams options: JSON is always compact here (disable_any_whitespace's
# effect, so whitespace_pattern has none); disable_additional_properties closes the schema's objects
_STRUCTURED_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _closed(schema):
    """disable_additional_properties: every object schema that says nothing of additionalProperties
    gets `false` (vLLM's option), walked keyword by keyword (a property's name is never a keyword)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed(sub) for name, sub in out[k].items()}
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_closed(sub) for sub in out[k]]
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = _closed(out[k])
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(value: Any, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
        except RecursionError:    # as the request body's own parse says it
            raise bad_request(f"{param} is not valid JSON: nested too deeply", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object, got {type(value).__name__}", param)
    return value


def _choice(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return value


def _regex(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return value


def _response_format(rf: dict) -> dict:
    kind = rf.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                              "response_format")
        return {"json_schema": _schema(spec["schema"], "response_format.json_schema.schema")}
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def _structured_outputs(so: Any) -> dict:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    given = {k: v for k, v in so.items() if v is not None and v is not False and k not in _STRUCTURED_OPTIONS}
    unknown = set(given) - set(_STRUCTURED_KEYS)
    if unknown:
        raise bad_request(f"structured_outputs: unsupported keys {sorted(unknown)} (supported: "
                          f"{sorted(_STRUCTURED_KEYS | dict.fromkeys(_STRUCTURED_OPTIONS))})", "structured_outputs")
    for k in ("disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(so.get(k, False), bool):
            raise bad_request(f"structured_outputs.{k} must be true or false", f"structured_outputs.{k}")
    if so.get("whitespace_pattern") is not None and not isinstance(so["whitespace_pattern"], str):
        raise bad_request("structured_outputs.whitespace_pattern must be a string", "structured_outputs.whitespace_pattern")
    out = {}
    for k, v in given.items():
        param = f"structured_outputs.{k}"
        out[_STRUCTURED_KEYS[k]] = {"json": _schema, "regex": _regex, "choice": _choice}[k](v, param) \
            if k != "json_object" else True
    if so.get("disable_additional_properties") and "json_schema" in out:
        try:
            out["json_schema"] = _closed(out["json_schema"])
        except RecursionError:
            raise bad_request("structured_outputs.json is nested too deeply", "structured_outputs.json") from None
    return out


def structured_kwargs(req) -> dict:
    """The request's constraint as SDK keyword arguments ({} when there is none)."""
    found: list[tuple[str, dict]] = []
    if req.response_format:
        if not isinstance(req.response_format, dict):
            raise bad_request("response_format must be an object", "response_format")
        kw = _response_format(req.response_format)
        if kw:
            found.append(("response_format", kw))
    if req.guided_json is not None:
        found.append(("guided_json", {"json_schema": _schema(req.guided_json, "guided_json")}))
    if req.guided_regex is not None:
        found.append(("guided_regex", {"regex": _regex(req.guided_regex, "guided_regex")}))
    if req.guided_choice is not None:
        found.append(("guided_choice", {"choice": _choice(req.guided_choice, "guided_choice")}))
    if req.structured_outputs is not None:
        kw = _structured_outputs(req.structured_outputs)
        found += [("structured_outputs", {k: v}) for k, v in kw.items()]
    if len(found) > 1:
        raise bad_request(f"give one structured-output constraint, got {', '.join(n for n, _ in found)}",
                          found[1][0])
    if not found:
        return {}
    name, kw = found[0]
    if name == "structured_outputs":
        name += "." + next(k for k, v in _STRUCTURED_KEYS.items() if v in kw)
    # the service's words for a constraint that does not compile name its kind: say the field
    REQUEST_PARAMS.set({**REQUEST_PARAMS.get(), "regex": name, "json_schema": name, "schema": name, "choice": name})
    return kw
