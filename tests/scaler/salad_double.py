"""A SaladCloud API double over real HTTP on loopback (aiohttp, port 0).

It serves the container-group endpoints the provider uses, checks the `Salad-Api-Key` header
(401 otherwise), parses request bodies with the SDK's own models (a malformed or unknown field
is a 400) and builds every answer through the SDK's models too, so a response the SDK could not
read fails here first. Errors are the published description's: `ProblemDetails` bodies as
`application/json`, 404 for an unknown group or instance, 400 for a malformed body; reading an
instance answers 202, as the description says.

Time is the test's (a `ManualClock` it moves; no sleeping), and the platform takes its time as
SaladCloud does: an instance passes through allocating, downloading and creating over the cold
start (`cold_start_s`); an instance that is removed (scale-in, a stopped group), reallocated or
restarted is `stopping` for `stop_s` first, still counted by the group and still listed, and
only then leaves, moves to a new machine or runs again. A scale-in picks among every instance
the group counts (stopping ones included) by lowest deletion cost, then newest, so a tie can
land on a busy node. The platform also reallocates instances on its own
(`platform_reallocate`), a node can vanish (`vanish`), and a group below its replica count
grows new ones. `advance(s)` moves the clock and lets the platform catch up. Faults can be
injected: 429 with Retry-After, 500, and slow answers that outlast the client's timeout (the
action is carried out first, as when only the answer is lost).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from salad_cloud_sdk.models import (
    ContainerGroup,
    ContainerGroupInstance,
    ContainerGroupInstanceCollection,
    ContainerGroupInstancePatch,
    ContainerGroupPatch,
)

PREFIX = "/api/public/organizations/{org}/projects/{project}/containers/{group}"
STAMP = "2025-01-01T00:00:00Z"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Fault:
    kind: str  # "400", "429", "500" or "slow"
    remaining: int
    retry_after: str | None = None
    delay_s: float = 0.0
    # Only requests whose "METHOD path" contains this (all when empty).
    match: str = ""


@dataclass
class DoubleInstance:
    id: str
    machine_id: str
    created_at: float
    deletion_cost: int = 0
    version: int = 1
    changes: int = 0
    # While stopping: when the stop ends, and what then ("remove", "move" to a new machine, or
    # "restart" on this one).
    stop_at: float | None = None
    after_stop: str = ""

    def state(self, now: float, cold_start_s: float) -> str:
        if self.stop_at is not None:
            return "stopping"
        age = now - self.created_at
        if age >= cold_start_s:
            return "running"
        # The cold start in three parts, as the platform reports them.
        return ("allocating", "downloading", "creating")[min(2, int(3 * age / cold_start_s))]


@dataclass
class SaladDouble:
    api_key: str = "test-salad-key"
    org: str = "acme"
    project: str = "fleet"
    group: str = "workers"
    cold_start_s: float = 0.0
    # How long an instance stays `stopping` before it leaves, moves or restarts (0: at once).
    stop_s: float = 0.0
    clock: ManualClock = field(default_factory=ManualClock)
    replicas: int = 0
    status: str = "running"
    instances: dict[str, DoubleInstance] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    # Every request as "METHOD path", and every change made ("action", target).
    requests: list[str] = field(default_factory=list)
    actions: list[tuple[str, str]] = field(default_factory=list)
    _machines: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _runner: web.AppRunner | None = None
    base_url: str = ""

    async def start(self) -> str:
        app = web.Application(middlewares=[self._middleware])
        p = PREFIX
        app.router.add_get(p, self._get_group)
        app.router.add_patch(p, self._patch_group)
        app.router.add_post(p + "/start", self._start)
        app.router.add_post(p + "/stop", self._stop)
        app.router.add_get(p + "/instances", self._list)
        app.router.add_get(p + "/instances/{iid}", self._get_instance)
        app.router.add_patch(p + "/instances/{iid}", self._patch_instance)
        for verb in ("reallocate", "recreate", "restart"):
            app.router.add_post(p + "/instances/{iid}/" + verb, self._instance_action(verb))
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/api/public"
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- what tests do to it ---------------------------------------------------------------

    def inject(
        self,
        kind: str,
        count: int = 1,
        *,
        retry_after: str | None = None,
        delay_s: float = 0.0,
        match: str = "",
    ) -> None:
        assert kind in ("400", "429", "500", "slow")
        assert delay_s <= 5.0, "keep injected slowness bounded"
        self.faults.append(
            Fault(kind=kind, remaining=count, retry_after=retry_after, delay_s=delay_s, match=match)
        )

    def vanish(self, instance_id: str) -> None:
        """The node is gone without warning; the group grows a replacement."""
        del self.instances[instance_id]
        self.actions.append(("vanished", instance_id))
        self._reconcile()

    def platform_reallocate(self, instance_id: str) -> None:
        """SaladCloud moves the instance by itself (its node was reclaimed): it stops for
        `stop_s` (its deletion cost kept), then comes back on a new machine."""
        self.actions.append(("platform_reallocate", instance_id))
        self._stop_instance(self.instances[instance_id], "move")
        self._reconcile()

    def advance(self, seconds: float) -> None:
        """Time passes on the platform: stops end, cold starts finish."""
        self.clock.advance(seconds)
        self._reconcile()

    def states(self) -> dict[str, str]:
        self._reconcile()
        return {i.id: i.state(self.clock(), self.cold_start_s) for i in self.instances.values()}

    # -- the platform's behaviour ----------------------------------------------------------

    def _new_machine(self) -> str:
        return f"machine-{next(self._machines)}"

    def _stop_instance(self, inst: DoubleInstance, then: str) -> None:
        if inst.stop_at is not None:
            if then == "remove":
                inst.after_stop = "remove"  # a move or restart in progress becomes a removal
            return
        inst.changes += 1
        inst.stop_at, inst.after_stop = self.clock() + self.stop_s, then
        if self.stop_s > 0:
            self.actions.append(("stopping", inst.id))
        self._finish_stops()

    def _finish_stops(self) -> None:
        now = self.clock()
        for inst in list(self.instances.values()):
            if inst.stop_at is None or inst.stop_at > now:
                continue
            ended, inst.stop_at = inst.stop_at, None
            inst.changes += 1
            if inst.after_stop == "remove":
                del self.instances[inst.id]
                self.actions.append(("removed", inst.id))
            elif inst.after_stop == "move":
                inst.machine_id = self._new_machine()
                inst.created_at = ended
            else:  # restart: the image is on the node already
                inst.created_at = ended - self.cold_start_s

    def _reconcile(self) -> None:
        self._finish_stops()
        want = self.replicas if self.status == "running" else 0
        # The group counts every instance it has not removed yet, stopping ones included.
        counted = [i for i in self.instances.values() if i.after_stop != "remove"]
        for _ in range(want - len(counted)):
            iid = str(uuid.uuid4())
            self.instances[iid] = DoubleInstance(
                id=iid, machine_id=self._new_machine(), created_at=self.clock()
            )
        if len(counted) > want:
            # Lowest deletion cost first; among equals, the newest (a stable sort: then the
            # oldest listed).
            order = sorted(counted, key=lambda i: (i.deletion_cost, -i.created_at))
            for victim in order[: len(counted) - want]:
                self._stop_instance(victim, "remove")

    def _instance_json(self, inst: DoubleInstance) -> dict[str, Any]:
        model = ContainerGroupInstance(
            id_=inst.id,
            machine_id=inst.machine_id,
            state=inst.state(self.clock(), self.cold_start_s),
            update_time=f"2025-01-01T{inst.changes // 3600 % 24:02}:{inst.changes // 60 % 60:02}"
            f":{inst.changes % 60:02}Z",
            version=inst.version,
            deletion_cost=inst.deletion_cost,
            ready=True,
            started=True,
        )
        return dict(model._map())

    def _group_json(self) -> dict[str, Any]:
        states = list(self.states().values())
        body = {
            "id": "6fd3e6d4-2b8a-4b6e-9d2f-3f0c0c9c2a11",
            "name": self.group,
            "display_name": self.group,
            "organization_name": self.org,
            "project_name": self.project,
            "autostart_policy": True,
            "container": {
                "command": None,
                "image": "ghcr.io/example/lorafleet-worker:test",
                "resources": {
                    "cpu": 4,
                    "memory": 30720,
                    "gpu_classes": ["ed563892-aacd-40f5-80b7-90c9be6c759b"],
                },
            },
            "country_codes": [],
            "create_time": STAMP,
            "current_state": {
                "finish_time": STAMP,
                "start_time": STAMP,
                "status": self.status,
                "instance_status_counts": {
                    "allocating_count": states.count("allocating"),
                    "creating_count": states.count("downloading") + states.count("creating"),
                    "running_count": states.count("running"),
                    "stopping_count": states.count("stopping"),
                },
            },
            "pending_change": False,
            "priority": "batch",
            "replicas": self.replicas,
            "restart_policy": "always",
            "scaling_actions": [],
            "scheduled-scaling-enabled": False,
            "update_time": STAMP,
            "version": 1,
        }
        ContainerGroup._unmap(body)  # the SDK must be able to read what we serve
        return body

    # -- HTTP ------------------------------------------------------------------------------

    @staticmethod
    def _problem(status: int, title: str, detail: str = "", **headers: str) -> web.Response:
        """An error as the published description gives it: `ProblemDetails`, application/json."""
        return web.json_response(
            {"type": "about:blank", "title": title, "status": status, "detail": detail or title},
            status=status,
            headers=headers,
        )

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        line = f"{request.method} {request.path}"
        self.requests.append(line)
        if request.headers.get("Salad-Api-Key") != self.api_key:
            return self._problem(401, "Unauthorized")
        info = request.match_info
        if (info.get("org"), info.get("project"), info.get("group")) != (
            self.org,
            self.project,
            self.group,
        ):
            return self._problem(404, "Not Found", "The container group could not be found.")
        self._reconcile()
        fault = next((f for f in self.faults if f.remaining > 0 and f.match in line), None)
        if fault is not None:
            fault.remaining -= 1
            if fault.kind == "429":
                extra = {"Retry-After": fault.retry_after} if fault.retry_after else {}
                return self._problem(429, "Too Many Requests", **extra)
            if fault.kind == "500":
                return self._problem(500, "Internal Server Error")
            if fault.kind == "400":
                return self._problem(400, "Bad Request", "The request was refused.")
            response = await self._handle(handler, request)  # "slow": done, answered late
            await asyncio.sleep(fault.delay_s)
            return response
        return await self._handle(handler, request)

    async def _handle(self, handler: Handler, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except SaladDouble._Refused as refused:
            return refused.response

    class _Refused(Exception):
        def __init__(self, response: web.Response) -> None:
            self.response = response

    async def _body(self, request: web.Request, model: Any) -> Any:
        def bad(detail: str) -> SaladDouble._Refused:
            return SaladDouble._Refused(self._problem(400, "Bad Request", detail))

        if request.content_type != "application/merge-patch+json":
            raise SaladDouble._Refused(
                self._problem(415, "Unsupported Media Type", request.content_type)
            )
        try:
            raw = json.loads(await request.text())
            parsed = model._unmap(raw)
        except (ValueError, TypeError) as exc:
            raise bad(f"malformed body: {exc}") from None
        if parsed._kwargs:
            raise bad(f"unknown fields: {sorted(parsed._kwargs)}")
        for name, value in vars(parsed).items():
            if not name.startswith("_") and isinstance(value, bool):
                raise bad(f"{name}: must be an integer")
        return parsed

    def _find(self, request: web.Request) -> DoubleInstance:
        inst = self.instances.get(request.match_info["iid"])
        if inst is None:
            raise SaladDouble._Refused(
                self._problem(404, "Not Found", "The container group instance could not be found.")
            )
        return inst

    async def _get_group(self, request: web.Request) -> web.Response:
        return web.json_response(self._group_json())

    async def _patch_group(self, request: web.Request) -> web.Response:
        patch = await self._body(request, ContainerGroupPatch)
        if hasattr(patch, "replicas") and patch.replicas is not None:
            self.replicas = int(patch.replicas)
            self.actions.append(("replicas", str(self.replicas)))
            self._reconcile()
        return web.json_response(self._group_json())

    async def _start(self, request: web.Request) -> web.Response:
        self.status = "running"
        self.actions.append(("start", self.group))
        self._reconcile()
        return web.Response(status=202)

    async def _stop(self, request: web.Request) -> web.Response:
        self.status = "stopped"
        self.actions.append(("stop", self.group))
        self._reconcile()
        return web.Response(status=202)

    async def _list(self, request: web.Request) -> web.Response:
        items = [self._instance_json(i) for i in self.instances.values()]
        ContainerGroupInstanceCollection._unmap({"instances": items})
        return web.json_response({"instances": items})

    async def _get_instance(self, request: web.Request) -> web.Response:
        # 202, not 200: the published description's answer for reading an instance.
        return web.json_response(self._instance_json(self._find(request)), status=202)

    async def _patch_instance(self, request: web.Request) -> web.Response:
        inst = self._find(request)
        patch = await self._body(request, ContainerGroupInstancePatch)
        if getattr(patch, "deletion_cost", None) is not None:
            inst.deletion_cost = int(patch.deletion_cost)
            self.actions.append(("deletion_cost", f"{inst.id}={inst.deletion_cost}"))
        return web.json_response(self._instance_json(inst))

    def _instance_action(self, verb: str) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            inst = self._find(request)
            self.actions.append((verb, inst.id))
            if verb == "reallocate":
                inst.deletion_cost = 0
                self._stop_instance(inst, "move")
            elif verb == "restart" and self.stop_s > 0:
                self._stop_instance(inst, "restart")
            else:  # recreate, or a restart that takes no time
                inst.changes += 1
                if verb == "recreate":
                    inst.created_at = self.clock()
            return web.Response(status=202)

        return handle
