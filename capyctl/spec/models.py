"""The pydantic models of what a user writes: deployment manifests and engine registrations."""

from __future__ import annotations

import re
from typing import Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ._units import Duration, Size

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9._/-]+$")

EngineKind = Literal["llama.cpp", "vllm", "sglang", "tensorfold", "custom"]
ENGINE_KIND_ALIASES = {
    "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama-cpp": "llama.cpp",
    "llama-server": "llama.cpp", "vllm": "vllm", "sglang": "sglang",
    "tensorfold": "tensorfold", "custom": "custom",
}
# "decisions": the engine answers TensorFold's POST /v1/decisions, onto which the proxy maps /v1/systemone.
# The others name the client routes of capyctl/proxy/_routes.py an engine answers.
Capability = Literal["chat", "completions", "embeddings", "systemone", "logprobs", "tools", "decisions",
                     "responses", "response_input_tokens", "responses_get", "responses_delete", "messages",
                     "tokenize", "tokenize_v1", "rerank", "score", "transcriptions"]
CAPABILITIES: tuple[str, ...] = get_args(Capability)
# What a deployment's engine is started to serve (DeploymentSpec.task): text generation, embedding
# vectors, or reranking; each adapter turns it into its engine's flags.
DeploymentTask = Literal["generate", "embed", "rerank"]
# What a park keeps (DeploymentSpec.park_tier); park_level, its older spelling, maps 1 and 2 onto it.
ParkTier = Literal["restart", "host_backed", "deep"]
PARK_LEVEL_TIERS = {1: "host_backed", 2: "deep"}
PARSER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HubModel(_Strict):
    """A model on the Hugging Face Hub: ``repo`` or ``repo@revision``; pinned to a commit at deploy time."""

    hf: str = Field(description="Hub repository, optionally pinned: `org/name` or `org/name@revision`.")
    file: str | None = Field(default=None, description="One file of the repository to use (a GGUF for llama.cpp).")

    @field_validator("hf")
    @classmethod
    def _check_hf(cls, v: str) -> str:
        repo, _, revision = v.partition("@")
        if not _HF_REPO.match(repo):
            raise ValueError(f"{repo!r} is not a Hub repository name such as 'HuggingFaceTB/SmolLM2-135M-Instruct'")
        if "@" in v and not _HF_REVISION.match(revision):
            raise ValueError(f"{revision!r} is not a revision (a branch, tag or commit)")
        return v

    @property
    def repo(self) -> str:
        return self.hf.partition("@")[0]

    @property
    def revision(self) -> str | None:
        return self.hf.partition("@")[2] or None


