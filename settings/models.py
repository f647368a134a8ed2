"""Configuration models: one source for env vars (ROLLFLOW_*), an optional .env file and CLI flags."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The largest count a setting takes: what a JSON number holds exactly everywhere it travels (Prefect's
# database and UI included); beyond it a flow run's parameters could not be stored or shown.
MAX_COUNT = 2**53
# The longest time a setting takes (a week): longer is a typo, and `inf` never reaches a timer.
MAX_SECONDS = 7 * 24 * 3600.0


class Settings(BaseModel):
    """Every settings model: NaN and infinity are refused, whatever the source (flag, env, .env, UI), and
    so is an unknown field: a typo (`limti`) in a run's parameters or in ROLLFLOW_* must not run as
    though it were left out."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


class BackendKind(StrEnum):
    agent = "agent"
    responses = "responses"
    chat = "chat"


KEEP_CHUNKS = (
    "Keep each chunk's data object once a JSONL dataset is published (by default it goes once the dataset "
    "holds it; resume and reverify read it there). A Parquet output always keeps them: its shards do not "
    "give back the exact rows"
)
RAY_TAKES_NONE = "Ray's take none: host:port or ray://host:port"


def no_userinfo(value: str | None, what: str, instead: str) -> str | None:
    """`value` unless it carries a user:password@ (any "@": a URL's or an address's), which would be
    written into Prefect's parameters and the report with it; the error does not echo it."""
    if (
        value is not None and "@" in value
    ):  # anywhere: a password holding "/" moved the userinfo past the host's end
        raise ValueError(
            f'{what} carries a user and password (before its "@"), which rollflow does not take there; '
            f"{instead}"
        )
    return value


def no_url_credentials(value: str | None) -> str | None:
    """A store URL's user:password@ would be written in clear into run.json, the report and the flow
    run's parameters: refused (without echoing it); credentials come from the storage settings."""
    if value is not None and "://" in value and "@" in value.split("://", 1)[1].split("/", 1)[0]:
        raise ValueError(
            'the URL carries a user and password (before its "@"), which would be written into '
            "the run's records; give them as ROLLFLOW_STORAGE__* settings (S3) or in the store's "
            "own configuration"
        )
    return value


def split_urls(value: str) -> list[str]:
    """A comma-separated list of http(s) base URLs, stripped; a bad item is named in the error."""
    urls = [item.strip() for item in value.split(",")]
    for n, url in enumerate(urls, 1):  # before any message echoes the list
        no_userinfo(url, f"backend URL {n}", "give the backend's key as ROLLFLOW_BACKEND__API_KEY")
    seen: set[str] = set()
    for n, url in enumerate(urls, 1):
        where = f"item {n} of the backend URL list {value!r}" if len(urls) > 1 else f"backend URL {url!r}"
        if not url:
            raise ValueError(
                f"{where} is empty; pass comma-separated URLs, e.g. http://h1:8000,http://h2:8000"
            )
        scheme, sep, rest = url.partition("://")
        if scheme.lower() not in ("http", "https") or not sep or not rest.strip("/"):
            raise ValueError(f"{where} ({url!r}) is not an http(s) URL; pass e.g. http://127.0.0.1:8000")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises for a port that is not a number from 0 to 65535
        except ValueError as exc:
            raise ValueError(
                f"{where} ({url!r}) has an invalid port ({exc}); ports run from 1 to 65535"
            ) from None
        if not parts.hostname:
            raise ValueError(f"{where} ({url!r}) names no host; pass e.g. http://127.0.0.1:8000")
        key = url.rstrip("/")
        if key in seen:
            raise ValueError(f"{where} ({url!r}) is listed twice; list each endpoint once")
        seen.add(key)
    return urls


# Base URLs taken with the API version OpenAI clients put in them (`http://host:8000/v1`): the responses
# and chat backends add `/v1/...` themselves, so such a base is the same server without it.
API_VERSION_SUFFIX = "/v1"
# What each URL given with the suffix was taken as, until the command says so once (`url_notes`).
_URL_NOTES: dict[str, str] = {}
_URL_SAID: set[str] = set()


# What an OpenAI client's base or a full endpoint URL ends in, beyond the base rollflow adds /v1/... to.
API_PATHS = ("/v1/chat/completions", "/v1/responses", API_VERSION_SUFFIX)


