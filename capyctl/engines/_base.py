"""What every engine adapter shares: the launch data types, the abstract adapter and its HTTP helper."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import aiohttp

from ..descriptors import is_shortage, shortage_error
from ..errors import CapyError, EngineError
from ..spec import DeploymentSpec, EngineSpec

ParkMethod = Literal["stop", "in_place"]

# The variable a custom engine reads the per-launch key from unless its registration names another.
DEFAULT_KEY_ENV = "CAPYCTL_ENGINE_KEY"
# The systemd credential that holds the per-launch key: /run/credentials/<unit>/engine-key, 0400 and
# owned by the unit's user (LoadCredential=), read by the engine's own key-file option or exported
# into its environment by the unit's credential shell (TransientUnit.credential_environment).
KEY_CREDENTIAL = "engine-key"
# Where the key goes in a LaunchPlan.secret_files text.
SECRET_FILE_KEY = "{key}"

# EngineSpec.capabilities' default.
DEFAULT_REGISTERED_CAPABILITIES = frozenset(EngineSpec.model_fields["capabilities"].get_default(call_default_factory=True))

# A health probe is polled; one hung probe must not stall the poller.
HEALTH_TIMEOUT_S = 5.0


@dataclass
class LaunchContext:
    """Everything an adapter needs to build one engine launch."""

    deployment: DeploymentSpec
    engine: EngineSpec
    model_path: str  # a GGUF file for llama.cpp, a directory for the others
    port: int  # leased by the controller
    host: str = "127.0.0.1"
    key_env: str = DEFAULT_KEY_ENV
    gpu_indices: list[int] = field(default_factory=list)
    # Threads for the engine's CPU work: one per core it was given, else one per host CPU.
    cpu_threads: int | None = None
    # The cores the plan gave it, each the CPU ids of its hardware threads: its unit is pinned to
    # them (empty: not planned, it runs on any CPU).
    cores: tuple[tuple[int, ...], ...] = ()
    # A host may opt out of development controls (vLLM dev mode, SGLang memory saver); park = stop then.
    dev_controls: bool = True
    # Where the engine serves instead of host:port, for adapters whose ``unix_socket`` is True:
    # a socket in a 0700 directory only CapyCTL (root) can enter, so no other local user reaches
    # the engine's routes (vLLM's key does not guard its development routes). None: TCP.
    socket_path: str | None = None
    # The share of each planned card's total memory this deployment may take, from the plan
    # (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static). None: the engine's default.
    gpu_memory_fraction: float | None = None
    # The same budget in bytes on each planned card (llama.cpp's -ngl is sized from it: all layers
    # when the model, its KV cache and compute buffers fit, else as many as fit). None: no budget
    # (a whole card, or no GPU).
    gpu_memory_budget: int | None = None
    # How many hosts one model instance spans (multi-node groups). vLLM and SGLang read the
    # tensor-parallel size as the total across nodes; each node holds tensor_parallel / nnodes.
    nnodes: int = 1
    # Where the engine finds its credentials: the unit's credentials directory
    # (/run/credentials/<unit>), holding KEY_CREDENTIAL and each of LaunchPlan.secret_files under its
    # name. None: the launch has no credentials directory (then key-file options are not used).
    secret_dir: str | None = None
    # Whether the host's GPU and host memory are one pool (its record's unified_memory): the park
    # tier resolved for the launch (engines/_tiers.py) never keeps weights in host RAM there.
    unified_memory: bool = False
    # Where the engine may write what it saves of its prompt cache at a park, for adapters whose
    # ``keeps_prompt_cache`` is True (a directory the engine's own user can write, kept across
    # launches). None: nothing is kept across a park.
    prompt_cache_dir: str | None = None

    @property
    def accelerated(self) -> bool:
        """Whether this launch has GPUs. vLLM's sleep mode exists only on CUDA, ROCm and XPU."""
        return bool(self.gpu_indices)

    @property
    def key_file(self) -> str | None:
        """The per-launch key's credential file, for engines with a key-file option; None without one."""
        return f"{self.secret_dir.rstrip('/')}/{KEY_CREDENTIAL}" if self.secret_dir is not None else None

    @property
    def key_ref(self) -> str:
        """How argv refers to the key: expanded by systemd from the 0600 environment file."""
        return "${" + self.key_env + "}"


