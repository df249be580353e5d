"""The API contract both schemathesis runs hold kvgate to (``tests/test_openapi.py``, bounded,
in the suite; ``python -m tests.fuzz``, long): its configuration, one text for both."""

from __future__ import annotations

from pathlib import Path

from broker.procs import Proc
from tests.procs import start_api
from tests.tenants import tenant, write_tenants_file

_CONTRACT = """
[auth.openapi.TenantKey]
bearer = "{tenant_key}"
[auth.openapi.AdminToken]
bearer = "{admin_token}"

# 503 with Retry-After is an answer, not a failure: admission defers every call and session
# while no worker serves (none does in the stateless run), and /readyz says so.
# A call whose own X-Kvgate-Timeout passes before it is answered is 504 deadline_exceeded.
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "503", "504"]

# What kvgate reads of a body is in its schema, but not every rule: operator limits
# (max_tokens, a session's parallelism and deadline), rules across fields (min_parallel <=
# max_parallel), a batch's lines checked one by one against the models served, and the
# fields a worker's vLLM serving layer reads and refuses by name. A schema-valid body may
# still get its 400 there.
[[operations]]
include-method = "POST"
include-path-regex = "^/v1/(chat/completions|completions|messages|sessions|batches)$"
checks.positive_data_acceptance.enabled = false

# Closing a session (DELETE) ends it but keeps it to read: GET answers it with `state` closed
# (and a call in it 409 session_closed), so a closed session is not a deleted resource.
[[operations]]
include-method = "GET"
include-path = "/v1/sessions/{{session_id}}"
checks.use_after_free.enabled = false
"""


def contract_toml(tenant_key: str, admin_token: str) -> str:
    """schemathesis' configuration, with the tenant key and admin token it authenticates by."""
    return _CONTRACT.format(tenant_key=tenant_key, admin_token=admin_token)


def contract_front_door(
    nats_url: str, root: Path, tenant_key: str, admin_token: str, **env: str
) -> tuple[Proc, str]:
    """A front door held to the contract: one tenant with ``tenant_key``, an admin token (every
    key the document declares is then needed), no batch runner, and ``env``. The tenant's
    quotas are ones no run reaches: a refusal must depend on the request, not on what earlier
    cases left behind (Hypothesis replays a stateful case and expects the same answers)."""
    quotas = {"max_sessions": 10**6, "max_parallel_calls": 10**9, "tokens_per_minute": 10**15}
    tenants = write_tenants_file(
        root, tenant("contract", tenant_key, max_tier="guaranteed", **quotas)
    )
    return start_api(
        nats_url,
        root,
        KVGATE_BATCH_RUNNER="false",
        KVGATE_TENANTS_FILE=str(tenants),
        KVGATE_ADMIN_TOKEN=admin_token,
        **env,
    )
