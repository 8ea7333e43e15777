"""OpenAI-compatible request and response models (pydantic), with every field range-checked before any work.

Requests are parsed from bytes by `parse_body` (depth-limited JSON, so a 100,000-deep document is a 400, not a
RecursionError) and validated by these models; any failure becomes an `InvalidRequest` naming the field. Parameters
this server does not implement are refused by name instead of being silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .errors import InvalidRequest

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOKENS_LIMIT = (1 << 31) - 1
MAX_TOKEN_ID = (1 << 31) - 1  # above any vocabulary; the served model's own size is checked per request
MAX_STOP_STRINGS = 4          # as OpenAI
MAX_STOP_CHARS = 1024         # per stop string; keeps stop matching per token small (text_stream.py)
MAX_N = 16
MAX_LOGPROBS = 20
MAX_JSON_DEPTH = 64


def _depth_ok(body: Any, limit: int, raw: bytes) -> bool:
    """Nesting depth of a parsed JSON document <= limit. The walk visits containers only (the parser already bounded
    recursion: a deeper document raised RecursionError there). A long list (token IDs) would cost a Python step per
    item, so on meeting one the walk first counts brackets in the bytes (C speed): few enough settles it."""
    stack = [(body, 1)]
    counted = False
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        if not counted and len(node) > 4 * limit:
            if raw.count(b"[") + raw.count(b"{") <= limit:
                return True
            counted = True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def parse_body(raw: bytes) -> dict[str, Any]:
    """Bytes -> a JSON object, or InvalidRequest (see parse_request)."""
    return parse_request(raw)[0]


def parse_request(raw: bytes) -> tuple[dict[str, Any], bool]:
    """Bytes -> (a JSON object, whether its strings are known to be free of lone surrogates), or InvalidRequest.
    Rejects invalid UTF-8, lone surrogates, NaN/Infinity and nesting deeper than MAX_JSON_DEPTH.

    orjson parses first (2-3x the stdlib's speed on a long conversation: ~7 ms instead of ~20 ms for 5.7 MB); it
    refuses everything the stdlib path refuses (invalid UTF-8, NaN, lone surrogates, deep nesting), and any document
    it refuses goes through the stdlib path, so that errors read as they always did. (orjson reads an integer past
    2**64 as a float where the stdlib keeps an int: every integer field refuses both, naming the same field.)"""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        if isinstance(body, dict) and _depth_ok(body, MAX_JSON_DEPTH, raw):
            return body, True
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8: {exc}") from None

    def no_constants(name: str) -> Any:
        raise InvalidRequest(f"request body contains {name}, which is not JSON")
    too_deep = InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise too_deep from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if not _depth_ok(body, MAX_JSON_DEPTH, raw):
        raise too_deep
    return body, False


def _check_text(value: str, where: str, info: ValidationInfo | None = None) -> str:
    # JSON's \ud800 escapes decode to lone surrogates, which have no UTF-8 form and no token. A body orjson parsed has
    # none (it refuses them): the O(text) check is skipped (the validation context says so).
    if info is not None and info.context and info.context.get("text_checked"):
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} contains a lone surrogate at character {exc.start}") from None
    return value


def _integral_ids(v: Any) -> Any:
    """A list's integral floats as ints (JSON Schema's integers include 3.0: token ids given as integral floats)."""
    if isinstance(v, list):
        return [int(t) if isinstance(t, float) and t.is_integer() and abs(t) < 2.0 ** 63 else t for t in v]
    return v


def _check_messages(messages: list[Any] | None, info: ValidationInfo) -> None:
    for i, m in enumerate(messages or ()):
        _check_text(m.text(), f"messages[{i}].content", info)


_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "best_of", "top_logprobs", "logprobs", "top_k",
               "min_tokens")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON Schema counts 1.0 as an integer: integer fields accept integral floats (never strings or bools)."""
        if isinstance(data, dict):
            fix = {k: int(v) for k in _INT_FIELDS if isinstance(v := data.get(k), float) and v.is_integer()
                   and abs(v) < 2.0 ** 63}
            if fix:
                data = {**data, **fix}
        return data


