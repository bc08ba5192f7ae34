"""docs/salad-container-group.json and docs/DEPLOYING.md against SaladCloud's own API description.

The description is SaladCloud's published OpenAPI 3.1 file, kept beside the repository in
`../shared/specs/salad-cloud.yaml`. The example must be a valid body for the operation
`create_container_group` (its $refs resolved, formats checked, and no property the schema does
not declare: the API's schemas are open, so a camelCase or misspelt field would otherwise pass
here and be silently ignored by SaladCloud). Its environment must be what the worker reads, and
the guide's API calls must use the paths and headers the description defines.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from openapi_schema_validator import OAS31Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from lorafleet.worker import config as worker_config

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO.parent / "shared" / "specs"
API_SPEC = SPECS / "salad-cloud.yaml"
IMDS_SPEC = SPECS / "salad-cloud-imds.yaml"
EXAMPLE = REPO / "docs" / "salad-container-group.json"
GUIDE = REPO / "docs" / "DEPLOYING.md"
SPEC_URI = "urn:lorafleet-test:salad-cloud"

# How the guide spells the path parameters of SaladCloud's API in its shell commands.
GUIDE_PARAMETERS = {
    "organization_name": "${SALAD_ORG}",
    "project_name": "${SALAD_PROJECT}",
    "container_group_name": "${GROUP}",
    "container_group_instance_id": "${INSTANCE}",
}

Json = dict[str, Any]


def _load_yaml(path: Path) -> Json:
    if not path.is_file():
        pytest.fail(
            f"{path} is missing: these tests check the docs against SaladCloud's published API"
            " description, kept beside the repository in ../shared/specs/"
        )
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), f"{path}: not an OpenAPI document"
    return loaded


@pytest.fixture(scope="module")
def spec() -> Json:
    return _load_yaml(API_SPEC)


@pytest.fixture(scope="module")
def imds_spec() -> Json:
    return _load_yaml(IMDS_SPEC)


@pytest.fixture
def example() -> Json:
    loaded = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def _operation(spec: Json, operation_id: str) -> tuple[str, str, Json]:
    """(path, method, operation) of the operation with this operationId."""
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            if isinstance(operation, dict) and operation.get("operationId") == operation_id:
                return path, method, operation
    raise AssertionError(f"no operation {operation_id!r} in {API_SPEC.name}")


def _closed(node: Any) -> Any:
    """A copy in which every object schema with declared properties allows no others."""
    if isinstance(node, dict):
        closed = {key: _closed(value) for key, value in node.items()}
        if "properties" in closed and not {"additionalProperties", "unevaluatedProperties"} & set(
            closed
        ):
            closed["unevaluatedProperties"] = False
        return closed
    if isinstance(node, list):
        return [_closed(value) for value in node]
    return node


@pytest.fixture(scope="module")
def create_errors(spec: Json) -> Callable[[Json], list[str]]:
    """Validates a body against create_container_group's request schema; returns the errors."""
    strict = dict(spec, components=_closed(spec["components"]))
    resource = DRAFT202012.create_resource(strict)
    registry: Registry[Any] = Registry().with_resource(SPEC_URI, resource)
    resolver = registry.resolver(SPEC_URI)
    _, _, operation = _operation(spec, "create_container_group")
    body = operation["requestBody"]
    if "$ref" in body:
        body = resolver.lookup(body["$ref"]).contents
    schema_ref = body["content"]["application/json"]["schema"]["$ref"]
    validator = OAS31Validator(
        {"$ref": f"{SPEC_URI}{schema_ref}"},
        registry=registry,
        format_checker=OAS31Validator.FORMAT_CHECKER,
    )

    def errors(instance: Json) -> list[str]:
        found = validator.iter_errors(instance)
        return sorted(f"/{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found)

    return errors


def test_example_is_a_valid_create_container_group_body(
    example: Json, create_errors: Callable[[Json], list[str]]
) -> None:
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
        (_set("restart_policy", "sometimes"), "/restart_policy: 'sometimes' is not one of"),
        (_set("container/priority", "urgent"), "/container/priority: 'urgent' is not one of"),
        (_set("container/resources/memory", _DELETE), "'memory' is a required property"),
        (_set("container/resources/gpu_classes", ["rtx-4090"]), "is not a 'uuid'"),
        (_set("container/environment_variables/EMPTY", ""), "should be non-empty"),
        (_set("startup_probe/failure_threshold", 99), "greater than the maximum of 20"),
        (_rename("restart_policy", "restartPolicy"), "'restartPolicy' was unexpected"),
        (_rename("container/resources/gpu_classes", "gpuClasses"), "'gpuClasses' was unexpected"),
    ],
    ids=[
        "unknown-restart-policy",
        "unknown-priority",
        "no-memory",
        "gpu-class-not-uuid",
        "empty-env-value",
        "probe-threshold-too-high",
        "camel-case-field",
        "camel-case-nested-field",
    ],
)
def test_the_check_rejects_broken_bodies(
    example: Json,
    create_errors: Callable[[Json], list[str]],
    change: Callable[[Json], None],
    expected: str,
) -> None:
    broken = copy.deepcopy(example)
    change(broken)
    errors = create_errors(broken)
    assert any(expected in error for error in errors), errors


