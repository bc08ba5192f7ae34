"""docs/salad-container-group.json and docs/DEPLOYING.md against SaladCloud's official SDKs.

Nothing outside the repository is read: the API's shape comes from the `salad-cloud-sdk` and
`salad-cloud-imds-sdk` packages, SaladCloud's own generated clients. The example must parse as
the SDK's `ContainerGroupCreationRequest` (required fields, enumerations, bounds, name patterns)
and come back from the model unchanged: the model keeps only the fields it declares, so a
camelCase or misspelt field (which SaladCloud would silently ignore) shows up as a difference.
Its environment must be what the worker reads, and the guide's API and IMDS calls must be the
requests the SDKs send (method, URL, headers), captured at the SDKs' transport without a network.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from salad_cloud_imds_sdk import SaladCloudImdsSdk
from salad_cloud_imds_sdk.models import Metadata, ReallocatePrototype
from salad_cloud_sdk import SaladCloudSdk
from salad_cloud_sdk.models import ContainerGroupCreationRequest, ContainerGroupPatch

from lorafleet.core.settings import env_names
from lorafleet.worker import config as worker_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "salad-container-group.json"
GUIDE = REPO / "docs" / "DEPLOYING.md"

# How the guide spells the path parameters of SaladCloud's API in its shell commands, and the
# valid stand-ins the SDK is called with (it checks names against their patterns).
GUIDE_PARAMETERS = {
    "org-placeholder": "${SALAD_ORG}",
    "project-placeholder": "${SALAD_PROJECT}",
    "group-placeholder": "${GROUP}",
    "6f0f2d8e-3c1a-4b7e-9d2c-5a4b3c2d1e0f": "${INSTANCE}",
}
ORG, PROJECT, GROUP, INSTANCE = GUIDE_PARAMETERS

Json = dict[str, Any]


@pytest.fixture
def example() -> Json:
    loaded = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def create_errors(body: Json) -> list[str]:
    """Why SaladCloud's SDK would not send `body` as a create_container_group request as is."""
    try:
        parsed = ContainerGroupCreationRequest._unmap(copy.deepcopy(body))
    except (TypeError, ValueError) as exc:
        return [f"{type(exc).__name__}: {exc}"]
    errors = [f"{path}: {what}" for path, what in _differences(body, parsed._map())]
    # The SDK does not check formats; gpu_classes are UUIDs (list_gpu_classes gives them).
    for gpu_class in body.get("container", {}).get("resources", {}).get("gpu_classes", []):
        try:
            uuid.UUID(str(gpu_class))
        except ValueError:
            errors.append(f"/container/resources/gpu_classes: {gpu_class!r} is not a UUID")
    return errors


def _differences(sent: Any, kept: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(sent, dict) and isinstance(kept, dict):
        for key in sent.keys() - kept.keys():
            yield f"{path}/{key}", "not a field of the model (SaladCloud would ignore it)"
        for key in sent.keys() & kept.keys():
            yield from _differences(sent[key], kept[key], f"{path}/{key}")
    elif sent != kept:
        yield path or "/", f"{sent!r} comes back as {kept!r}"


def test_example_is_a_valid_create_container_group_body(example: Json) -> None:
    assert create_errors(example) == []


_DELETE = object()


def _set(path: str, value: Any) -> Callable[[Json], None]:
    *parents, leaf = path.split("/")

    def change(body: Json) -> None:
        node = body
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value

    return change


def _rename(path: str, new_name: str) -> Callable[[Json], None]:
    *parents, leaf = path.split("/")

    def change(body: Json) -> None:
        node = body
        for key in parents:
            node = node[key]
        node[new_name] = node.pop(leaf)

    return change


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_set("restart_policy", "sometimes"), "restart_policy: must match one of"),
        (_set("container/priority", "urgent"), "priority: must match one of"),
        (_set("container/resources/memory", _DELETE), "argument: 'memory'"),
        (_set("container/resources/gpu_classes", ["rtx-4090"]), "is not a UUID"),
        (_set("name", "Lorafleet_Workers"), "name: must match"),
        (_set("replicas", 501), "replicas: must satisfy the condition le 500"),
        (_set("startup_probe/failure_threshold", 99), "condition le 20"),
        (_rename("restart_policy", "restartPolicy"), "argument: 'restart_policy'"),
        (_rename("container/resources/gpu_classes", "gpuClasses"), "/gpuClasses: not a field"),
        (_set("container/colour", "red"), "/container/colour: not a field"),
    ],
    ids=[
        "unknown-restart-policy",
        "unknown-priority",
        "no-memory",
        "gpu-class-not-uuid",
        "name-not-dns",
        "too-many-replicas",
        "probe-threshold-too-high",
        "camel-case-field",
        "camel-case-nested-field",
        "unknown-field",
    ],
)
def test_the_check_rejects_broken_bodies(
    example: Json, change: Callable[[Json], None], expected: str
) -> None:
    broken = copy.deepcopy(example)
    change(broken)
    errors = create_errors(broken)
    assert any(expected in error for error in errors), errors