class PathModel(_Strict):
    """A model already on the host: a directory, or one file (a GGUF)."""

    path: str = Field(description="Absolute path of the model directory or file on the host.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"the model path must be absolute, got {v!r}")
        return v


ModelRef = Union[HubModel, PathModel]


class Resources(_Strict):
    gpus: int = Field(default=0, ge=0, le=64, description="Number of identical GPUs the deployment needs (0: CPU only); on each node of a multi-node deployment.")
    gpu_memory: Size | None = Field(default=None, description="GPU memory needed on each of its GPUs (8GiB, 40G).")
    ram: Size | None = Field(default=None, description="Host RAM budget; becomes the unit's MemoryMax (2GiB, 512M).")
    cpus: int | None = Field(default=None, ge=1, le=1024, description="Whole cores of its own, planned as memory is: "
                             "its unit is pinned to them (AllowedCPUs=, CPUAffinity=) and its engine's threads follow "
                             "them (llama.cpp -t/-tb, vLLM's VLLM_CPU_OMP_THREADS_BIND). Unset: a CPU deployment gets "
                             "its engine's default from the model size. At most the cores of its host.")
    tasks_max: int = Field(default=4096, ge=16, description="Most processes and threads the unit may have (TasksMax).")


class Timeouts(_Strict):
    start: Duration = Field(default=600.0, gt=0, description="Longest wait for the engine to answer its health check after a start.")
    wake: Duration = Field(default=600.0, gt=0, description="Longest wait for a parked deployment to serve again.")
    park: Duration = Field(default=120.0, gt=0, description="Longest wait for in-flight requests to drain and the engine to park.")
    stop: Duration = Field(default=30.0, gt=0, description="Grace time after SIGTERM before the unit is killed.")
    request: Duration = Field(default=600.0, gt=0, description="Longest time one proxied request may take.")
    unresponsive: Duration = Field(
        default=30.0, ge=1, description="A ready engine whose health check has not answered for this long "
        "(hung, or stopped with SIGSTOP) is declared failed (`engine_unresponsive`) and its unit stopped; "
        "its requests in flight get that error, and the next request after the restart backoff starts it "
        "again. Probed every few seconds; noticed within about this plus 10s.")


class PromptCache(_Strict):
    """The engine's prompt cache: what a park keeps of it, and the host RAM it may grow into."""

    keep_across_park: bool = Field(
        default=True, description="Save the engine's prompt cache at a park and restore it at the wake, "
        "so a long conversation's next turn skips its prefill (llama.cpp; see docs/engines-and-parking.md "
        "for the other engines). Dropped, not restored, when the model file, the engine or engine_args changed.")
    disk: Size = Field(
        default=2 << 30, description="The most the saved cache may take on disk (2GiB); a park whose cache is "
        "larger drops it.")
    ram: Size | None = Field(
        default=None, description="Host RAM for the engine's in-memory prompt cache (llama-server "
        "`--cache-ram`), charged in the memory plan and within resources.ram. Unset: two full contexts' KV "
        "cache, at most what resources.ram leaves beside the model; 0 turns the cache off.")


# Most replicas one deployment may have: each is a unit, a port and a charge in the memory plan.
MAX_REPLICAS = 64


class Replicas(_Strict):
    """How many engines serve one deployment, and how they scale and share its requests."""

    min: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="Replicas kept ready while the deployment "
                     "serves (0: the last one parks after `scale_down_after` with no request).")
    max: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="Most replicas; more than `min` are added under "
                     "load, one at a time.")
    scale_up_load: float = Field(
        default=4.0, gt=0, description="Requests in flight or waiting per ready replica past which a replica "
        "is added (when it has lasted `scale_up_after` and there is room without evicting a busy deployment).")
    scale_up_after: Duration = Field(default=5.0, gt=0, description="How long the load must stay past "
                                     "`scale_up_load` before a replica is added.")
    scale_down_after: Duration = Field(default=60.0, gt=0, description="A replica beyond `min` with no request "
                                       "for this long parks.")
    affinity_slack: int = Field(
        default=4, ge=0, description="Prefix affinity's bound: a request whose prompt begins like one a replica "
        "served recently goes to that replica unless it has more than this many requests beyond the least busy "
        "ready replica (0: always the least busy).")

    @model_validator(mode="after")
    def _bounds(self) -> "Replicas":
        if self.max < self.min:
            raise ValueError(f"replicas.max is {self.max} but replicas.min is {self.min}: max must be at least min")
        return self