def api_base(url: str) -> str:
    """`url` without a trailing `/v1`, `/v1/chat/completions` or `/v1/responses` (any case, a query kept):
    the base the responses and chat backends add /v1/... to."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for suffix in API_PATHS:
        if path.lower().endswith(suffix):
            return parts._replace(path=path[: -len(suffix)]).geturl()
    return url


def api_bases(value: str) -> str:
    """A comma-separated URL list with each item's `/v1` suffix taken off (`api_base`), noted once."""
    urls = split_urls(value)
    bases = [api_base(url) for url in urls]
    if bases == urls:
        return value
    for url, base in zip(urls, bases, strict=True):
        if url != base:
            _URL_NOTES.setdefault(url, base)
    return ",".join(bases)


def url_notes() -> list[str]:
    """Each backend URL taken without its `/v1` since the last call, said once per process."""
    notes = [
        f"the backend URL {url} ends in /v1, which rollflow adds itself (it sends /v1/responses or "
        f"/v1/chat/completions): using {base}"
        for url, base in _URL_NOTES.items()
        if url not in _URL_SAID
    ]
    _URL_SAID.update(_URL_NOTES)
    _URL_NOTES.clear()
    return notes


class AgentServer(Settings):
    """Where one NeMo Gym agent's rows go: the server that runs its `/run`, and what NeMo Gym calls it."""

    url: str = Field(..., description="Base URL of the server that answers this agent's /run")
    server: str | None = Field(None, description="NeMo Gym's name for that server (_ng_environment_server)")
    server_type: str | None = Field(None, description="Its implementation (_ng_result_type)")

    @field_validator("url")
    @classmethod
    def _one_url(cls, value: str) -> str:
        split_urls(value)
        return value


DEFAULT_HEAD_SERVER = "http://127.0.0.1:11000"  # NeMo Gym's own default (head_server.port 11000)


class BackendParams(Settings):
    """Where rollouts come from and how hard to try for each one (no secrets: safe as a flow parameter)."""

    kind: BackendKind = Field(BackendKind.responses, description="agent | responses | chat")
    url: str = Field(
        "http://127.0.0.1:8000",
        description="Base URL of the inference backend or agent server; several replicas comma-separated",
    )
    model: str | None = Field(None, description="Model name sent to responses/chat backends")
    timeout_s: float = Field(600.0, gt=0, le=MAX_SECONDS, description="Per-request timeout (whole request)")
    connect_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS, description="TCP connect timeout")
    max_retries: int = Field(5, ge=0, le=50, description="Retries per rollout on transient errors")
    prefix_affinity: bool = Field(
        True,
        description="Send a task's repeats to the replica that served it before while it is about as free "
        "as the least loaded, so its prefix cache computes the prompt once",
    )
    backoff_base_s: float = Field(
        0.5, ge=0, le=MAX_SECONDS, description="First backoff; doubles each retry, with jitter"
    )
    backoff_max_s: float = Field(
        30.0, ge=0, le=MAX_SECONDS, description="Largest backoff, also caps Retry-After"
    )
    head_server: str | None = Field(
        None,
        description="NeMo Gym head server that names each agent's server (agent backends; "
        f"{DEFAULT_HEAD_SERVER} when an agent run gives no --backend-url)",
    )
    agents: dict[str, AgentServer] = Field(
        default_factory=dict,
        description="Agent name -> its server, for rows routed by agent_ref.name (read from the head "
        "server when one is set); each agent's rows go to its own server only",
    )

    sources: dict[str, str] = Field(
        default_factory=dict,
        description="task_source -> the agent its rows go to when they name no agent (read from the head "
        "server: an agent instance, or the one agent bound to a resources server)",
    )

    @field_validator("url")
    @classmethod
    def _valid_url_list(cls, value: str) -> str:
        split_urls(value)
        return value

    @field_validator("head_server")
    @classmethod
    def _head_server_url(cls, value: str | None) -> str | None:
        if value is not None:
            no_userinfo(value, "the head server URL", "NeMo Gym's head server takes none")
            split_urls(value)
        return value

    @property
    def urls(self) -> list[str]:
        """The endpoints, one per replica, in the order given: each agent's when rows route by agent."""
        if self.agents:
            seen: dict[str, None] = {}
            for server in self.agents.values():
                seen.update(dict.fromkeys(u.rstrip("/") for u in split_urls(server.url)))
            return list(seen)
        return split_urls(self.url)

    @model_validator(mode="after")
    def _url_of_agents(self) -> BackendParams:
        """With agents, `url` lists their servers, so everything that reads the URL list reads them.
        Responses and chat backends add `/v1/...` to their base, so a base given with its `/v1` (as OpenAI
        clients take it) is taken without it: here, whichever way the URL came (flag, ROLLFLOW_BACKEND__URL,
        a flow run's parameters, a replica list). An agent server's /run has no /v1: its URL stays."""
        if self.agents:
            self.__dict__["url"] = ",".join(self.urls)
        elif self.kind in (BackendKind.responses, BackendKind.chat):
            self.__dict__["url"] = api_bases(self.url)
        return self

    def groups(self) -> dict[str, frozenset[str]]:
        """URL -> the agents whose rows it may answer (empty when rows are not routed by agent)."""
        found: dict[str, set[str]] = {}
        for name, server in self.agents.items():
            for url in split_urls(server.url):
                found.setdefault(url.rstrip("/"), set()).add(name)
        return {url: frozenset(names) for url, names in found.items()}