def test_example_environment_is_what_the_worker_reads(example: Json) -> None:
    env = example["container"]["environment_variables"]
    model = worker_config.WorkerConfig
    read = {v for n, i in model.model_fields.items() for v in env_names(n, i)}
    telemetry = (REPO / "core" / "lorafleet" / "core" / "telemetry.py").read_text("utf-8")
    for name in env:
        assert name in read or f'"{name}"' in telemetry, f"{name}: no lorafleet worker reads it"
    config = worker_config.WorkerConfig.from_env(env)
    assert config.scheduler_address == env["LORAFLEET_SCHEDULER"]
    assert config.tls
    assert config.drain_grace_s == float(env["LORAFLEET_DRAIN_GRACE_S"])
    # SaladCloud sets the node's identity; the example must not pin it for every replica.
    assert not {"SALAD_MACHINE_ID", "LORAFLEET_MACHINE_ID"} & set(env)
    # A drained worker exits 0: only "always" brings the replica back afterwards.
    assert example["restart_policy"] == "always"
    # On SaladCloud (which adds SALAD_CONTAINER_GROUP_ID) a worker that fails its probe asks to
    # be reallocated, unless the example turned that off.
    on_salad = worker_config.WorkerConfig.from_env({**env, "SALAD_CONTAINER_GROUP_ID": "g"})
    assert on_salad.salad_reallocate_enabled


class _Captured(Exception):
    pass


def _sent(service: Any, call: Callable[[], Any]) -> Any:
    """The request an SDK service would send for `call`, stopped at its transport."""
    requests: list[Any] = []

    def capture(request: Any) -> Any:
        requests.append(request)
        raise _Captured

    service.send_request = capture
    with pytest.raises(_Captured):
        call()
    (request,) = requests
    return request


def _guide_spelling(url: str) -> str:
    for value, spelling in GUIDE_PARAMETERS.items():
        url = url.replace(value, spelling)
    return url


def test_guide_calls_the_api_as_the_sdk_does() -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    sdk = SaladCloudSdk(api_key="key")
    groups = sdk.container_groups
    calls = {
        "create_container_group": (
            groups,
            lambda: groups.create_container_group(
                ContainerGroupCreationRequest._unmap(
                    json.loads(EXAMPLE.read_text(encoding="utf-8"))
                ),
                ORG,
                PROJECT,
            ),
        ),
        "update_container_group": (
            groups,
            lambda: groups.update_container_group(
                ContainerGroupPatch(replicas=8), ORG, PROJECT, GROUP
            ),
        ),
        "list_container_group_instances": (
            groups,
            lambda: groups.list_container_group_instances(ORG, PROJECT, GROUP),
        ),
        "reallocate_container_group_instance": (
            groups,
            lambda: groups.reallocate_container_group_instance(ORG, PROJECT, GROUP, INSTANCE),
        ),
        "list_gpu_classes": (
            sdk.organization_data,
            lambda: sdk.organization_data.list_gpu_classes(ORG),
        ),
    }
    for operation, (service, call) in calls.items():
        request = _sent(service, call)
        url = _guide_spelling(request.url)
        unspelt = re.findall(r"placeholder|[0-9a-f]{8}-[0-9a-f]{4}-", url)
        assert not unspelt, f"{operation}: the guide has no spelling for {unspelt}"
        assert url in guide, f"{operation}: the guide should call {request.method} {url}"
        if request.method != "GET":
            assert re.search(rf"-X {request.method}\b[^\n]*\n?[^\n]*{re.escape(url)}", guide), (
                f"{operation}: {url} with -X {request.method}"
            )
        for header, value in request.headers.items():
            if header == "Salad-Api-Key":
                assert f"{header}: ${{SALAD_API_KEY}}" in guide
            else:
                assert f"{header}: {value}" in guide, f"{operation}: header {header}: {value}"


def test_guide_calls_the_imds_as_the_sdk_does() -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    imds = SaladCloudImdsSdk()
    request = _sent(
        imds.metadata,
        lambda: imds.metadata.reallocate(ReallocatePrototype(reason="r"), Metadata.TRUE),
    )
    assert (request.method, request.url) == ("POST", "http://169.254.169.254/v1/reallocate")
    assert f"-X POST {request.url}" in guide
    for header, value in request.headers.items():
        assert f"{header}: {value}" in guide, f"header {header}: {value}"
    assert '"reason"' in guide
    # The worker's own default is the address the SDK knows.
    default = worker_config.WorkerConfig.model_fields["salad_imds_url"].default
    assert request.url.startswith(default)