class DeploymentSpec(_Strict):
    """A deployment manifest. Only ``name``, ``engine`` and ``model`` are required."""

    kind: Literal["deployment"] = Field(default="deployment", description="Manifest kind; `deployment` is the default.")
    name: str = Field(pattern=NAME_PATTERN, description="Deployment name: the `model` clients ask for and the unit `capyctl-<name>.service`.")
    engine: str = Field(min_length=1, description="A registered engine's name, or a kind: llama.cpp, vllm, sglang, tensorfold.")
    model: ModelRef = Field(description="`{hf: org/name[@revision]}` or `{path: /abs/dir-or-file}`.")
    aliases: list[str] = Field(default_factory=list, description="Other model names clients may ask for.")
    resources: Resources = Field(default_factory=Resources)
    tensor_parallel: int = Field(default=1, ge=1, le=64, description="GPUs one model instance spans: on one host, "
                                 "or in total across its `nodes` (each node holds tensor_parallel / nodes).")
    hosts: list[str] = Field(default_factory=list, description="Hosts to run on, in order of preference where they serve it equally well; empty lets the scheduler choose.")
    nodes: int = Field(default=1, ge=1, le=16, description="Machines one model instance spans through the engine's "
                       "multi-node mode (vLLM, SGLang): one member on each of the first `nodes` hosts, head first.")
    on_host_loss: Literal["wait", "move"] = Field(
        default="wait", description="When the host it runs on stops answering the server. `wait`: its requests "
        "answer 503 `host_offline` until the host is back, and the same engine is adopted again. `move`: it is "
        "started on another host its `hosts` allow, with room, and serves the requests that wait for it there; "
        "when the lost host comes back, its old unit there is stopped. One-host deployments only (`nodes: 1`).")
    engine_args: list[str] = Field(default_factory=list, description="Extra arguments appended to the engine's command line.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the engine process.")
    task: DeploymentTask = Field(
        default="generate", description="What the engine is started to serve. `generate`: text generation "
        "(chat, completions, Responses, Messages). `embed`: vectors on /v1/embeddings (llama-server "
        "`--embeddings`, with `--pooling last` when the GGUF names no pooling; vLLM `--runner pooling "
        "--convert embed`, which also serves /v1/score and /v1/rerank; SGLang `--is-embedding`). `rerank`: "
        "/v1/rerank with a reranker model (llama-server `--reranking`; vLLM `--runner pooling --convert "
        "classify`, also /v1/score; SGLang `--is-embedding` with a cross-encoder). TensorFold serves "
        "`generate` only. Unset, the engine's own flags in `engine_args` (`--embeddings`, `--runner pooling`, "
        "`--is-embedding` ...) decide.")
    park: Literal["auto", "stop", "never"] = Field(default="auto", description="auto: the engine's own park if it has one, else stop; stop: always stop; never: never parked or evicted.")
    park_tier: ParkTier | None = Field(
        default=None, description="What a park keeps. `restart`: stop the unit, start it again on wake. "
        "`host_backed`: weights kept in host RAM, KV cache dropped (vLLM sleep level 1; SGLang launched with "
        "`--enable-weights-cpu-backup`); refused on a host whose GPU and host memory are one pool, where it "
        "frees nothing. `deep`: weights and KV cache released, the weights re-read from disk on wake (vLLM "
        "sleep level 2; SGLang's memory saver). A tier the engine or host cannot deliver is refused at "
        "deploy. Unset: `restart` with `park: stop`, else `host_backed` (`deep` on a unified-memory host) "
        "where the engine parks in place.")
    park_level: Literal[1, 2] | None = Field(
        default=None, description="Deprecated alias of `park_tier`: 1 is `host_backed`, 2 is `deep`.")
    tool_call_parser: str = Field(
        default="auto", pattern=PARSER_PATTERN, description="vLLM and SGLang: `--tool-call-parser`. `auto`: "
        "chosen from the model's family (config.json `model_type`) and chat template; `none`: no parser "
        "(tool calls stay text in `content`); else a parser name the engine registers. The same option "
        "in `engine_args` wins.")
    reasoning_parser: str = Field(
        default="auto", pattern=PARSER_PATTERN, description="vLLM and SGLang: `--reasoning-parser`, chosen "
        "as `tool_call_parser` is (`auto`, `none` or a name).")
    idle_park_after: Duration | None = Field(default=None, description="Park after this long with no request (10m, 1h); unset: only to make room.")
    queue: int = Field(default=64, ge=1, le=100000, description="Most requests that may wait for this deployment; more get 429.")
    timeouts: Timeouts = Field(default_factory=Timeouts)
    prompt_cache: PromptCache = Field(default_factory=PromptCache)
    replicas: Replicas = Field(
        default_factory=Replicas, description="Engines serving this deployment, each its own unit "
        "`capyctl-<name>.service`, `capyctl-<name>@2.service` ...: a number (`replicas: 2`, always that "
        "many while it serves) or `{min: 1, max: 3}` to add replicas under load and park them when it ends. "
        "Requests go to the least busy ready replica, or to the one that served the start of their prompt "
        "(see docs/replicas.md).")

    @field_validator("replicas", mode="before")
    @classmethod
    def _replica_count(cls, v):
        if isinstance(v, bool):
            raise ValueError("replicas is a number of replicas or {min: M, max: N}")
        if isinstance(v, int):
            if not 1 <= v <= MAX_REPLICAS:
                raise ValueError(f"replicas is {v}: a fixed number of replicas is 1 to {MAX_REPLICAS} "
                                 "(use {min: 0, max: N} to let the last one park)")
            return {"min": v, "max": v}
        return v

    @field_validator("replicas")
    @classmethod
    def _replicas_of_one_host(cls, v: Replicas, info: ValidationInfo) -> Replicas:
        nodes = info.data.get("nodes", 1)
        if nodes > 1 and v.max > 1:
            raise ValueError(f"replicas.max is {v.max} but nodes is {nodes}: a multi-node deployment is one "
                             "engine spanning the hosts it names, and replicas of it are not supported (deploy "
                             "a second one under another name)")
        return v

    @field_validator("engine")
    @classmethod
    def _engine_name(cls, v: str) -> str:
        if not re.match(NAME_PATTERN, v.lower()):
            raise ValueError(f"{v!r} is not an engine name or kind")
        return ENGINE_KIND_ALIASES.get(v.lower(), v)

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for a in v:
            if not a or len(a) > 256 or any(c.isspace() for c in a):
                raise ValueError(f"{a!r} is not a model alias (1 to 256 characters, no spaces)")
        return v

    @field_validator("on_host_loss")
    @classmethod
    def _on_host_loss(cls, v: str, info: ValidationInfo) -> str:
        nodes = info.data.get("nodes", 1)
        if v == "move" and nodes > 1:
            raise ValueError(f"move needs nodes: 1 (nodes is {nodes}): a multi-node deployment's members run "
                             "on the hosts it names, head first, and cannot move")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
            if key.startswith("CAPYCTL_"):
                raise ValueError(f"{key!r}: names starting with CAPYCTL_ are reserved for CapyCTL")
        return v

    @model_validator(mode="after")
    def _topology(self) -> "DeploymentSpec":
        if self.nodes > 1 and self.tensor_parallel % self.nodes:
            # vLLM and SGLang read the tensor-parallel size as the total across nodes and split it
            # evenly (vLLM refuses a world size that --nnodes does not divide: engine/arg_utils.py).
            raise ValueError(
                f"tensor_parallel is {self.tensor_parallel} but nodes is {self.nodes}: tensor_parallel is the total "
                "across the nodes and must be divisible by nodes (each node holds tensor_parallel / nodes ranks)")
        per_node = self.tensor_parallel // self.nodes
        if per_node > 1 and self.resources.gpus and per_node > self.resources.gpus:
            raise ValueError(
                f"tensor_parallel is {self.tensor_parallel} but resources.gpus is {self.resources.gpus}"
                + (f" on each of {self.nodes} nodes" if self.nodes > 1 else "")
                + ": each tensor-parallel rank needs its own GPU")
        if self.nodes > 1 and len(self.hosts) < self.nodes:
            raise ValueError(f"nodes is {self.nodes} but hosts names {len(self.hosts)}: "
                             "a multi-node deployment lists the hosts its members run on, head first")
        if self.resources.gpu_memory is not None and self.resources.gpus == 0:
            raise ValueError("resources.gpu_memory is set but resources.gpus is 0")
        if self.park_tier is not None and self.park_level is not None \
                and PARK_LEVEL_TIERS[self.park_level] != self.park_tier:
            raise ValueError(f"park_tier is {self.park_tier} but park_level is {self.park_level} "
                             f"({PARK_LEVEL_TIERS[self.park_level]}); give park_tier alone")
        if self.park == "stop" and self.park_tier not in (None, "restart"):
            raise ValueError(f"park is stop but park_tier is {self.park_tier}: a park that stops the unit "
                             "keeps nothing; set park_tier: restart or park: auto")
        return self

    @property
    def declared_park_tier(self) -> str | None:
        """The tier the manifest asks for, or None: the engine's and host's default. ``park_level``
        (the older spelling, which manifests and stored revisions carry) counts as a preference only:
        it was written before tiers were checked, so park_tier.resolve_park_tier uses it where it
        can be delivered and never refuses a deployment for it."""
        if self.park == "stop":
            return "restart"
        return self.park_tier

    @property
    def gpus_needed(self) -> int:
        """GPUs on each host the deployment runs on (each node's share of a multi-node group)."""
        per_node = self.tensor_parallel // self.nodes
        return max(self.resources.gpus, per_node if per_node > 1 else 0)


