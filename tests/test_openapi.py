"""The OpenAPI document is a contract clients and gateways can use: valid, every reference
resolves, every operation documents the errors it answers in the error shape, and a 405 says
what the path takes. Then schemathesis holds a running front door to the document."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, settings
from hypothesis.errors import FlakyStrategyDefinition
from openapi_spec_validator import validate
from schemathesis import Case, CheckContext, CheckFunction, Response

from api.app import create_app
from api.batches.request import BATCH_BODY_SCHEMA
from api.chat_request import parse_chat_request, parse_completion_request, parse_messages_request
from api.deps import get_tenant
from api.openapi import COMPONENTS
from api.routes.admin import require_admin
from api.routes.sessions import parse_session_create
from broker.errors import InvalidParameter
from broker.natsserver import EmbeddedNats
from broker.settings import ApiSettings
from schemas.vocab import Tier
from tests.contract import contract_front_door, contract_toml
from tests.polling import READY_BOUND_S
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

TIERS = [tier.value for tier in Tier]
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
ERROR_SCHEMAS = {COMPONENTS + "ErrorBody", COMPONENTS + "AnthropicErrorBody"}


APP = create_app()
DOC = APP.openapi()


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method in METHODS:
                yield method.upper(), path, operation


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def test_the_document_is_valid_openapi() -> None:
    validate(DOC)


def test_every_reference_resolves_in_the_document() -> None:
    # openapi-spec-validator does not follow references inside schemas: a body schema's own
    # `#/$defs/...` passed it while no client could resolve it.
    found = set(refs(DOC))
    assert found, "the document references no schema at all"
    for ref in found:
        resolve(DOC, ref)


def test_every_operation_documents_its_errors_in_the_error_shape() -> None:
    authenticated = _authenticated(APP)
    for method, path, operation in operations(DOC):
        responses = operation["responses"]
        assert "422" not in responses, (method, path)  # validation errors are 400s
        assert "500" in responses, (method, path)
        if "requestBody" in operation:
            assert {"400", "413"} <= set(responses), (method, path)
        if operation.get("parameters"):
            assert "400" in responses or "404" in responses, (method, path)
        if (method, path) in authenticated:
            assert "401" in responses, (method, path)
        for status, response in responses.items():
            if int(status) < 400 or (path, status) == ("/readyz", "503"):
                continue
            content = response["content"]
            assert list(content) == ["application/json"], (method, path, status)
            assert content["application/json"]["schema"]["$ref"] in ERROR_SCHEMAS


def _authenticated(app: FastAPI, guard: Callable[..., Any] = get_tenant) -> set[tuple[str, str]]:
    """The (method, path) of every route whose dependencies name ``guard``."""
    return {
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        and any(dep.call is guard for dep in route.dependant.dependencies)
        for method in route.methods
    }


OPEN_OPERATIONS = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
}
"""What a load balancer, Prometheus and a client's model discovery read without a key."""


def test_every_operation_declares_the_key_it_needs() -> None:
    schemes = DOC["components"]["securitySchemes"]
    assert schemes["TenantKey"] | schemes["AdminToken"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schemes["AdminToken"]["description"],
    }
    assert schemes["AnthropicKey"] == {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": schemes["AnthropicKey"]["description"],
    }
    tenant, admin = _authenticated(APP), _authenticated(APP, require_admin)
    assert admin == {("GET", "/v1/admin/lag"), ("GET", "/v1/admin/workers")}
    assert "security" not in DOC  # no default: each operation says what it needs
    for method, path, operation in operations(DOC):
        # Alternatives: a tenant's key in either header.
        security = operation.get("security", [])
        if (method, path) in tenant:
            assert security == [{"TenantKey": []}, {"AnthropicKey": []}], (method, path)
        elif (method, path) in admin:
            assert security == [{"AdminToken": []}], (method, path)
        else:
            assert (method, path) in OPEN_OPERATIONS and not security, (method, path)
        if security:
            assert "401" in operation["responses"], (method, path)


