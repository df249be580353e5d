"""The OpenAPI document (``/openapi.json``): what each route takes and answers, exactly.

The routes that take a body read it themselves (``api/bodies.py``), so FastAPI sees neither
the body nor the errors a route answers: each route declares them with these helpers,
``json_body(Model)`` as its ``openapi_extra`` and ``error_responses(*codes)`` in its
``responses`` (one response per HTTP status its codes map to in ``api/errors.py``, in OpenAI's
error shape, or Anthropic's on ``/v1/messages``).

``install_openapi`` then mends two things FastAPI's generator leaves in the document:

- a body schema's ``$defs``: ``#/$defs/X`` resolves only inside the body schema, which client
  generators and validators do not read as a document of its own. The definitions move to
  ``components/schemas`` and their references with them; so does the body schema itself, under
  its title, so that a client generator names its class.
- the 422 FastAPI documents for every route with a parameter: the front door answers a request
  that fails validation with 400 ``invalid_request`` (``api/errors.py``), never 422.

A schema name given twice with two meanings is refused when the document is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from api.errors import STATUS_BY_CODE
from broker.errors import KvgateError, Refused, RetryableError, error_class
from schemas.openai import AnthropicErrorBody, ErrorBody
from schemas.vocab import ErrorCode

COMPONENTS = "#/components/schemas/"
_LOCAL_DEFS = "#/$defs/"
_FASTAPI_422 = ("HTTPValidationError", "ValidationError")

ERROR_BODIES: tuple[type[BaseModel], ...] = (ErrorBody, AnthropicErrorBody)
"""The error shapes: OpenAI's, and Anthropic's on ``/v1/messages``."""
Responses = dict[int | str, dict[str, Any]]
"""What a route's ``responses=`` takes."""

RETRY_AFTER_HEADER = {
    "Retry-After": {
        "description": "Seconds after which the same request may succeed; equal to the "
        "body's `retry_after`.",
        "schema": {"type": "integer", "minimum": 0},
    },
    "x-should-retry": {
        "description": "`true` where `Retry-After` is given (waiting helps), `false` on every "
        "other kvgate error: the official OpenAI SDKs retry by it.",
        "schema": {"type": "string", "enum": ["true", "false"]},
    },
}


def header(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """An optional request header a route reads itself, as an operation parameter (in a
    route's ``openapi_extra``, under ``parameters``)."""
    return {
        "name": name,
        "in": "header",
        "required": False,
        "schema": schema,
        "description": description,
    }


def link(
    method: str,
    path: str,
    description: str,
    parameters: dict[str, str] | None = None,
    request_body: Any = None,
) -> dict[str, Any]:
    """An OpenAPI link from a response to the operation ``method path``: what a client (and
    schemathesis' stateful tests) may call next with what the response holds.
    ``parameters`` maps the target's parameters (``header.<name>`` for a header) to runtime
    expressions such as ``$response.body#/id``."""
    pointer = path.replace("~", "~0").replace("/", "~1")
    found: dict[str, Any] = {
        "operationRef": f"#/paths/{pointer}/{method.lower()}",
        "description": description,
    }
    if parameters:
        found["parameters"] = parameters
    if request_body is not None:
        found["requestBody"] = request_body
    return found


def codes_below(group: type[KvgateError]) -> tuple[ErrorCode, ...]:
    """The codes of ``group`` and of every class below it in the error tree."""
    found: list[ErrorCode] = []
    todo = [group]
    while todo:
        cls = todo.pop(0)
        code = cls.__dict__.get("code")
        if code is not None:
            found.append(code)
        todo.extend(cls.__subclasses__())
    return tuple(found)


def json_body(model: type[BaseModel], example: dict[str, Any]) -> dict[str, Any]:
    """A route's ``openapi_extra`` for a required JSON body that ``model`` describes, with an
    ``example`` the route takes (what a reader copies first, and what schemathesis' examples
    phase sends)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": model.model_json_schema(), "example": example}
            },
        }
    }


def error_responses(*codes: ErrorCode, body: type[BaseModel] = ErrorBody) -> Responses:
    """One documented response per HTTP status of ``codes`` (and of ``internal_error``, which
    any route may answer), its description naming the codes, with ``Retry-After`` where a
    code's class may carry it. ``body`` is one of ``ERROR_BODIES``.

    The content is given, not left to FastAPI (``"model": body``), because FastAPI would
    document an error in the route's own media type (``text/plain`` on ``/metrics``); errors
    are JSON everywhere."""
    if body not in ERROR_BODIES:
        raise ValueError(f"{body.__name__} is not one of {ERROR_BODIES}")
    ref = COMPONENTS + body.__name__
    by_status: dict[int, list[ErrorCode]] = {}
    for code in dict.fromkeys((*codes, ErrorCode.INTERNAL_ERROR)):
        by_status.setdefault(STATUS_BY_CODE[code], []).append(code)
    responses: Responses = {}
    for status, found in sorted(by_status.items()):
        response: dict[str, Any] = {
            "content": {"application/json": {"schema": {"$ref": ref}}},
            "description": "Error codes: " + ", ".join(f"`{code.value}`" for code in found),
        }
        if any(
            issubclass(error_class(code, KvgateError), Refused | RetryableError) for code in found
        ):
            response["headers"] = RETRY_AFTER_HEADER
        responses[status] = response
    return responses


def install_openapi(app: FastAPI) -> None:
    """Serve ``app``'s document mended as the module docstring says (built once, on first
    use)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = mended(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def mended(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (changed in place) with body schemas hoisted, the error bodies in its
    components, and FastAPI's 422s dropped."""
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for body in ERROR_BODIES:
        _hoisted(body.model_json_schema(), schemas)
    for operation in _operations(doc):
        for media in operation.get("requestBody", {}).get("content", {}).values():
            if "schema" in media:
                media["schema"] = _hoisted(media["schema"], schemas)
        operation["responses"].pop("422", None)
    for name in _FASTAPI_422:
        schemas.pop(name, None)
    return doc


def _operations(doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for path_item in doc.get("paths", {}).values():
        yield from path_item.values()


def _hoisted(schema: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` moved to ``schemas``; a titled object schema moves there
    too, and a reference to it is returned."""
    schema = _rereferenced(schema)
    for name, definition in schema.pop("$defs", {}).items():
        _add(schemas, name, definition)
    title = schema.get("title")
    if isinstance(title, str) and schema.get("type") == "object":
        _add(schemas, title, schema)
        return {"$ref": COMPONENTS + title}
    return schema


def _rereferenced(node: Any) -> Any:
    """``node`` with every ``#/$defs/X`` reference pointing at ``components/schemas`` instead."""
    if isinstance(node, dict):
        return {
            key: COMPONENTS + value.removeprefix(_LOCAL_DEFS)
            if key == "$ref" and isinstance(value, str) and value.startswith(_LOCAL_DEFS)
            else _rereferenced(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rereferenced(item) for item in node]
    return node


def _add(schemas: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
    known = schemas.setdefault(name, schema)
    if known != schema:
        raise ValueError(f"two different schemas are named {name!r} in the OpenAPI document")
