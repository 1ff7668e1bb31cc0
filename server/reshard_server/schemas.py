"""Request and response models: ``JobCreate`` in, ``JobPublic`` out (shared with the client)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from reshard_svc.plan.spec import (
    CHECKSUMS,
    DEQUANTIZE,
    FORMATS,
    MAX_WORKERS,
    STRATEGIES,
    ConvertSpec,
    check_count,
    parse_dtype,
    parse_mesh,
    parse_rules,
    parse_size,
)

__all__ = [
    "ConvertOptions",
    "JobCreate",
    "JobList",
    "JobLogs",
    "JobPublic",
    "JobState",
    "PlanCreate",
    "ProgressPublic",
    "WatchCreate",
    "WatchList",
    "WatchPublic",
    "WatchStep",
]


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class ConvertOptions(BaseModel):
    """How a conversion reshapes what it reads (everything but where from and where to):
    shared by a job and a watch's jobs."""

    model_config = ConfigDict(extra="forbid")

    mesh: dict[str, StrictInt] | None = Field(
        default=None, description='target mesh, e.g. {"tp": 2} or {"dp": 2, "tp": 4}'
    )
    rules: dict[str, str | list[str]] | None = Field(
        default=None, description="tensor-name glob -> placements, first match wins"
    )
    format: Literal[FORMATS] = "native"  # type: ignore[valid-type]
    dtype: str | None = Field(
        default=None,
        description="cast floating-point tensors of 1+ dims to bf16, fp16, fp32 or fp64 "
        "(0-dim scalars keep theirs)",
    )
    keep_dtype: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        default=None, max_length=1000, description="with dtype: tensor globs that keep theirs"
    )
    nodes: StrictInt = Field(default=1, description="nodes (torchrun agents) the job runs on")
    workers_per_node: StrictInt | None = Field(
        default=None, description="workers per node (default: workers / nodes, else 1)"
    )
    workers: StrictInt | None = Field(
        default=None, description="total workers = nodes x workers_per_node (shorthand)"
    )
    strategy: Literal[STRATEGIES] = "auto"  # type: ignore[valid-type]
    checksum: Literal[CHECKSUMS] = Field(  # type: ignore[valid-type]
        default="crc32c", description="what the output records (crc32c block CRCs by default)"
    )
    max_memory: str | None = Field(
        default=None, max_length=32, description="per-worker budget, e.g. 1GiB"
    )
    max_shard_size: str | None = Field(
        default=None, max_length=32, description="HF export: cap per file, e.g. 5GB"
    )
    overwrite: StrictBool = Field(
        default=False,
        description="replace a committed checkpoint at the target (other files there are kept)",
    )
    only: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        default=None, max_length=1000, description="keep only tensors matching these globs"
    )
    strip_prefix: str | None = Field(
        default=None, min_length=1, max_length=1024, description="drop this name prefix"
    )
    copy_config: StrictBool = Field(
        default=True, description="an HF export copies the source's config and tokenizer files"
    )
    rename: list[str] | None = Field(
        default=None,
        max_length=1000,
        description="FROM_GLOB=TO_PATTERN rules applied in order before only/strip_prefix",
    )
    split_layers: StrictBool = Field(
        default=False,
        description="split Megatron-Core's stacked layers/experts axes into per-layer tensors",
    )
    dequantize: Literal[DEQUANTIZE] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="fp8-block: FP8 weights x their 128x128 block scales, cast to dtype "
        "(default bf16); the scales are dropped",
    )

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh(cls, v: Any) -> Any:
        return parse_mesh(v) if isinstance(v, dict) else v

    @field_validator("rules")
    @classmethod
    def _rules(cls, v: Any) -> Any:
        return parse_rules(v)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        return parse_dtype(v)

    @field_validator("max_memory", "max_shard_size")
    @classmethod
    def _size(cls, v: str | None, info: ValidationInfo) -> str | None:
        parse_size(v, info.field_name or "size")
        return v

    @field_validator("nodes", "workers_per_node", "workers")
    @classmethod
    def _count(cls, v: int | None, info: ValidationInfo) -> int | None:
        return None if v is None else check_count(info.field_name or "count", v, MAX_WORKERS)

    def options(self) -> dict[str, Any]:
        """The conversion options that were given, as a job body's fields."""
        return self.model_dump(include=set(ConvertOptions.model_fields), exclude_none=True)


class JobCreate(ConvertOptions):
    """A conversion to run: ``source`` -> ``target`` with a new mesh / rules / format.

    Field types give the OpenAPI schema; the values are checked by
    :class:`reshard_svc.plan.spec.ConvertSpec`, the contract the workers run (422 otherwise).
    """

    source: Annotated[
        str, Field(min_length=1, max_length=4096, description="checkpoint URI to read")
    ]
    target: Annotated[str, Field(min_length=1, max_length=4096, description="new checkpoint URI")]

    @model_validator(mode="after")
    def _contract(self) -> JobCreate:
        self._spec = ConvertSpec.from_json(self.model_dump(exclude_none=True))
        return self

    _spec: ConvertSpec = PrivateAttr()

    def to_spec(self) -> ConvertSpec:
        """The checked, normalised job contract."""
        return self._spec


