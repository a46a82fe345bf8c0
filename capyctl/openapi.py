"""OpenAPI 3.1 documents built from pydantic models.

Each side (the management API, the proxy) lists its operations as :class:`Operation` values;
:func:`document` turns them into one OpenAPI 3.1 document whose schemas are pydantic's own JSON
Schema (2020-12, the dialect OpenAPI 3.1 uses), collected under ``components/schemas``. Every
operation lists the error statuses its handler really answers, so a client (and schemathesis,
in tests/unit/test_openapi.py) can rely on "a status not listed is a bug".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"

# Why each error status is answered, for the response descriptions.
STATUS_TEXT = {
    200: "OK", 201: "Created", 302: "Found", 400: "The request is invalid", 401: "No valid credential",
    403: "The credential may not do this", 404: "No such object", 405: "Method not allowed",
    409: "Conflicts with the current state", 413: "The body is too large", 422: "The content is invalid",
    429: "Too many requests are waiting", 500: "Internal error", 502: "systemd, an engine or a host failed",
    503: "Not available now", 504: "A host or engine did not answer in time",
}


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str
    message: str
    detail: dict[str, Any] | None = None


class ErrorResponse(BaseModel):
    """Every error: a stable snake_case code and a human sentence."""
    error: ErrorDetail


Schema = type[BaseModel] | dict[str, Any] | None


@dataclass
class Response:
    description: str | None = None
    schema: Schema = None
    media_type: str = "application/json"


@dataclass
class Operation:
    method: str
    path: str
    summary: str
    tag: str
    responses: dict[int | str, Response | Schema]  # a status, or "default" for any other
    request: Schema = None
    request_media_type: str = "application/json"
    request_required: bool = True
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)
    security: list[dict[str, list[str]]] | None = None  # None: the document's default
    description: str | None = None


def _models(operations: list[Operation]) -> list[type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {}

    def add(schema: Schema) -> None:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            found.setdefault(schema.__name__, schema)

    for op in operations:
        add(op.request)
        for response in op.responses.values():
            add(response.schema if isinstance(response, Response) else response)
    return list(found.values())


def document(*, title: str, version: str, description: str, operations: list[Operation],
             security_schemes: dict[str, dict[str, Any]], security: list[dict[str, list[str]]]) -> dict:
    """The OpenAPI 3.1 document of ``operations``."""
    models = _models(operations)
    # Requests are validated (input mode), answers are serialized (output mode): pydantic writes
    # both schemas where they differ.
    keys = [(m, "validation") for m in models] + [(m, "serialization") for m in models]
    refs, defs = models_json_schema(keys, ref_template=REF)
    components = dict(defs.get("$defs", {}))

    def schema_of(schema: Schema, mode: str) -> dict[str, Any]:
        if schema is None:
            return {}
        if isinstance(schema, dict):
            return schema
        return refs[(schema, mode)]

    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {"summary": op.summary, "tags": [op.tag],
                                 "operationId": _operation_id(op.method, op.path)}
        if op.description:
            entry["description"] = op.description
        parameters = [{"name": name, "in": "path", "required": True,
                       "schema": {"type": "string", "minLength": 1, "pattern": r"^[^/]+$"}}
                      for name in re.findall(r"\{([^}]+)\}", op.path)]
        parameters += [{"name": name, "in": "query", "required": False, "schema": schema}
                       for name, schema in op.query.items()]
        parameters += [{"name": name, "in": "header", "required": False, "schema": schema}
                       for name, schema in op.headers.items()]
        if parameters:
            entry["parameters"] = parameters
        if op.request is not None:
            entry["requestBody"] = {"required": op.request_required,
                                    "content": {op.request_media_type: {"schema": schema_of(op.request, "validation")}}}
        responses = {}
        for status, response in sorted(op.responses.items(), key=lambda item: str(item[0])):
            if not isinstance(response, Response):
                response = Response(schema=response)
            body: dict[str, Any] = {"description": response.description or STATUS_TEXT.get(status, str(status))}
            if response.schema is not None:
                body["content"] = {response.media_type: {"schema": schema_of(response.schema, "serialization")}}
            responses[str(status)] = body
        entry["responses"] = responses
        if op.security is not None:
            entry["security"] = op.security
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": security_schemes},
        "security": security,
    }


def _operation_id(method: str, path: str) -> str:
    words = [w.strip("{}").replace("-", "_").replace(".", "_") for w in path.strip("/").split("/") if w]
    return "_".join([method.lower(), *words]) or method.lower()
