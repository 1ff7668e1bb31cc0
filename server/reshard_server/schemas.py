"""Request and response models: ``JobCreate`` in, ``JobPublic`` out (shared with the client)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from reshard_svc.jobs.spec import (
    WORKERS,
    ConvertSpec,
    Option,
    argument_help,
    options,
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


class _Options(BaseModel):
    """What every conversion body shares: no unknown field, and each option parsed as
    :meth:`ConvertSpec.checked` parses it (a 422 names the field)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _before(cls, v: Any, info: ValidationInfo) -> Any:
        opt = _FORMS.get(info.field_name or "")
        return v if opt is None else opt.form.before_json(v)

    @field_validator("*")
    @classmethod
    def _after(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        opt = _FORMS.get(name)
        return v if v is None or opt is None else opt.form.after_json(name, v)

    def options(self) -> dict[str, Any]:
        """The conversion options that were given, as a job body's fields."""
        return self.model_dump(include=set(OPTION_FIELDS), exclude_none=True)


#: every spec option, and the ``workers`` shorthand of a body
_OPTIONS = [*options(), ("workers", None, WORKERS)]
_FORMS: dict[str, Option] = {name: opt for name, _, opt in _OPTIONS}


def _json_field(default: Any, opt: Option) -> tuple[Any, Any]:
    """A spec option as a JSON field: its form says its type and default (counts: unset,
    the spec's default or derived from ``workers``); its help is the description."""
    return opt.form.json_field(default, opt.help)


_FIELDS: dict[str, Any] = {name: _json_field(default, opt) for name, default, opt in _OPTIONS}
#: the fields of a conversion's options in a body
OPTION_FIELDS = frozenset(_FIELDS)

if TYPE_CHECKING:

    class ConvertOptions(_Options):
        """(For type checkers: the fields are made at import from the spec's options.)"""

        def __getattr__(self, name: str) -> Any: ...

else:
    ConvertOptions = create_model(
        "ConvertOptions",
        __base__=_Options,
        __module__=__name__,
        __doc__="How a conversion reshapes what it reads (everything but where from and where "
        "to): shared by a job, a plan and a watch's jobs. Made from the options "
        ":class:`reshard_svc.jobs.spec.ConvertSpec` declares.",
        **_FIELDS,
    )


class JobCreate(ConvertOptions):
    """A conversion to run: ``source`` -> ``target`` with a new mesh / rules / format.

    Field types give the OpenAPI schema; the values are checked by
    :class:`reshard_svc.jobs.spec.ConvertSpec`, the contract the workers run (422 otherwise).
    """

    source: Annotated[
        str, Field(min_length=1, max_length=4096, description=argument_help("source"))
    ]
    target: Annotated[
        str, Field(min_length=1, max_length=4096, description=argument_help("target"))
    ]

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