class PlanCreate(ConvertOptions):
    """A dry run: plan converting ``source`` on ``world`` workers (or, ``load``, loading it
    on the mesh's ranks) and say what each would do. Nothing is written."""

    source: Annotated[
        str, Field(min_length=1, max_length=4096, description="checkpoint URI to read")
    ]
    world: StrictInt | None = Field(
        default=None,
        ge=1,
        le=65536,
        description="workers to plan for (default: the mesh's size with load, else workers)",
    )
    load: StrictBool = Field(default=False, description="size a load on the mesh's ranks")

    @model_validator(mode="after")
    def _contract(self) -> PlanCreate:
        self._spec = ConvertSpec.from_json(
            {**self.options(), "source": self.source, "target": self.source.rstrip("/") + ".plan"}
        )
        return self

    _spec: ConvertSpec = PrivateAttr()

    def to_spec(self) -> ConvertSpec:
        return self._spec


#: the one placeholder a watch's target template holds
STEP_FIELD = "{step}"


class WatchCreate(ConvertOptions):
    """Watch a training root: one job per newly committed step folder (``step-N``,
    ``step_N``, ``iter_N``, ``global_step_N``, ``checkpoint-N``) whose number is a multiple
    of ``every``, converting it to ``target`` with ``{step}`` replaced by the step."""

    root: Annotated[
        str, Field(min_length=1, max_length=4096, description="the folder of step folders")
    ]
    target: Annotated[
        str,
        Field(
            min_length=1,
            max_length=4096,
            description="where each step goes; holds {step}, e.g. s3://exports/hf-{step}",
        ),
    ]
    every: StrictInt = Field(default=1, ge=1, le=10**12, description="only steps divisible by it")
    existing: StrictBool = Field(
        default=False,
        description="also convert the steps already committed when the watch starts",
    )

    @field_validator("target")
    @classmethod
    def _template(cls, v: str) -> str:
        if STEP_FIELD not in v:
            raise ValueError(
                f"target must hold {STEP_FIELD} (one folder per step), e.g. /exports/hf-{{step}}"
            )
        if "{" in v.replace(STEP_FIELD, "") or "}" in v.replace(STEP_FIELD, ""):
            raise ValueError(f"target may hold no placeholder but {STEP_FIELD}")
        return v

    @model_validator(mode="after")
    def _contract(self) -> WatchCreate:
        self.job(0, self.root.rstrip("/") + "/step-0")  # the jobs it will submit are valid
        return self

    def target_for(self, step: int) -> str:
        return self.target.replace(STEP_FIELD, str(step))

    def job(self, step: int, source: str) -> JobCreate:
        """The job converting step ``step`` (stored at ``source``)."""
        return JobCreate(**self.options(), source=source, target=self.target_for(step))


class ProgressPublic(BaseModel):
    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0


class JobPublic(BaseModel):
    id: str
    state: JobState
    spec: JobCreate
    source: str
    target: str
    progress: ProgressPublic
    throughput_bytes_per_s: float | None = None
    owner: str = Field(default="", description="the user that submitted it")
    error: str | None = None
    reason: str | None = Field(
        default=None,
        description="why the engine keeps a queued job waiting, in its own words "
        "(e.g. 'Slurm: PartitionNodeLimit')",
    )
    attempts: int = 0
    engine: str | None = Field(
        default=None, description="launcher that ran it: local, slurm, kubernetes"
    )
    handle: dict[str, Any] | None = Field(
        default=None, description="the engine's reference: PID, Slurm job id, TrainJob name"
    )
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class JobList(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class JobLogs(BaseModel):
    id: str
    offset: int
    next_offset: int
    size: int
    text: str


class WatchStep(BaseModel):
    step: int
    source: str
    outcome: Literal["submitted", "existing", "refused"] = Field(
        description="submitted: a job converts it; existing: committed before the watch "
        "started (not converted); refused: the server refused its job (see detail)"
    )
    job_id: str | None = None
    detail: str | None = None
    at: datetime


class WatchPublic(BaseModel):
    id: str
    owner: str = Field(default="", description="the user that started it")
    state: Literal["active", "stopped"]
    spec: WatchCreate
    root: str
    target: str
    every: int
    submitted: int = Field(description="jobs this watch submitted")
    steps: list[WatchStep] = Field(description="the steps it has seen, newest first (up to 100)")
    error: str | None = Field(
        default=None, description="why the last scan failed (the root unreadable), if it did"
    )
    created_at: datetime
    last_scan_at: datetime | None = None
    stopped_at: datetime | None = None


class WatchList(BaseModel):
    items: list[WatchPublic]


class AuditEntry(BaseModel):
    seq: int
    at: datetime
    principal: str = Field(description="the user; empty when no token was recognised")
    action: str
    target: str
    outcome: str = Field(description="ok, existing, or refused")
    code: int = Field(description="the HTTP status of a refusal (0 otherwise)")
    detail: str
    address: str = Field(description="the client's address")


class AuditList(BaseModel):
    items: list[AuditEntry]