class BackendSettings(BackendParams):
    """BackendParams plus the API key, which only ever comes from the environment."""

    api_key: SecretStr | None = Field(None, description="Bearer token for the backend; never logged")
    api_key_block: str | None = Field(
        None, description="Prefect Secret block holding the API key, read by the flow when api_key is unset"
    )

    def params(self) -> BackendParams:
        return BackendParams(**self.model_dump(exclude={"api_key", "api_key_block"}))

    def for_url(self, url: str) -> BackendSettings:
        """A copy pointing at one endpoint (the API key is kept: replicas share it)."""
        urls = split_urls(url)
        if len(urls) != 1:
            raise ValueError(f"for_url takes one endpoint, got {len(urls)}: {url!r}")
        return self.model_copy(update={"url": urls[0], "agents": {}})


class StorageSettings(Settings):
    """fsspec options for s3:// (or other remote) input and output."""

    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); default AWS")
    access_key_id: SecretStr | None = Field(None, description="S3 access key; else the AWS default chain")
    secret_access_key: SecretStr | None = Field(None, description="S3 secret key; else the AWS default chain")
    region: str | None = Field(None, description="S3 region")
    access_key_id_block: str | None = Field(
        None, description="Prefect Secret block holding the S3 access key, used when access_key_id is unset"
    )
    secret_access_key_block: str | None = Field(
        None, description="Prefect Secret block holding the S3 secret, used when secret_access_key is unset"
    )

    def storage_options(self, url: str) -> dict[str, Any]:
        """fsspec keyword arguments for `url`; empty for local paths."""
        if not url.startswith(("s3://", "s3a://")):
            return {}
        opts: dict[str, Any] = {}
        client_kwargs: dict[str, Any] = {}
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        if self.region:
            client_kwargs["region_name"] = self.region
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
        if self.access_key_id and self.secret_access_key:
            opts["key"] = self.access_key_id.get_secret_value()
            opts["secret"] = self.secret_access_key.get_secret_value()
        return opts


