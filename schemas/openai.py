"""OpenAI-compatible HTTP models (the subset of the chat completions API kvgate serves)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The range of ``seed`` as vLLM reads it (a signed 64-bit integer), and of every integer a
request body may carry (``api.bodies``)."""


class ChatMessageIn(BaseModel):
    """A message as the front door checks it: its role. Everything else (content parts, tool
    calls, names) is the worker's serving layer's to read."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Any = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _CallRequest(BaseModel):
    """What kvgate itself reads of a request: the model, the output budget (admission sizes
    the session by it), whether to stream, the tier's priority. Every other field travels to
    the worker unchanged, where vLLM's serving layer reads it (and refuses, by name, a field
    it would ignore)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    # Checked here, although only vLLM reads it: a seed past vLLM's range would otherwise be
    # admitted and queued, then refused by the worker (and cannot travel in msgpack at all).
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_CallRequest):
    """``POST /v1/chat/completions``: OpenAI's fields, and vLLM's extensions, as vLLM serves
    them."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class CompletionRequest(_CallRequest):
    """``POST /v1/completions``: OpenAI's legacy text completions, as vLLM serves them."""

    prompt: str | list[str] | list[int] | list[list[int]]


class MessagesRequest(BaseModel):
    """``POST /v1/messages``: Anthropic's Messages API, as vLLM serves it. kvgate reads the
    same few fields as for OpenAI's APIs; ``max_tokens`` is required, as in Anthropic's."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    stream: bool = False

    @property
    def n(self) -> int:
        return 1

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvgate"
    max_model_len: int | None = None
    """As vLLM lists it: the longest prompt plus output the model's workers take."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, plus ``retry_after`` (seconds) where waiting helps."""

    error: ErrorDetail
    retry_after: int | None = None
    decision: str | None = None
    """``defer`` or ``reject`` when admission refused."""

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.error.model_dump()}
        if self.retry_after is not None:
            body["retry_after"] = self.retry_after
        if self.decision is not None:
            body["decision"] = self.decision
        return body


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str
    code: str
    """kvgate's code, as in the OpenAI shape."""
    param: str | None = None


class AnthropicErrorBody(BaseModel):
    """Anthropic's error shape (on ``/v1/messages``), plus ``retry_after`` (seconds) where
    waiting helps."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
    retry_after: int | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