class HttpCall(_Strict):
    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    path: str = Field(pattern=r"^/")
    body: dict | list | None = None


class EngineSpec(_Strict):
    """An engine registration: a built-in kind found at ``path``, or a custom server described here."""

    kind: Literal["engine"] = Field(description="Manifest kind: `engine`.")
    name: str = Field(pattern=NAME_PATTERN, description="Name deployments use in their `engine` field.")
    type: EngineKind = Field(description="llama.cpp, vllm, sglang, tensorfold or custom.")
    path: str | None = Field(default=None, description="llama-server binary, or the virtual environment holding vllm/sglang/tensorfold.")
    version: str | None = None
    cmd: list[str] | None = Field(default=None, description="custom: command template with {port} {host} {model} {name}.")
    key_env: str | None = Field(default=None, description="custom: the environment variable the server reads its per-launch API key from (CAPYCTL_ENGINE_KEY is always set as well).")
    health: str = Field(default="/health", pattern=r"^/", description="custom: path answering 200 when ready.")
    park: HttpCall | None = Field(default=None, description="custom: HTTP call that releases GPU memory in place.")
    wake: HttpCall | None = Field(default=None, description="custom: HTTP call that restores it.")
    env: dict[str, str] = Field(default_factory=dict)
    capabilities: list[Capability] = Field(
        default_factory=lambda: ["chat", "completions"],
        description="custom: the client routes the server answers, by capability: chat, completions, embeddings, "
        "responses, response_input_tokens, responses_get, responses_delete, messages (/v1/messages and "
        "count_tokens), tokenize (/tokenize, /detokenize), tokenize_v1 (/v1/tokenize), rerank, score, "
        "transcriptions, systemone, decisions, logprobs, tools. A built-in engine's list adds to what its "
        "adapter declares.")

    @field_validator("type", mode="before")
    @classmethod
    def _kind(cls, v: object) -> object:
        return ENGINE_KIND_ALIASES.get(v.lower(), v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _custom(self) -> "EngineSpec":
        if self.type == "custom":
            if not self.cmd:
                raise ValueError("a custom engine needs `cmd`, a command template with {port}")
            if not any("{port}" in part for part in self.cmd):
                raise ValueError("`cmd` must contain {port}: CapyCTL leases the port the engine listens on")
            if any("{key}" in part for part in self.cmd):
                raise ValueError("`cmd` must not contain {key}: the key would be on the command line, where every "
                                 "local user reads it (/proc/PID/cmdline); the server finds it in the environment "
                                 "variable CAPYCTL_ENGINE_KEY, or in the variable `key_env` names")
            if self.key_env is not None and not _ENV_NAME.match(self.key_env):
                raise ValueError(f"`key_env` {self.key_env!r} is not an environment variable name")
            if (self.park is None) != (self.wake is None):
                raise ValueError("`park` and `wake` go together: give both or neither")
        elif self.key_env is not None:
            raise ValueError(f"`key_env` is only for custom engines; a {self.type} engine's key variable is built in")
        elif self.cmd is not None:
            raise ValueError(f"`cmd` is only for custom engines; a {self.type} engine's command is built in")
        return self