class CollectionSettings(Settings):
    """How the input is planned into chunks and how many requests run at once."""

    parallelism: Annotated[int, Field(ge=1, le=65536)] | Literal["auto", "adaptive"] = Field(
        32,
        description="Requests in flight across all chunks: a number; auto (a long run on an engine with "
        "gauges follows them, any other run diagnoses and tunes first, then holds the choice); or adaptive "
        "(follows the engine's gauges from its stated capacity, or without gauges tunes first and then "
        "follows latency and 429s)",
    )
    chunk_size: Annotated[int, Field(ge=1, le=1_000_000)] | Literal["auto"] = Field(
        "auto",
        description="Input rows per chunk task: a number, or auto (1,000 rows on every runner, fewer when "
        "they make more than 5,000 rollouts; a resumed run keeps its chunks)",
    )
    num_repeats: int = Field(1, ge=1, le=10_000, description="Rollouts per input row")
    limit: int | None = Field(None, ge=1, le=MAX_COUNT, description="Use only the first N rows of the input")
    chunks_in_flight: int | None = Field(
        None, ge=1, le=1024, description="Chunks collected at once; default enough to keep parallelism fed"
    )
    chunk_retries: int = Field(3, ge=0, le=100, description="Prefect retries of a whole chunk task")
    skip_bad_rows: bool = Field(False, description="Record malformed input rows in bad_rows.jsonl and go on")
    agent_name: str | None = Field(
        None,
        description="Routes every row to this agent, overriding the row's agent_ref (NeMo Gym's "
        "+agent_name; an agent the head server does not know is refused)",
    )
    agent_map: dict[str, str] = Field(
        default_factory=dict,
        description="Re-routing by the row's agent_ref.name or task_source: {old: new}; '_default' "
        "applies to every row without an entry (NeMo Gym's +agent_map)",
    )
    aggregate_metrics: bool = Field(
        True,
        description="Agent runs through a head server: write <dataset stem>_aggregate_metrics.json from "
        "each environment server's /aggregate_metrics (NeMo Gym's +disable_aggregation turns it off)",
    )
    num_repeats_by_agent: dict[str, int] = Field(
        default_factory=dict,
        description="NeMo Gym's per-agent +num_repeats: each row's agent needs an entry (or '_default'); "
        "the entries give the run its one num_repeats",
    )
    repeat_seed: bool = Field(
        False,
        description="Send each rollout's index as its sampling seed in metadata.extra_body (NeMo Gym's "
        "+num_repeats_add_seed; vLLM model servers honour it)",
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=2**63 - 1,
        description="Base sampling seed: each request carries a seed derived from it and its (task, rollout)",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="JSON merged into responses_create_params"
    )
    flush_interval_s: float = Field(
        5.0, ge=0, le=3600, description="Save a running chunk's finished rollouts this often (0: never)"
    )
    stall_timeout_s: float = Field(
        0.0,
        ge=0,
        le=MAX_SECONDS,
        description="Cancel and retry a chunk when no rollout finishes for this long (0: never)",
    )
    record_latency: bool = Field(
        False, description="Add _rf.latency_s to each row (makes datasets differ run to run)"
    )
    settle_after: int | None = Field(
        None,
        ge=0,  # 0 and 1 are refused below, with the reason
        le=10_000,
        description="Give each task this many rollouts first; when all of them are correct, or all wrong "
        "(at --correct-threshold), the task is settled and gets no more, otherwise it gets the rest up to "
        "--num-repeats",
    )
    until_learnable: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Stop starting chunks once this many committed tasks have mixed outcomes (some "
        "rollouts correct, some wrong); the rest of the input is not collected",
    )

    @model_validator(mode="after")
    def _settle_below_repeats(self) -> CollectionSettings:
        if self.settle_after == 1:
            raise ValueError(
                "settle_after 1 settles every task: one rollout always agrees with itself, so no task would "
                "get a second; give 2 or more"
            )
        if self.settle_after == 0:
            raise ValueError(
                "settle_after 0 would settle tasks on no rollout at all; give 2 or more, or leave it out to "
                "give every task num_repeats rollouts"
            )
        if self.until_learnable is not None and self.num_repeats < 2:
            raise ValueError(
                f"until_learnable {self.until_learnable} needs num_repeats 2 or more: a task is learnable "
                "when some of its rollouts are correct and some wrong, which one rollout never is"
            )
        if self.settle_after is not None and self.settle_after >= self.num_repeats:
            raise ValueError(
                f"settle_after {self.settle_after} must be below num_repeats {self.num_repeats}: a task "
                f"settles after its first settle_after rollouts, before the rest"
            )
        return self

    @model_validator(mode="after")
    def _one_default_agent(self) -> CollectionSettings:
        default = self.agent_map.get("_default")
        if self.agent_name is not None and default is not None and default != self.agent_name:
            raise ValueError(
                f"agent_name {self.agent_name!r} conflicts with agent_map._default {default!r}; set only one"
            )
        return self


class TuningSettings(Settings):
    """diagnose-bottleneck and tune-parallelism knobs (used when parallelism is auto or adaptive)."""

    diagnose_low: int = Field(5, ge=1, le=65536, description="Low parallelism of the diagnosis")
    diagnose_high: int = Field(20, ge=2, le=65536, description="High parallelism of the diagnosis")
    probe_share: float = Field(
        0.1,
        gt=0,
        le=1,
        description="With parallelism auto, tuning stops once diagnosis and tuning have spent this share "
        "of the run's rollouts (the diagnosis always runs; every probe rollout is kept in the dataset)",
    )
    engine_min_rollouts: int = Field(
        5000,
        ge=0,
        le=MAX_COUNT,
        description="With parallelism auto, a run of at least this many rollouts over engines that publish "
        "their gauges (vLLM, SGLang) follows them as it goes instead of tuning first",
    )
    diagnose_rows: int = Field(100, ge=10, le=MAX_COUNT, description="Rollouts at each diagnosis level")
    reuse_diagnosis_s: float = Field(
        3600,
        ge=0,
        le=7 * 86400,
        description="Tuning uses the diagnosis `rollflow diagnose` wrote into the output for the same "
        "backend when it is at most this many seconds old, instead of diagnosing again (0: always diagnose)",
    )
    tune_start: int = Field(
        8, ge=1, le=65536, description="First level of the search when there is no diagnosis"
    )
    tune_step_rollouts: int = Field(100, ge=10, le=MAX_COUNT, description="Fewest rollouts per search step")
    plateau_gain: float = Field(
        0.05, gt=0, le=100, description="A doubling that gains less than this is a plateau"
    )
    max_error_rate: float = Field(0.02, ge=0, le=1, description="Failure rate that stops the search")
    headroom: float = Field(
        0.8, gt=0, le=1, description="Back-off factor when the chosen value fails its stability stretch"
    )
    target_share: float = Field(
        0.97,
        gt=0,
        le=1,
        description="The choice is the smallest parallelism reaching this share of the best throughput",
    )
    max_parallelism: int = Field(4096, ge=1, le=65536, description="Never search above this")


