"""The OpenAI request bodies this server accepts (pydantic models), and what they become for the engine. Every
field a client may send is declared; anything else is refused with a 400 naming the field (OpenAI's fields this
engine does not implement, such as `tools`, say so). Sampling fields a request leaves out take the server's
defaults (the model's generation config where it has one), exactly as `LLM.generate` does."""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.types import FailFast
from pydantic_core import PydanticCustomError, PydanticUseDefault


class _FailFast(FailFast):
    """A list stops at its first bad item: a body of a million bad items is one error, not a million (whose
    materialising held the event loop for seconds). Hashable, so that a union's members can carry it."""

    __hash__ = object.__hash__


_FAST = _FailFast()
IntList = Annotated[list[int], _FAST]
StrList = Annotated[list[str], _FAST]

# OpenAI fields refused with a clear reason rather than "unknown field"
UNSUPPORTED = {
    "tools": "tool calling is not supported by this server",
    "tool_choice": "tool calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "function_call": "function calling is not supported by this server",
    "parallel_tool_calls": "tool calling is not supported by this server",
    "audio": "audio output is not supported by this server",
    "modalities": "only text output is supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "reasoning_effort": "reasoning models are not served here",
    "suffix": "suffix (insertion) is not supported by this server",
}


def wrong_kind(value: Any, annotation: str) -> str | None:
    """What is wrong when a JSON true / false stands where a field (`annotation`, its type as text; or its list's
    items, its dict's values) takes no boolean, or a string where it takes no string: `max_tokens: true` ran as 1, a
    prompt of [true, false] as the ids [1, 0], `seed: "1"` as 1 and `include_usage: "yes"` as true (pydantic's lax
    mode; OpenAI's API refuses them all)."""
    if "Any" in annotation:
        return None
    if isinstance(value, list) and "list[" in annotation:
        items = [w for v in value for w in (v if isinstance(v, list) else [v])]
    elif isinstance(value, dict) and "dict[" in annotation:
        items, annotation = list(value.values()), annotation.split(",", 1)[-1]  # the values' type
    else:
        items = [value]
    if "bool" not in annotation and any(isinstance(v, bool) for v in items):
        return "true / false is not a number here"
    if "str" not in annotation and "Literal" not in annotation and any(isinstance(v, str) for v in items):
        flag = "bool" in annotation and "int" not in annotation and "float" not in annotation
        return f"a string is not {'true / false' if flag else 'a number'} here"
    return None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's optional fields take `null` for "not given" (`n`, `stream`, `logprobs`, `echo`, a completion's
        `max_tokens`, ...), and clients send it: a field left at null gets its default."""
        if value is None and info.field_name is not None:
            declared = cls.model_fields[info.field_name]
            if not declared.is_required() and declared.default is not None:
                raise PydanticUseDefault()
        if info.field_name is not None and (wrong := wrong_kind(value, _annotation(cls, info.field_name))):
            raise ValueError(wrong)  # pydantic's lax mode read true as 1, "1" as 1 and "yes" as true
        return value


@functools.cache
def _annotation(model: type[BaseModel], name: str) -> str:
    """A field's type as text (read once per model and field, not once per request)."""
    return str(model.model_fields[name].annotation)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class SamplingFields(Strict):
    """The sampling fields both endpoints take (OpenAI's, plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | StrList | None = None
    stop_token_ids: IntList | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    bad_words: StrList | None = None
    allowed_token_ids: IntList | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # false (OpenAI's default): nothing is stored for later retrieval, as here
    service_tier: str | None = None  # "auto" or "default" (OpenAI's default tier): the one tier there is

    @field_validator("logit_bias")
    @classmethod
    def _openai_bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and not all(-100 <= bias <= 100 for bias in value.values()):  # NaN is outside too
            raise PydanticCustomError("bias_range", "values must be in [-100, 100] (OpenAI's range)")
        return value

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("unsupported", "stored completions are not supported by this server")
        return value

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise PydanticCustomError(
                "unsupported", "this server has one service tier, 'auto' or 'default', not '{value}'", {"value": value}
            )
        return value

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields the request set (the rest are the server's defaults)."""
        fields = {
            name: getattr(self, name)
            for name in (
                "n",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "stop",
                "stop_token_ids",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "min_tokens",
                "ignore_eos",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "bad_words",
                "allowed_token_ids",
            )
        }
        out = {k: v for k, v in fields.items() if v is not None}
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        out["max_tokens"] = max_tokens  # None (a chat that gave none): the rest of the context, as the engine reads it
        if logprobs is not None:
            out["logprobs"] = logprobs
        structured = self.structured_outputs()
        if structured is not None:
            out["structured_outputs"] = structured
        return out

    def structured_outputs(self) -> dict[str, Any] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"json": {"type": "object"}}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise FieldError(
                "response_format.json_schema.schema",
                "response_format type json_schema needs json_schema.schema (a JSON schema object)",
            )
        return {"json": fmt.json_schema.schema_}


