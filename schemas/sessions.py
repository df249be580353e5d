"""HTTP models of the sessions API (``/v1/sessions``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.vocab import Decision, Reason, SessionState, Tier

METADATA_MAX_PAIRS = 32
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512
"""A session's metadata is held in the shared admission state and the ledger for as long as the
session and its retention: bounded per pair (OpenAI's metadata limits), about 19 KiB at most."""
MetadataValue = str | int | float | bool


class SessionCreate(BaseModel):
    """What an agent session declares it will need. All but ``tier`` have defaults."""

    # Strict: a number is a JSON number, as the document says; lax mode took `false` or "30"
    # for one. The tier alone is read from its name.
    model_config = ConfigDict(extra="forbid", strict=True)

    tier: Tier = Field(strict=False)
    max_parallel: int = Field(default=1, ge=1)
    min_parallel: int | None = Field(default=None, ge=1)
    """The fewest calls in flight the session accepts; where ``max_parallel`` does not fit, it
    is admitted with fewer, down to this (defaults to 1). ``lease.max_parallel`` in the answer
    is what was granted."""
    expected_calls: int | None = Field(default=None, ge=1)
    """Defaults to ``max_parallel``."""
    est_prompt_tokens: int | None = Field(default=None, ge=1)
    est_output_tokens: int | None = Field(default=None, ge=1)
    deadline_s: float | None = Field(default=None, gt=0)
    """Defaults to the tier's default deadline."""
    idle_timeout_s: float | None = Field(default=None, gt=0)
    max_wait_s: float | None = Field(default=None, ge=0)
    """How long the front door may hold this request waiting for room when the session does
    not fit now, before it answers 503 with ``Retry-After``; 0 answers at once. Defaults to
    the front door's ``admission_max_wait_s``, which is also the most that may be asked; a
    session is never held for more than half its deadline."""
    metadata: dict[str, MetadataValue] = Field(default_factory=dict, max_length=METADATA_MAX_PAIRS)

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, MetadataValue]) -> dict[str, MetadataValue]:
        # One check with one message, rather than the union's three errors per value.
        for key, value in metadata.items():
            if len(key) > METADATA_MAX_KEY:
                raise ValueError(f"a key is longer than {METADATA_MAX_KEY} characters")
            if isinstance(value, str) and len(value) > METADATA_MAX_VALUE:
                raise ValueError(
                    f"the value of {key!r} is longer than {METADATA_MAX_VALUE} characters"
                )
        return metadata


class SessionLease(BaseModel):
    reserved_tokens: int
    max_parallel: int
    expires_at: float
    """Unix seconds: the lease ends then unless a call extends it (idle timeout)."""
    deadline_at: float
    """Unix seconds: the lease never outlives this."""


class SessionAdmission(BaseModel):
    decision: Decision
    reason: Reason
    requested_parallel: int | None = None
    """The ``max_parallel`` asked for; ``lease.max_parallel`` is what was granted."""


class SessionOut(BaseModel):
    id: str
    object: Literal["session"] = "session"
    tenant: str
    tier: Tier
    state: SessionState
    created_at: float
    ended_at: float | None
    expected_calls: int
    est_prompt_tokens: int
    est_output_tokens: int
    idle_timeout_s: float
    calls_started: int
    metadata: dict[str, MetadataValue]
    lease: SessionLease
    admission: SessionAdmission | None = None