@dataclass
class LaunchPlan:
    """The command line and environment of one engine launch.

    ``environment`` holds nothing secret and may go into the unit's ``Environment=``.
    ``secret_environment`` names the variables the engine reads its key from (for engines without
    a key-file option); each maps to the name of the secret it must hold (today always the
    context's ``key_env``). The unit sets them at exec time from the KEY_CREDENTIAL credential.
    """

    argv: list[str]
    environment: dict[str, str]
    secret_environment: dict[str, str]
    health_path: str
    served_model: str | None
    key_env: str = DEFAULT_KEY_ENV
    # The unix socket the engine will serve on (the context's socket_path, when the adapter used
    # it); None when it serves on TCP at the context's host and port.
    socket_path: str | None = None
    # Files the engine reads its key from, by credential name (the adapter names them in argv as
    # ``<ctx.secret_dir>/<name>``); each text holds SECRET_FILE_KEY where the key goes. The
    # controller writes :meth:`secret_file_contents` 0600 into its own secrets directory, the unit
    # loads each as a credential of that name, and the controller removes them with the key.
    secret_files: dict[str, str] = field(default_factory=dict)

    def secret_file_contents(self, key: str) -> dict[str, str]:
        """The secret files' texts with the key in place of SECRET_FILE_KEY."""
        return {name: text.replace(SECRET_FILE_KEY, key) for name, text in self.secret_files.items()}

    def secret_file_environment(self, key: str) -> dict[str, str]:
        """What the engine's environment receives at exec time: ``key`` under each of
        secret_environment (for running an engine outside systemd, as tests do)."""
        return {name: key for name in self.secret_environment}

    def credential_environment(self) -> dict[str, str]:
        """The variables the unit sets from credentials at exec time: each of secret_environment
        from KEY_CREDENTIAL (TransientUnit.credential_environment)."""
        return {name: KEY_CREDENTIAL for name in self.secret_environment}


@dataclass(frozen=True)
class SavedPromptCache:
    """What an engine saved of its prompt cache at a park: files in the launch's prompt_cache_dir.

    ``seconds_per_token`` is the engine's own measured prefill time per prompt token before the
    park (None: it did not say), from which the wake reports the time the restore saved."""

    files: tuple[str, ...]
    tokens: int
    bytes: int
    seconds: float
    seconds_per_token: float | None = None


@dataclass(frozen=True)
class RestoredPromptCache:
    """What a wake restored of a saved prompt cache; ``refused`` lists the files the engine would
    not take (its reason each), which are lost but harmless."""

    tokens: int
    bytes: int
    seconds: float
    refused: tuple[str, ...] = ()


# A CPU deployment's default cores (resources.cpus unset): one for each started WEIGHT_BYTES_PER_CORE
# of its weights, at most MOST_DEFAULT_CORES. Generating a token reads every weight once, so
# its speed is bounded by memory bandwidth, which a few cores already use up; prompt batches
# are compute bound and gain from more cores. A small model gets one core and leaves the rest
# to its neighbours; a manifest that wants faster prompts asks for more.
WEIGHT_BYTES_PER_CORE = 2 << 30
MOST_DEFAULT_CORES = 8


