"""The management API's OpenAPI 3.1 description, served at ``GET /openapi.json``.

Request bodies are the manifests' own pydantic models (``capyctl.spec``); answers are described by
the models below, which name the fields clients read and allow more (a new field is not a break).
Each operation lists every error status its handler can answer: the roles' 401 and 403, the
controller's and systemd's errors (``capyctl/errors.py``), 413 where a body is read, 422 for a
reused ``Idempotency-Key`` or an invalid manifest. tests/unit/test_openapi.py checks that every
registered route is described and runs schemathesis against the document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .. import __version__
from ..openapi import ErrorResponse, Operation, Response, document
from ..spec import DeploymentSpec, EngineSpec


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class WaitingForRoom(BaseModel):
    seconds: float = Field(description="How long its wake has waited for room (at most swap.wait_max).")
    ahead: int = Field(description="Deployments waiting longer, served first.")


class Deployment(_Open):
    name: str
    state: str
    reason: str | None = None
    revision: int
    engine: str
    unit: str
    model: str | None = None
    hosts: list[str] = []
    in_flight: int = 0
    waiting: int = 0
    parked_in_place: bool = False
    parked: Literal["no", "stopped", "armed", "in_place"] = Field(
        default="no", description="How it is parked: its unit stopped, its next launch's unit held at its gate "
        "(armed), or the engine asleep in its unit (in_place); no while it is not parked.")
    armed: bool = Field(default=False, description="Parked by stopping, with the next launch's unit already "
                        "started and held at its gate: the wake only opens it.")
    door: Literal["open", "closed"] = Field(
        default="open", description="closed while another deployment waits for its room: it admits the "
        "requests already waiting, new ones wait for its next turn (docs/engines-and-parking.md).")
    waiting_for_room: WaitingForRoom | None = Field(
        default=None, description="Set while its wake waits for room that busy deployments hold.")
    wakes: int = 0
    parks: int = 0


class DeployRequest(BaseModel):
    spec: DeploymentSpec
    activate: bool = Field(default=False, description="Start it now rather than on the first request.")
    wait: bool = Field(default=False, description="With activate: answer only once it serves.")


class DeployEvent(_Open):
    """One line of the NDJSON answer: ``progress`` lines, then ``done`` or ``error``."""
    event: str = Field(description="progress, done or error")
    message: str | None = None
    deployment: Deployment | None = None
    error: dict[str, Any] | None = None


class LogLine(BaseModel):
    line: str


class Deleted(_Open):
    name: str
    deleted: bool


class Removed(_Open):
    name: str
    removed: bool


class EngineAdd(BaseModel):
    model_config = ConfigDict(extra="allow")
    path: str | None = Field(default=None, description="An engine install to detect (binary or virtual environment).")
    name: str | None = None
    spec: EngineSpec | None = Field(default=None, description="An engine manifest instead of a path.")


class Key(_Open):
    id: str
    name: str
    models: list[str] | None = None
    created_at: float | str | None = None
    revoked_at: float | str | None = None


class KeyCreated(Key):
    key: str = Field(description="The secret, shown this once.")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    models: list[str] | None = Field(default=None, description="Models the key may use; absent: all.")


class Host(_Open):
    name: str
    state: str


class HostAdd(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    ssh: str = Field(description="[user@]address")
    port: int | None = Field(default=None, ge=1, le=65535)
    identity: str | None = None
    known_hosts: str | None = None


class HostCheck(_Open):
    host: str
    reachable: bool


class Drained(_Open):
    host: str


class Uncordoned(_Open):
    host: str
    cordoned: bool
    was_cordoned: bool


class Usage(_Open):
    measured_at: float
    hosts: list[dict[str, Any]]
    deployments: list[dict[str, Any]]


class Whoami(BaseModel):
    role: str


class Health(BaseModel):
    status: str


class Rotated(BaseModel):
    rotated: bool
    path: str


# Statuses every authenticated route can answer: no valid credential, or the operator key on an
# admin route (403 is listed only where an operator is refused).
AUTH = {401: ErrorResponse}
ADMIN_ONLY = {401: ErrorResponse, 403: ErrorResponse}
OPERATOR_WRITE = {401: ErrorResponse}
# What an action on a deployment can meet: no such deployment, a conflicting state, a reused
# Idempotency-Key, a model that cannot be read (500 model_unreadable), systemd or the engine
# failing (502), no room or an offline host (503), a host that does not answer (504).
ACTION_ERRORS = {400: ErrorResponse, 404: ErrorResponse, 409: ErrorResponse, 422: ErrorResponse,
                 500: ErrorResponse, 502: ErrorResponse, 503: ErrorResponse, 504: ErrorResponse}
IDEMPOTENCY = {"Idempotency-Key": {"type": "string", "description": "Repeat the same operation without acting twice."}}
BODY_ERRORS = {400: ErrorResponse, 413: ErrorResponse}


def _ops() -> list[Operation]:
    dep = "deployments"
    ops = [
        Operation("GET", "/v1/health", "Whether the daemon answers", "daemon", {200: Health, **AUTH}),
        Operation("GET", "/v1/whoami", "The role of this request's credential", "daemon", {200: Whoami, **AUTH}),
        Operation("GET", "/v1/usage", "Memory per GPU and host RAM, and what each deployment holds", "daemon",
                  {200: Usage, **AUTH}),
        Operation("GET", "/v1/events", "Server-Sent Events: deployments, usage and request rates (the dashboard)",
                  "daemon", {200: Response("text/event-stream: deployments, usage, usage_error and requests events",
                                           {"type": "string"}, "text/event-stream"), **AUTH}),
        Operation("GET", "/v1/deployments", "Every deployment", dep,
                  {200: {"type": "array", "items": Deployment.model_json_schema(mode="serialization",
                                                                                ref_template="#/components/schemas/{model}")},
                   **AUTH}),
        Operation("POST", "/v1/deployments", "Record a deployment (a new revision if changed), optionally start it",
                  dep, {200: Response("NDJSON events, one a line", DeployEvent, "application/x-ndjson"),
                        **BODY_ERRORS, 422: ErrorResponse, **OPERATOR_WRITE},
                  request=DeployRequest, headers=IDEMPOTENCY),
        Operation("GET", "/v1/deployments/{name}", "One deployment, with its unit's memory", dep,
                  {200: Deployment, 404: ErrorResponse, **AUTH}),
        Operation("DELETE", "/v1/deployments/{name}", "Stop a deployment and forget it", dep,
                  {200: Deleted, **ACTION_ERRORS, **OPERATOR_WRITE}, headers=IDEMPOTENCY),
        Operation("GET", "/v1/deployments/{name}/logs", "Its unit's journal as NDJSON lines", dep,
                  {200: Response("NDJSON, one journal line each", LogLine, "application/x-ndjson"),
                   400: ErrorResponse, 404: ErrorResponse, 502: ErrorResponse, **AUTH},
                  query={"lines": {"type": "integer", "minimum": 0, "maximum": 10000},
                         "follow": {"type": "string", "description": "Any value: keep sending new lines"}}),
        Operation("GET", "/v1/engines", "Registered engines", "engines",
                  {200: {"type": "array", "items": {"type": "object"}}, **AUTH}),
        Operation("POST", "/v1/engines", "Register an engine found at a path, or described by a manifest", "engines",
                  {201: EngineSpec, **BODY_ERRORS, 404: ErrorResponse, 409: ErrorResponse, 422: ErrorResponse,
                   502: ErrorResponse, **ADMIN_ONLY}, request=EngineAdd),
        Operation("DELETE", "/v1/engines/{name}", "Remove an engine no deployment uses", "engines",
                  {200: Removed, 404: ErrorResponse, 409: ErrorResponse, **ADMIN_ONLY}),
        Operation("GET", "/v1/keys", "API keys of the OpenAI endpoint (never their secrets)", "keys",
                  {200: {"type": "array", "items": {"type": "object"}}, **AUTH}),
        Operation("POST", "/v1/keys", "Create an API key; its secret is in this answer only", "keys",
                  {201: KeyCreated, **BODY_ERRORS, **ADMIN_ONLY}, request=KeyCreate),
        Operation("DELETE", "/v1/keys/{id}", "Revoke an API key by id or name", "keys",
                  {200: Key, 404: ErrorResponse, **ADMIN_ONLY}),
        Operation("GET", "/v1/hosts", "Hosts: state, GPUs, memory, engines", "hosts",
                  {200: {"type": "array", "items": {"type": "object"}}, **AUTH}),
        Operation("POST", "/v1/hosts", "Connect to a host over SSH, check it and record it", "hosts",
                  {201: Host, **BODY_ERRORS, 409: ErrorResponse, 502: ErrorResponse, 503: ErrorResponse,
                   504: ErrorResponse, **ADMIN_ONLY}, request=HostAdd),
        Operation("GET", "/v1/hosts/{name}", "One host", "hosts", {200: Host, 404: ErrorResponse, **AUTH}),
        Operation("DELETE", "/v1/hosts/{name}", "Forget a host no deployment runs on", "hosts",
                  {200: Removed, 400: ErrorResponse, 404: ErrorResponse, 409: ErrorResponse, **ADMIN_ONLY}),
        Operation("POST", "/v1/hosts/{name}/check", "Reachability, latency, systemd version and inventory", "hosts",
                  {200: HostCheck, 404: ErrorResponse, 502: ErrorResponse, 504: ErrorResponse, **OPERATOR_WRITE}),
        Operation("POST", "/v1/hosts/{name}/drain",
                  "Cordon a host and park or move every deployment placed there", "hosts",
                  {200: Drained, 400: ErrorResponse, 404: ErrorResponse, 422: ErrorResponse, **OPERATOR_WRITE},
                  headers=IDEMPOTENCY),
        Operation("POST", "/v1/hosts/{name}/uncordon", "Open a drained host to placement again", "hosts",
                  {200: Uncordoned, 404: ErrorResponse, **OPERATOR_WRITE}),
        Operation("GET", "/v1/hosts/{name}/inspect", "Everything known about a host", "hosts",
                  {200: {"type": "object"}, 404: ErrorResponse, **AUTH}),
        Operation("GET", "/v1/deployments/{name}/inspect", "Everything known about a deployment", dep,
                  {200: {"type": "object"}, 404: ErrorResponse, **AUTH}),
        Operation("GET", "/v1/engines/{name}", "One registered engine and the deployments using it", "engines",
                  {200: {"type": "object"}, 404: ErrorResponse, **AUTH}),
        Operation("POST", "/v1/operator-key/rotate", "Replace the operator key (the old one is refused at once)",
                  "daemon", {200: Rotated, 409: ErrorResponse, **ADMIN_ONLY}),
        Operation("GET", "/openapi.json", "This description", "daemon",
                  {200: {"type": "object"}}, security=[{}]),
        Operation("GET", "/ui/", "The dashboard (HTML; it reads everything else with a credential)", "dashboard",
                  {200: Response("the page", {"type": "string"}, "text/html")}, security=[{}]),
    ]
    for verb, what in (("park", "Park: release its memory; the next request wakes it"),
                       ("wake", "Wake a parked or stopped deployment now"),
                       ("stop", "Stop its unit; it stays recorded and wakes on a request"),
                       ("drain", "Drain one replica (NAME@K) or a whole deployment: out of routing, its requests "
                                 "finished, then parked; a replica stays out until woken by name")):
        ops.append(Operation("POST", f"/v1/deployments/{{name}}/{verb}", what, dep,
                             {200: Deployment, **ACTION_ERRORS, **OPERATOR_WRITE}, headers=IDEMPOTENCY))
    return ops


OPERATIONS = _ops()


def management_openapi() -> dict:
    return document(
        title="CapyCTL management API", version=__version__,
        description="The API `capyctl` talks to on /run/capyctl/api.sock. On the socket without a credential a "
                    "request is admin; otherwise `Authorization: Bearer` with the admin token or the operator key "
                    "(docs/security.md). Errors are `{\"error\": {\"code\", \"message\"}}`.",
        operations=OPERATIONS,
        security_schemes={"bearer": {"type": "http", "scheme": "bearer",
                                     "description": "The admin token or the operator key"}},
        security=[{"bearer": []}])