def test_the_headers_kvgate_reads_are_parameters_where_it_reads_them() -> None:
    call_headers = {"X-Kvgate-Session", "X-Kvgate-Tier", "X-Kvgate-Timeout"}
    expected = {
        ("POST", "/v1/chat/completions"): call_headers,
        ("POST", "/v1/completions"): call_headers,
        ("POST", "/v1/messages"): call_headers,
        ("POST", "/v1/sessions"): {"Idempotency-Key"},
        ("POST", "/v1/batches"): {"Idempotency-Key"},
    }
    for method, path, operation in operations(DOC):
        headers = [p for p in operation.get("parameters", []) if p["in"] == "header"]
        assert {p["name"] for p in headers} == expected.get((method, path), set()), (method, path)
        for header in headers:
            assert header["required"] is False and header["description"], header
            assert header["schema"]["type"] in ("string", "number"), header
    tier = DOC["paths"]["/v1/chat/completions"]["post"]["parameters"]
    assert {"name": "X-Kvgate-Tier", "schema": {"type": "string", "enum": list(TIERS)}}.items() <= {
        k: v for p in tier if p["name"] == "X-Kvgate-Tier" for k, v in p.items()
    }.items()


def test_every_answer_to_wait_on_documents_its_retry_after() -> None:
    for method, path, operation in operations(DOC):
        for status in ("429", "503"):
            response = operation["responses"].get(status)
            if response is not None and path != "/readyz":
                assert "Retry-After" in response.get("headers", {}), (method, path, status)


@pytest.mark.parametrize(
    "field",
    [
        {"max_wait_s": False},
        {"deadline_s": True},
        {"idle_timeout_s": "30"},
        {"max_parallel": True},
        {"expected_calls": "2"},
        {"min_parallel": "1"},
    ],
)
def test_a_session_body_the_document_refuses_is_refused(field: dict[str, Any]) -> None:
    # Found by schemathesis: `"max_wait_s": false` was admitted as 0 s (pydantic's lax mode
    # takes a boolean or a numeric string for a number), where the document says a number.
    body = json.dumps({"tier": "standard", **field}).encode()
    with pytest.raises(InvalidParameter) as refused:
        parse_session_create(body)
    assert refused.value.param == next(iter(field))


def test_every_body_example_is_one_the_front_door_takes() -> None:
    settings = ApiSettings()

    def batch(body: bytes) -> None:
        submission = json.loads(body)
        jsonschema.validate(submission, BATCH_BODY_SCHEMA)
        for line in submission["requests"]:
            parse_chat_request(json.dumps(line["body"]).encode(), settings)

    takes: dict[str, Callable[[bytes], object]] = {
        "/v1/chat/completions": lambda body: parse_chat_request(body, settings),
        "/v1/completions": lambda body: parse_completion_request(body, settings),
        "/v1/messages": lambda body: parse_messages_request(body, settings),
        "/v1/sessions": parse_session_create,
        "/v1/batches": batch,
    }
    examples = {
        path: operation["requestBody"]["content"]["application/json"]["example"]
        for _, path, operation in operations(DOC)
        if "application/json" in operation.get("requestBody", {}).get("content", {})
    }
    assert set(examples) == set(takes)
    for path, example in examples.items():
        takes[path](json.dumps(example).encode())


def test_streaming_and_file_routes_document_their_content_types() -> None:
    def ok_types(path: str, method: str = "get") -> set[str]:
        return set(DOC["paths"][path][method]["responses"]["200"]["content"])

    for call in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        assert ok_types(call, "post") == {"application/json", "text/event-stream"}
    assert ok_types("/v1/batches/{batch_id}/results") == {"application/jsonl"}
    assert ok_types("/v1/files/{file_id}/content") == {"application/octet-stream"}
    assert ok_types("/metrics") == {"text/plain"}
    assert set(DOC["paths"]["/v1/files"]["post"]["requestBody"]["content"]) == {
        "multipart/form-data"
    }


async def test_a_405_names_every_method_its_path_takes() -> None:
    # Routing answers a 405 before any dependency runs: the app needs no lifespan for it.
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgate") as client:
        for path, item in DOC["paths"].items():
            documented = {method.upper() for method in item if method in METHODS}
            resp = await client.request("PATCH", path.replace("{", "x").replace("}", ""))
            assert resp.status_code == 405, path
            assert set(resp.headers["allow"].split(", ")) == documented, path
            assert resp.json()["error"]["code"] == "method_not_allowed"