def cores_for_weights(model_bytes: int) -> int:
    return max(1, min(MOST_DEFAULT_CORES, -(-model_bytes // WEIGHT_BYTES_PER_CORE)))


def headers_for(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def cuda_environment(ctx: LaunchContext) -> dict[str, str]:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU: a CPU deployment must not grab GPU 0 behind
    # the scheduler's back.
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ctx.gpu_indices)}


def user_environment(ctx: LaunchContext) -> dict[str, str]:
    """The engine registration's env, then the deployment's (the more specific one wins)."""
    return {**ctx.engine.env, **ctx.deployment.env}


def require_path(ctx: LaunchContext) -> str:
    if not ctx.engine.path:
        raise CapyError(
            f"engine {ctx.engine.name!r} ({ctx.engine.type}) has no path; register it with the "
            "binary or virtual environment it runs from", code="engine_path_missing", status=400)
    return ctx.engine.path.rstrip("/") or "/"


def require_gpus_for_tp(ctx: LaunchContext) -> int:
    """The tensor-parallel size to pass the engine: the deployment's total across its nodes (vLLM
    and SGLang split it evenly: each of ``ctx.nnodes`` nodes runs tensor_parallel / nnodes ranks,
    vllm/engine/arg_utils.py 0.32.0), after checking this node was given a GPU for each of its ranks."""
    tp = ctx.deployment.tensor_parallel
    nnodes = max(1, ctx.nnodes)
    if tp % nnodes:
        raise CapyError(
            f"deployment {ctx.deployment.name!r} asks for tensor_parallel {tp} across {nnodes} nodes; "
            "tensor_parallel must be divisible by nodes", code="invalid_topology", status=400)
    per_node = tp // nnodes
    if per_node > 1 and len(ctx.gpu_indices) < per_node:
        where = f" on each of its {nnodes} nodes" if nnodes > 1 else ""
        raise CapyError(
            f"deployment {ctx.deployment.name!r} asks for tensor_parallel {tp} ({per_node} GPU(s){where}) but "
            f"was given {len(ctx.gpu_indices)} GPU(s) {ctx.gpu_indices}", code="gpu_count_mismatch", status=400)
    return tp


def unsupported_task(deployment: DeploymentSpec, engine_kind: str, served: str) -> CapyError:
    """The refusal of a deployment whose ``task`` its engine cannot be started for."""
    return CapyError(
        f"deployment {deployment.name!r} sets task: {deployment.task}, which {engine_kind} cannot serve; "
        f"{served}", code="task_unsupported", status=400)


def registered_capabilities(engine: EngineSpec) -> frozenset[str]:
    """What a built-in engine's registration adds to its adapter's own list. The default list
    (chat, completions) adds nothing: the store keeps every field, so a registration read back
    carries it whether or not anyone wrote it, and a pooling deployment must not claim chat."""
    if "capabilities" not in engine.model_fields_set:
        return frozenset()
    listed = frozenset(engine.capabilities)
    return frozenset() if listed == DEFAULT_REGISTERED_CAPABILITIES else listed


def flag_value(args: list[str], *names: str) -> str | None:
    """The value the user's engine_args give one of ``names`` (``--name value`` or ``--name=value``),
    the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            value = args[i + 1]
        elif any(arg.startswith(name + "=") for name in names):
            value = arg.split("=", 1)[1]
    return value


def has_flag(args: list[str], *names: str) -> bool:
    """Whether the user's engine_args already set one of these flags (``--flag`` or ``--flag=value``)."""
    return any(a in names or any(a.startswith(n + "=") for n in names if n.startswith("--")) for a in args)


async def call(session: aiohttp.ClientSession, method: str, base_url: str, path: str, key: str | None, *,
               json: Any = None, params: Any = None, code: str, what: str) -> Any:
    """One control call to an engine; any failure becomes an EngineError with ``code``.

    No timeout here: parking and waking a large model can take minutes, so the caller bounds
    the whole operation with the deployment's park/wake timeout.
    """
    url = base_url.rstrip("/") + path
    try:
        async with session.request(method, url, json=json, params=params, headers=headers_for(key)) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise EngineError(
                    f"{what} failed: {method} {path} answered HTTP {resp.status}: {text[:300].strip()}",
                    code=code, detail={"status": resp.status, "path": path})
            if resp.content_type == "application/json" and text:
                return await resp.json()
            return text
    except aiohttp.ClientError as exc:
        if is_shortage(exc):  # the daemon's own, not the engine's (an EngineError still, for its callers)
            raise shortage_error(f"go on with {what} ({method} {path})", EngineError) from exc
        raise EngineError(f"{what} failed: cannot reach the engine at {base_url}: {exc}",
                          code="engine_unreachable", detail={"path": path}) from exc


class EngineAdapter(ABC):
    """How CapyCTL launches, probes, parks and wakes one kind of engine.

    ``park`` and ``wake`` assume the caller has already drained the deployment: no request in
    flight and none admitted until the call returns. vLLM's default sleep aborts running
    requests and SGLang's release asserts that none run, so parking without a drain loses work.
    """

    kind: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    # Whether the engine can serve HTTP on a unix socket (then the controller gives every local
    # launch a LaunchContext.socket_path and the adapter must bind there, not to host:port).
    unix_socket: ClassVar[bool] = False
    # Capabilities every engine of this kind has; a registration's explicit list adds to them.
    base_capabilities: ClassVar[frozenset[str]] = frozenset({"chat", "completions"})

    def capabilities(self, engine: EngineSpec, *, deployment: DeploymentSpec | None = None,
                     model_path: str | None = None) -> frozenset[str]:
        """What the proxy may route to this engine. ``deployment`` and ``model_path`` refine it where
        the engine's abilities depend on its flags or its model (llama-server's embeddings, systemone)."""
        return frozenset(self.base_capabilities | registered_capabilities(engine))

    def check_task(self, deployment: DeploymentSpec) -> None:
        """Refuse (``task_unsupported``) a deployment whose ``task`` this engine cannot be started for.
        Called when a deployment is recorded and again at every launch."""

    def park_method(self, target: LaunchContext | DeploymentSpec) -> ParkMethod:
        return "stop"

    def parsers(self, deployment: DeploymentSpec, model_path: str | None) -> Any:
        """The tool-call and reasoning parsers a launch renders and why (engines/_parsers.py
        ParserChoice); None for engines that choose none (llama.cpp parses with --jinja itself)."""
        return None

    def park_tier_refusal(self, deployment: DeploymentSpec, tier: str) -> str | None:
        """Why this engine cannot park ``deployment`` at ``tier`` (host_backed or deep); None: it can.
        The host's side (unified memory) is checked in _tiers.py."""
        return f"{self.kind} has no in-place park: it parks by stopping the unit (park_tier: restart)"

    def default_cores(self, deployment: DeploymentSpec, model_bytes: int) -> int | None:
        """Whole cores a CPU deployment of this engine gets when its manifest sets no
        ``resources.cpus``; None: its cores are not planned (it runs on any core)."""
        return None

    def parked_host_bytes(self, deployment: DeploymentSpec, model_bytes: int) -> int:
        """Host RAM an in-place park keeps: by default the weights (SGLang's CPU backup keeps a
        pinned copy of them, a custom engine's park is not known to free them)."""
        return model_bytes

    @abstractmethod
    def build_launch(self, ctx: LaunchContext) -> LaunchPlan:
        ...

    async def health(self, session: aiohttp.ClientSession, base_url: str, key: str | None) -> bool:
        """True when ``GET <health path>`` answers 200; False on any other answer or no answer.
        CapyError ``out_of_file_descriptors`` when the daemon could not even open the connection:
        that says nothing of the engine, and a watchdog must not count it as silence."""
        try:
            async with session.get(base_url.rstrip("/") + self.health_path, headers=headers_for(key),
                                   timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if is_shortage(exc):
                raise shortage_error("probe the engine's health") from exc
            return False

    async def park(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int) -> None:
        """Release the engine's memory in place. The caller must have drained in-flight requests first."""
        raise EngineError(f"{self.kind} has no in-place park; stop the unit instead", code="park_unsupported")

    async def wake(self, session: aiohttp.ClientSession, base_url: str, key: str | None, level: int,
                   model_path: str | None = None) -> None:
        """Restore what :meth:`park` released, so the engine serves again."""
        raise EngineError(f"{self.kind} has no in-place wake; start the unit instead", code="park_unsupported")

    async def is_parked(self, session: aiohttp.ClientSession, base_url: str, key: str | None) -> bool | None:
        """Whether the engine reports itself parked; None when the engine cannot tell."""
        return None

    def connections_max(self, deployment: DeploymentSpec) -> int | None:
        """The most connections the proxy may hold open at once to one engine of ``deployment``
        (kept-alive idle ones included); None where the engine's server takes any number."""
        return None

    def keeps_prompt_cache(self, deployment: DeploymentSpec) -> bool:
        """Whether a park by stopping can save this engine's prompt cache and its wake restore it."""
        return False

    def prompt_cache_ram(self, deployment: DeploymentSpec, model_path: str | None) -> int:
        """Host RAM the engine's in-memory prompt cache may grow into beyond what a fresh engine
        holds: planned, passed to the engine, and charged in the memory ledger."""
        return 0

    async def save_prompt_cache(self, session: aiohttp.ClientSession, base_url: str, key: str | None,
                                budget: int) -> SavedPromptCache:
        """Save the prompt cache into the launch's prompt_cache_dir, at most ``budget`` bytes
        (``bytes`` over it says the files must be dropped). The caller has drained requests."""
        raise EngineError(f"{self.kind} cannot save its prompt cache", code="prompt_cache_unsupported")

    async def restore_prompt_cache(self, session: aiohttp.ClientSession, base_url: str, key: str | None,
                                   files: tuple[str, ...]) -> RestoredPromptCache:
        """Load what :meth:`save_prompt_cache` saved, before any request is admitted."""
        raise EngineError(f"{self.kind} cannot restore a prompt cache", code="prompt_cache_unsupported")


def deployment_of(target: LaunchContext | DeploymentSpec) -> DeploymentSpec:
    return target.deployment if isinstance(target, LaunchContext) else target


def in_place_allowed(target: LaunchContext | DeploymentSpec) -> bool:
    """The deployment wants the engine's own park and the host allows development controls."""
    if deployment_of(target).park == "stop" or deployment_of(target).declared_park_tier == "restart":
        return False
    if isinstance(target, LaunchContext) and not target.dev_controls:
        return False
    return True