# OpenAI's and vLLM's sampling parameters beyond temperature / top_p, and the values that leave sampling as it is.
# This project's engine implements all of them (engine/sampler.py); the tokenization tier forwards the ones its
# upstream wires carry (the gRPC SamplingParams has no logit_bias).
_SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                                                 "top_k": (None, -1, 0), "min_p": (None, 0),
                                                 "repetition_penalty": (None, 1), "logit_bias": (None, {}),
                                                 "min_tokens": (None, 0)}
FORWARDABLE_SAMPLING = frozenset(_SAMPLING_NEUTRAL) - {"logit_bias"}
ENGINE_SAMPLING = frozenset(_SAMPLING_NEUTRAL)
MAX_LOGIT_BIAS = 300    # entries (OpenAI's limit)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = None   # vLLM's: ids that end it
    user: str | None = None
    prompt_cache_key: str | None = None    # conversations with different keys never share a tokenization session
    # Sampling adjustments (engine/sampler.py has their semantics, vLLM's). A server whose engine lacks one refuses
    # it by name when set to anything but its neutral value (see `unsupported`), never drops it silently.
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)   # vLLM's: no stop id, EOS or stop string before
    # vLLM's text options: the matched stop string kept at the end of the text; special tokens written as text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    tools: Any = Field(None, json_schema_extra={"enum": [None, []]})
    tool_choice: Any = Field(None, json_schema_extra={"enum": [None, "none"]})
    functions: Any = Field(None, json_schema_extra={"enum": [None, []]})
    function_call: Any = Field(None, json_schema_extra={"enum": [None, "none"]})
    response_format: Any = Field(None, json_schema_extra={"anyOf": [
        {"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]}]})

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string is limited to {MAX_STOP_CHARS} characters, got {len(s)}")
            _check_text(s, "stop")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys are token ids (decimal strings), got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"a bias is in [-100, 100], got {bias} for token {key}")
        return v

    def sampling(self) -> dict[str, Any]:
        """The adjustments as engine.sampler.SamplingParams fields (neutral when unset)."""
        return {"top_k": self.top_k or 0, "min_p": self.min_p or 0.0,
                "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "logit_bias": tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items()),
                "min_tokens": self.min_tokens or 0}

    def unsupported(self, forwarded: frozenset[str] = frozenset()) -> list[str]:
        """Parameters set to something this server cannot do; `forwarded`: sampling parameters it passes on to an
        engine that implements them (the tokenization tier)."""
        bad = []
        for name, neutral in _SAMPLING_NEUTRAL.items():
            if name not in forwarded and getattr(self, name) not in neutral:
                bad.append(name)
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                bad.append(name)
        rf = self.response_format
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            bad.append("response_format")
        return bad

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives to report per output token (0: the token's own logprob only); None: no logprobs."""
        return None

    @property
    def conversation_key(self) -> str | None:
        return self.prompt_cache_key or self.user

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]


class CompletionRequest(_Common):
    # A batch of one (OpenAI's list form) is accepted and unwrapped; larger batches are refused by name.
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # top alternatives per token (0: the token's own)
    echo: bool = Field(False, json_schema_extra={"const": False})
    suffix: str | None = Field(None, json_schema_extra={"enum": [None, ""]})
    best_of: int | None = Field(None, json_schema_extra={"enum": [None, 1]})   # (and best_of == n is accepted)

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch_of_one(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request (or use n)")
            v = v[0]
        return _integral_ids(v)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any, info: ValidationInfo) -> str | list[int]:
        if isinstance(v, str):
            return _check_text(v, "prompt", info)
        if not all(isinstance(t, int) for t in v):
            raise ValueError("prompt must be a string or a list of token ids")
        return v

    @property
    def prompt_value(self) -> str | list[int]:
        """The prompt after validation: a string or token ids (a batch of one was unwrapped)."""
        p = self.prompt
        assert isinstance(p, str) or all(isinstance(t, int) for t in p)
        return p  # type: ignore[return-value]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self, forwarded: frozenset[str] = frozenset()) -> list[str]:
        bad = super().unsupported(forwarded)
        if self.echo:
            bad.append("echo")
        if self.suffix:
            bad.append("suffix")
        if self.best_of not in (None, 1, self.n):
            bad.append("best_of")
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128
_FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class FunctionCall(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str = Field(max_length=1 << 20)   # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = Field(None, max_length=1 << 16)
    parameters: dict[str, Any] | None = None    # a JSON Schema object, shown to the model as given
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(_Strict):
    # What `_tool_fields` checks, stated in the schema for generated clients and schema-driven fuzzers.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
        {"if": {"properties": {"tool_calls": {"type": "array", "minItems": 1}}, "required": ["tool_calls"]},
         "then": {"properties": {"role": {"const": "assistant"}}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)    # an assistant turn that called tools
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)    # a tool's answer: the call it answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    # top_logprobs needs logprobs: true (as OpenAI requires), stated in the schema for generated clients too.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tools reach the model through its chat template; its calls come back as message.tool_calls where the server
    # parses its template's format (tool_calls.py). "required" and a named function would need constrained decoding.
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = Field(None, json_schema_extra={"enum": [None, "none", "auto"]})
    parallel_tool_calls: bool | None = None

    def unsupported(self, forwarded: frozenset[str] = frozenset()) -> list[str]:
        served = "tools" in forwarded
        bad = [name for name in super().unsupported(forwarded)
               if not (served and name == "tools") and name != "tool_choice"]
        if not served and any(m.uses_tools for m in self.messages) and "tools" not in bad:
            bad.append("tools")
        if self.tool_choice not in (None, "none", "auto") or (self.tool_choice == "auto" and not served):
            bad.append("tool_choice")
        return bad

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        _check_messages(v, info)
        return v


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a completion prompt or a chat conversation -> the IDs this server's completion or chat
    route would send to its engine for it (the same tokenizer, template and sessionless encode)."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [   # exactly one of them (`_one_input`)
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True     # accepted as vLLM clients send it; no BOS is added outside the template
    return_token_strs: bool = False
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)     # rendered as the chat route renders them
    prompt_cache_key: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else _check_text(v, "prompt", info)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        _check_messages(v, info)
        return v

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return None

    def unsupported(self, forwarded: frozenset[str] = frozenset()) -> list[str]:
        uses = bool(self.tools) or any(m.uses_tools for m in self.messages or ())
        return ["tools"] if uses and "tools" not in forwarded else []


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize: token IDs -> their text."""
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]
    prompt_cache_key: str | None = None

    @field_validator("tokens", mode="before")
    @classmethod
    def _integral(cls, v: Any) -> Any:
        return _integral_ids(v)

    @property
    def num_logprobs(self) -> int | None:
        return None

    def unsupported(self, forwarded: frozenset[str] = frozenset()) -> list[str]:
        return []


def validate(model: type[_Common] | type[TokenizeRequest] | type[DetokenizeRequest], body: dict[str, Any],
             text_checked: bool = False,
             forwarded: frozenset[str] = frozenset()) -> Any:
    """A validated request, or InvalidRequest naming the first bad field (and each unsupported parameter).
    text_checked: the body's strings are known to hold no lone surrogates (parse_request says so); forwarded: the
    sampling parameters the server passes on to its engine (see _Common.unsupported)."""
    try:
        req = model.model_validate(body, context={"text_checked": True} if text_checked else None)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        msg = err["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"invalid `{loc}`: {msg}", param=param) from None
    try:
        _ = req.num_logprobs
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="top_logprobs") from None
    bad = req.unsupported(forwarded)
    if bad:
        raise InvalidRequest(f"unsupported parameter(s) {bad}: this server does not implement them",
                             param=bad[0], code="unsupported_parameter")
    return req


# -- responses (for the OpenAPI schema; handlers build plain dicts of these shapes) --------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    routing: dict[str, Any] | list[dict[str, Any] | None] | None = None   # a list with n > 1


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    routing: dict[str, Any] | list[dict[str, Any] | None] | None = None   # a list with n > 1


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


__all__ = ["ChatCompletionRequest", "ChatCompletionResponse", "ChatMessage", "CompletionRequest",
           "CompletionResponse", "DetokenizeRequest", "ErrorResponse", "ModelCard", "ModelList", "TokenizeRequest",
           "parse_body", "parse_request", "validate"]