# -- a running front door against its document -------------------------------------------------


SERVED_MODEL = "kvgate-dev"
"""The model a front door expects by default (``ApiSettings.served_model_name``)."""
TENANT_KEY = "sk-openapi-tenant"
ADMIN_TOKEN = "openapi-admin-token"
TENANT_AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    root: Path = tmp_path_factory.mktemp("nats")
    with EmbeddedNats(root / "store", log_file=root / "nats.log") as server:
        yield server


@pytest.fixture(scope="module")
def front_door(tmp_path_factory: pytest.TempPathFactory, nats: EmbeddedNats) -> Iterator[str]:
    """A front door with no worker: calls are deferred (503), everything else is served. It
    has a tenants file and an admin token, so that every key the document declares is needed.
    """
    root: Path = tmp_path_factory.mktemp("openapi")
    proc, base = contract_front_door(nats.url, root, TENANT_KEY, ADMIN_TOKEN)
    try:
        yield base
    finally:
        proc.stop()


@pytest.fixture
def served(front_door: str, nats: EmbeddedNats) -> Iterator[str]:
    """``front_door`` with a worker on the simulated engine serving its model, so that sessions
    are admitted and calls answered. The worker runs on an event loop of its own, in a thread:
    schemathesis' state machine calls the front door synchronously."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()
    failed: list[BaseException] = []
    engine = SimEngine(
        SimEngineConfig(served_model_name=SERVED_MODEL, step_s=0.001, kv_capacity_tokens=1 << 20)
    )

    async def serve() -> None:
        try:
            async with sim_worker(engine, nats.url, "openapi-sim", ready_at=front_door):
                started.set()
                await stop.wait()
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        started.wait(READY_BOUND_S + 15)
        assert started.is_set() and not failed, failed
        yield front_door
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


async def test_the_front_door_serves_this_document(front_door: str) -> None:
    async with httpx.AsyncClient(base_url=front_door) as client:
        resp = await client.get("/openapi.json")
    assert resp.json() == DOC


@pytest.mark.parametrize("query", ["completion_window=", "completion_window=7d", "tier=gold"])
async def test_a_batch_option_the_document_refuses_is_refused_where_the_body_names_it_too(
    front_door: str, query: str
) -> None:
    # Found by schemathesis: the body's option replaced the query's before either was read, so
    # an invalid query option was taken (201) whenever the body named a valid one.
    chat = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Say hello."}]}
    body = {
        "requests": [{"custom_id": "q1", "body": chat}],
        "completion_window": "24h",
        "tier": "besteffort",
    }
    async with httpx.AsyncClient(base_url=front_door, headers=TENANT_AUTH) as client:
        resp = await client.post(f"/v1/batches?{query}", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == query.split("=")[0]


CONTRACT = schemathesis.Config.from_str(contract_toml(TENANT_KEY, ADMIN_TOKEN))
# Batch lines uploaded as JSONL are text.
schemathesis.serializer.alias("application/jsonl", "text/plain")

# Built at import: schemathesis makes one test per operation at collection. Its fixture-loaded
# schema (`schemathesis.pytest.from_fixture`) does not run under pytest 9.
schema = schemathesis.openapi.from_dict(copy.deepcopy(DOC), config=CONTRACT)


@schema.parametrize()
@settings(
    max_examples=25,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_the_front_door_keeps_its_documented_contract(case: Case[Any], front_door: str) -> None:
    case.call_and_validate(base_url=front_door, timeout=30, additional_checks=[the_key_is_sent])


def the_key_is_sent(ctx: CheckContext, response: Response, case: Case[Any]) -> None:
    """The keys in ``CONTRACT`` reach the operations that declare them and are taken (else
    every secured operation would be tested only for refusing a caller); a case that leaves
    its key out or spoils it on purpose (a negative one) is refused."""
    sent = response.request.headers.get("Authorization")
    if case.operation.definition.raw.get("security"):
        keyed = sent in (f"Bearer {TENANT_KEY}", f"Bearer {ADMIN_TOKEN}")
        assert (response.status_code == 401) is not keyed, (sent, response.text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
async def test_a_call_whose_own_timeout_passes_before_it_starts_is_a_504(
    served: str, path: str
) -> None:
    # Found by schemathesis: with X-Kvgate-Timeout 5e-324 a call sent without a session was
    # answered 410 session_expired, naming the one-call session the caller never saw.
    body = {"model": SERVED_MODEL, "max_tokens": 4}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": _SAY_HI}
    async with httpx.AsyncClient(base_url=served, headers=TENANT_AUTH) as client:
        resp = await client.post(path, json=body, headers={"X-Kvgate-Timeout": "5e-324"})
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "deadline_exceeded"
    assert resp.headers["Retry-After"] == "1"


_SAY_HI = [{"role": "user", "content": "Hi"}]


STATEFUL = settings(
    max_examples=30,
    stateful_step_count=8,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def test_the_front_door_keeps_its_contract_across_linked_calls(served: str) -> None:
    """Schemathesis' stateful phase: sequences of calls chained by the document's links (a
    session created, then inspected, called in and closed; a batch followed, cancelled and
    collected; a file read and deleted, or run as a batch), every check after every step."""
    # Its own copy: the state machine adds the links it infers to the schema it is built from.
    machine = schemathesis.openapi.from_dict(copy.deepcopy(DOC), config=CONTRACT)

    class Linked(machine.as_state_machine()):  # type: ignore[misc]
        opened: list[str]
        scenarios = 0

        def setup(self) -> None:
            self.opened = []

        def get_call_kwargs(self, case: Case[Any]) -> dict[str, Any]:
            return {"base_url": served, "timeout": 30}

        def after_call(self, response: Response, case: Case[Any]) -> None:
            super().after_call(response, case)
            if (case.method, case.path) == ("POST", "/v1/sessions") and response.status_code < 300:
                self.opened.append(response.json()["id"])

        def teardown(self) -> None:
            # Each scenario starts from the fleet as the last one found it: its sessions'
            # reservations go back (the sessions stay, closed).
            with httpx.Client(base_url=served, headers=TENANT_AUTH) as client:
                for session_id in self.opened:
                    assert client.delete(f"/v1/sessions/{session_id}").status_code == 200
            super().teardown()
            Linked.scenarios += 1

        def validate_response(
            self,
            response: Response,
            case: Case[Any],
            additional_checks: list[CheckFunction] | None = None,
            **kwargs: Any,
        ) -> None:
            checks = [*(additional_checks or ()), the_key_is_sent]
            super().validate_response(response, case, additional_checks=checks, **kwargs)

    # The front door's admission moves with what ran before it (reservations, objectives,
    # the worker's load), so a replayed scenario may find a step answered otherwise and
    # Hypothesis stops the run (FlakyStrategyDefinition): not a failure of the contract, and
    # schemathesis' own runner counts it as none. The run starts again until enough scenarios
    # ran; a check that fails, or a failure that does not repeat (FlakyFailure), still fails.
    for _ in range(3):
        try:
            Linked.run(settings=STATEFUL)
            break
        except FlakyStrategyDefinition:
            continue
    assert Linked.scenarios >= STATEFUL.max_examples, Linked.scenarios


def test_every_link_names_an_operation_and_its_parameters() -> None:
    links = [
        (source, name, link)
        for _, source, operation in operations(DOC)
        for response in operation["responses"].values()
        for name, link in response.get("links", {}).items()
    ]
    assert {name for _, name, _ in links} >= {
        "GetSession",
        "CloseSession",
        "ChatInSession",
        "CompletionInSession",
        "MessageInSession",
        "GetBatch",
        "CancelBatch",
        "BatchResults",
        "GetFile",
        "FileContent",
        "DeleteFile",
        "BatchFromFile",
    }
    for source, name, link in links:
        target = resolve(DOC, link["operationRef"])
        taken = {f"{p['in']}.{p['name']}" for p in target.get("parameters", [])}
        for parameter, expression in link.get("parameters", {}).items():
            qualified = parameter if "." in parameter else f"path.{parameter}"
            assert qualified in taken, (source, name, parameter)
            assert expression == "$response.body#/id", (source, name)