class CompletionRequest(SamplingFields):
    prompt: str | StrList | IntList | Annotated[list[IntList], _FAST]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    def prompts(self) -> list[dict[str, Any]]:
        """One add_request prompt per prompt given (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise FieldError("prompt", "prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class TextPart(Strict):
    model_config = ConfigDict(extra="allow")  # another kind's fields: refused by its kind, not field by field

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise PydanticCustomError(
                "unsupported", f"content parts of type {self.type!r} are not supported (text only)"
            )
        if self.text is None:
            raise PydanticCustomError("unsupported", "a text part needs its text")
        return self


class Message(Strict):
    """A chat message. The fields an assistant message the client got back carries (OpenAI's `refusal`,
    `annotations`, `audio`, `function_call`, `tool_calls`) are taken when null, as `openai` clients send a dumped
    message back in the history; a refusal is its text."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], _FAST] | None = Field(default=None, validate_default=True)
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    @field_validator("audio", "function_call", "tool_calls", "tool_call_id", mode="before")
    @classmethod
    def _no_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, []):
            what = "audio" if info.field_name == "audio" else "tool calling"
            raise PydanticCustomError("unsupported", f"{what} is not supported by this server")
        return None

    @field_validator("role")
    @classmethod
    def _not_a_tool(cls, role: str) -> str:
        """A tool's answer needs the tool call it answers (OpenAI's tool_call_id), which this server never makes."""
        if role == "tool":
            raise PydanticCustomError(
                "unsupported", "a tool message answers a tool call: tool calling is not supported"
            )
        return role

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: ValidationInfo) -> Any:
        """Every message but an assistant's needs its content, and a list of parts at least one (OpenAI: a 400;
        here each was read as empty text)."""
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise PydanticCustomError("missing_content", f"a {role} message needs its content")
        if content == []:
            raise PydanticCustomError("empty_content", "an empty list of content parts: give at least one")
        return content

    def plain(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None:
            content = self.refusal
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


# fields of UNSUPPORTED whose value asks for nothing this server lacks, taken as vLLM takes them (SDK wrappers send
# them by default): no tool call, either tool-call policy, text output
ASKS_NOTHING = {
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "modalities": lambda v: v == ["text"],
}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], _FAST]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _what_asks_nothing(cls, data: Any) -> Any:
        """ASKS_NOTHING's values dropped before validation: the request is the one without them."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in ASKS_NOTHING and ASKS_NOTHING[k](v))}
        return data

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sent_as(self) -> dict[str, str]:
        """The engine's names for what this chat request sent under its own (max_new_tokens, num_logprobs): its
        errors name the field the client sent (request_error)."""
        sent = {"logprobs": "top_logprobs"}  # a chat's `logprobs` is a switch: the count is its top_logprobs
        if self.max_completion_tokens is not None:
            sent["max_tokens"] = "max_completion_tokens"
        return sent


class FieldError(ValueError):
    """A request field the server refuses: a 400 naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, " ".join(message.split()), param, kind
        self.code, self.headers = code, headers

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field (dotted path); one of ours (`unsupported`: a
    content part's kind, a tool call) before what a union's other members say (`content` is no string)."""
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "unsupported"), errors[0])
    loc = [str(x) for x in err["loc"] if not _union_tag(x)]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        leaf = loc[-1] if loc else "?"
        reason = UNSUPPORTED.get(leaf, "this server does not know this field")
        return ApiError(400, f"unsupported field {param}: {reason}", param)
    return ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param)


def _union_tag(part: Any) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[int]`, ...) in an error's location."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none") or part.startswith(("list[", "dict[", "tuple[", "function-"))
    )


def request_error(exc: Exception, fields: Any) -> ApiError:
    """A RequestError / ConfigError from the engine's intake as a 400; `param` is the field it names first, under
    the name the client sent it by (a chat's max_completion_tokens and top_logprobs, the engine's max_tokens and
    logprobs), as the message says it."""
    message = str(exc)  # the engine's request id (the job's, then the prompt's index) is no client's: dropped
    many = isinstance(getattr(fields, "prompt", None), list) and len(fields.prompts()) > 1
    message = re.sub(r"^request \S+?-(\d+): ", lambda m: f"prompt {m[1]}: " if many else "", message)
    for engine_name, sent in (fields.sent_as() if hasattr(fields, "sent_as") else {}).items():
        message = re.sub(rf"\b{engine_name}\b", sent, message)
    fmt = getattr(fields, "response_format", None)
    if message.startswith("invalid structured_outputs.json") and fmt is not None:  # its schema, as the client named it
        param = "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"
        return ApiError(400, message.replace("structured_outputs.json", param, 1), param)
    names = sorted(getattr(type(fields), "model_fields", {}), key=len, reverse=True) + [
        "max_tokens",
        "prompt",
        "logprobs",
    ]
    param = next((n for n in names if message.startswith(n) or f" {n} " in f" {message} "), None)
    if param == "prompt" and "messages" in names:  # a chat's prompt is what its messages make
        param = "messages"
    return ApiError(400, message, param)


@dataclass
class ServedModel:
    name: str  # what clients send as `model`
    aliases: tuple[str, ...]
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)