def test_example_environment_is_what_the_worker_reads(example: Json) -> None:
    env = example["container"]["environment_variables"]
    source = Path(worker_config.__file__).read_text(encoding="utf-8")
    telemetry = (REPO / "clients" / "python" / "lorafleet" / "telemetry.py").read_text("utf-8")
    for name in env:
        assert f'"{name}"' in source + telemetry, f"{name}: no lorafleet worker reads it"
    config = worker_config.WorkerConfig.from_env(env)
    assert config.scheduler_address == env["LORAFLEET_SCHEDULER"]
    assert config.tls
    assert config.drain_grace_s == float(env["LORAFLEET_DRAIN_GRACE_S"])
    # SaladCloud sets the node's identity; the example must not pin it for every replica.
    assert not {"SALAD_MACHINE_ID", "LORAFLEET_MACHINE_ID"} & set(env)
    # A drained worker exits 0: only "always" brings the replica back afterwards.
    assert example["restart_policy"] == "always"


def _guide_urls(spec: Json, operation_ids: list[str]) -> Iterator[tuple[str, str, str]]:
    server = spec["servers"][0]["url"]
    for operation_id in operation_ids:
        path, method, _ = _operation(spec, operation_id)
        url = server + path
        for parameter, spelling in GUIDE_PARAMETERS.items():
            url = url.replace("{" + parameter + "}", spelling)
        unspelt = re.findall(r"(?<!\$)\{\w+\}", url)
        assert not unspelt, f"{operation_id}: the guide has no spelling for {unspelt}"
        yield operation_id, method, url


def test_guide_calls_the_api_as_described(spec: Json) -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    scheme = spec["components"]["securitySchemes"]["ApiKeyAuth"]
    assert (scheme["type"], scheme["in"]) == ("apiKey", "header")
    assert f"{scheme['name']}: " in guide
    assert EXAMPLE.name in guide
    operations = [
        "create_container_group",
        "update_container_group",
        "list_container_group_instances",
        "reallocate_container_group_instance",
        "list_gpu_classes",
    ]
    for operation_id, method, url in _guide_urls(spec, operations):
        assert url in guide, f"{operation_id}: the guide should call {method.upper()} {url}"
        if method != "get":
            assert re.search(rf"-X {method.upper()}\b[^\n]*\n?[^\n]*{re.escape(url)}", guide), (
                f"{operation_id}: {url} with -X {method.upper()}"
            )
    _, _, update = _operation(spec, "update_container_group")
    for content_type in spec["components"]["requestBodies"]["UpdateContainerGroup"]["content"]:
        assert f"Content-Type: {content_type}" in guide
    assert "$ref" in update["requestBody"]


def test_guide_calls_the_imds_as_described(imds_spec: Json) -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    server = imds_spec["servers"][0]["url"]
    header = imds_spec["components"]["parameters"]["Metadata"]
    assert (header["in"], header["schema"]["const"]) == ("header", "true")
    assert f"{header['name']}: {header['schema']['const']}" in guide
    for path in ("/v1/reallocate",):
        assert path in imds_spec["paths"]
        assert server + path in guide
    reason = imds_spec["components"]["schemas"]["ReallocatePrototype"]
    assert reason["required"] == ["reason"]
    assert '"reason"' in guide