BuiltinVerifier = Annotated[
    Literal["exact_match", "math", "math_fast", "http", "none"], Field(title="built-in")
]
# A typed union rather than a free string, so the Prefect run form offers the built-ins as choices.
CallableVerifier = Annotated[
    str,
    Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", title="module:function", examples=["my_rewards:score"]),
]


class VerifySettings(Settings):
    """How rewards are computed for backends that return none."""

    verifier: BuiltinVerifier | CallableVerifier | None = Field(
        None,
        description="Reward for replies that carry none: a built-in (exact_match, math, math_fast, http, "
        "none) or module:function, your Python callable (row, text) -> float; default exact_match for "
        "responses/chat backends, none for agent backends (an agent's own reward is always kept)",
    )
    url: str | None = Field(None, description="NeMo Gym resources server for the http verifier")
    processes: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="Processes running math and synchronous module:function checks (0: a thread of the "
        "collecting process); default from the cores",
    )
    node_processes: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Verifier processes per node, split evenly over the node's Dask or Ray worker "
        "processes (--verify-processes, when given, applies to each worker process instead); default "
        "from the node's cores",
    )
    check_timeout_s: float = Field(
        60.0,
        gt=0,
        le=MAX_SECONDS,
        description="Longest one check may run, whatever the verifier (in a verifier process, a thread, "
        "or on the event loop); past it the rollout fails as verifier_timeout",
    )
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        le=MAX_SECONDS,
        description="Longest a verifier process may take to import its verifier (not counted against any "
        "check); past it, or when the import fails, its checks fail as verifier_crash",
    )
    timeout_s: float = Field(
        60.0, gt=0, le=MAX_SECONDS, description="Per-request timeout of the http verifier"
    )
    correct_threshold: float = Field(
        1.0,
        allow_inf_nan=False,
        description="A rollout counts as correct in the reward statistics (pass@k, all/none/mixed "
        "tasks) when its reward is at least this",
    )

    @field_validator("url")
    @classmethod
    def _url_plain(cls, value: str | None) -> str | None:
        return no_userinfo(value, "the verifier URL", "the resources server is reached without one")

    def verifier_for(self, backend_kind: str) -> str:
        """The verifier a backend of `backend_kind` gets: the one set, else its default."""
        if self.verifier is not None:
            return self.verifier
        return "none" if backend_kind == "agent" else "exact_match"


class EngineSettings(Settings):
    """Where chunks run: this process, or the worker processes of a Dask or Ray cluster."""

    runner: Literal["local", "dask", "ray"] = Field(
        "local",
        description="local: chunks in this process; dask or ray: chunks on a cluster's worker processes",
    )
    collectors: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="Collector processes of the local runner (runs only; reverify ignores it): 1 to 64, or "
        "auto (more than one only when tuning found the collecting process at a core while the machine "
        "had cores idle); more than one run as a local Dask cluster on 127.0.0.1",
    )
    dask_address: str | None = Field(
        None, description="Scheduler of an existing Dask cluster (tcp://host:8786)"
    )
    dask_workers: int = Field(2, ge=1, le=1024, description="Worker processes of a local Dask cluster")
    dask_cluster_class: str | None = Field(
        None, description="A Dask cluster class that starts its own workers (dask_jobqueue.SLURMCluster)"
    )
    dask_cluster_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="JSON keyword arguments of --dask-cluster-class"
    )
    dask_adapt_min: int | None = Field(None, ge=0, le=100_000, description="Fewest workers adapt keeps")
    dask_adapt_max: int | None = Field(None, ge=1, le=100_000, description="Most workers adapt starts")
    ray_address: str | None = Field(
        None, description="An existing Ray cluster (ray://head:10001 or auto); default a local instance"
    )
    ray_keep_workers_s: float = Field(
        0.0,
        ge=0,
        le=86_400,
        description="Keep chunk worker processes on the Ray cluster this many seconds after their last "
        "chunk, one per CPU, so the next run skips their start (0: Ray starts them for each run)",
    )

    @field_validator("ray_address")
    @classmethod
    def _ray_address_words(cls, value: str | None) -> str | None:
        value = no_userinfo(value, "the Ray address", RAY_TAKES_NONE)
        value = not_blank(value, "the Ray address", "host:port, ray://host:port or auto", "a local instance")
        return None if value is None else ray_address_words(value)

    @field_validator("dask_address")
    @classmethod
    def _dask_address_plain(cls, value: str | None) -> str | None:
        value = no_userinfo(value, "the Dask address", "Dask's take none: tcp://host:port")
        return not_blank(value, "the Dask address", "tcp://host:port", "a local cluster")

    @field_validator("dask_cluster_class")
    @classmethod
    def _cluster_class_given(cls, value: str | None) -> str | None:
        return not_blank(value, "the Dask cluster class", "module.Class", "a local cluster")


def not_blank(value: str | None, what: str, form: str, otherwise: str) -> str | None:
    """`value` unless it is empty or spaces: `--ray-address "$HEAD"` with HEAD unset would otherwise run
    the whole job on this machine instead of the cluster meant."""
    if value is not None and not value.strip():
        raise ValueError(f"{what} is empty; give {form}, or leave it out for {otherwise}")
    return value


def ray_address_words(value: str) -> str:
    """A Ray address as given (the flag, or RAY_ADDRESS): stripped, `AUTO` and ` auto` meaning what `auto`
    does, as `local` (Ray's own check would reject them mid-run)."""
    value = value.strip()
    return value.lower() if value.lower() in ("auto", "local") else value


class PipelineSettings(EngineSettings):
    """Where the run reads and writes, and what it may do to existing output."""

    input: str | None = Field(None, description="Input JSONL: local path or any fsspec URL (s3://...)")
    output: str | None = Field(None, description="Output directory: local path or any fsspec URL")
    restart: bool = Field(False, description="Discard committed chunks of a different run and start over")
    allow_incomplete: bool = Field(False, description="Publish rollouts.jsonl even if the audit failed")
    keep_chunks: bool = Field(
        False,
        description=KEEP_CHUNKS,
    )
    deadline_s: float | None = Field(
        None,
        gt=0,
        le=MAX_SECONDS,
        description="Stop cleanly after this many seconds, keeping all committed work",
    )
    lease_ttl_s: float = Field(
        60.0,
        ge=1,
        le=MAX_SECONDS,
        description="Output lease lifetime; renewed every third of it while the run lives",
    )


class PrefectSettings(Settings):
    """Which Prefect server a CLI run uses when no PREFECT_API_URL is configured."""

    local_server: Literal["keep", "ephemeral"] = Field(
        "keep",
        description="keep: reuse the server at the Prefect profile's address, or start one there that "
        "stays (`prefect server start --background`; `prefect server stop` stops it); ephemeral: "
        "Prefect's temporary in-process server, gone with the command",
    )
    start_timeout_s: float = Field(
        180.0,
        gt=0,
        le=MAX_SECONDS,
        description="How long a run waits for the Prefect server it started (kept or ephemeral) to answer",
    )
    idle_stop_s: float = Field(
        3600.0,
        ge=0,
        le=MAX_SECONDS,
        description="The kept server stops after this many seconds with no flow run under way and no "
        "deployment served (an idle server still uses part of a core); the next run starts it again. "
        "0: it stays until `prefect server stop`",
    )


class RollflowSettings(BaseSettings):
    """Everything rollflow reads from the environment: ROLLFLOW_<GROUP>__<FIELD>, or a .env file."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLFLOW_",
        env_nested_delimiter="__",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        allow_inf_nan=False,
    )

    backend: BackendSettings = Field(default_factory=BackendSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    collection: CollectionSettings = Field(default_factory=CollectionSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)
    tuning: TuningSettings = Field(default_factory=TuningSettings)
    pipeline: PipelineSettings = Field(default_factory=PipelineSettings)
    prefect: PrefectSettings = Field(default_factory=PrefectSettings)
