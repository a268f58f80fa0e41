"""The OpenAI request and response shapes: request bodies checked field by field into what the
engine takes, and the completion and chat bodies and stream chunks built from its output.

Every refusal is an APIError that names the field, rendered as OpenAI renders errors:
{"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from fuselab.engine.sampling_params import SamplingParams, is_int

# Parameters of the OpenAI API that the engine does not implement, with the values (besides null)
# that ask for nothing: any other value is refused rather than silently ignored.
_UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False,),
                "top_logprobs": (0,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
                "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
                "response_format": ({"type": "text"},)}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


@dataclass(frozen=True)
class GenerationRequest:
    """One checked completion or chat request. max_tokens None: as many as max_model_len leaves."""

    model: str
    prompt: str | list[int] | None = None  # /v1/completions
    messages: list[dict] | None = None  # /v1/chat/completions
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)  # SamplingParams' other fields
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except (ValueError, TypeError) as err:
            # SamplingParams' messages begin with the field's name, which is the request's name for it.
            raise bad_request(str(err), param=str(err).split(" ", 1)[0]) from None


def parse_completion(body: object) -> GenerationRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt holds several prompts; send one request per prompt", "prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(is_int(t) for t in prompt))):
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    return _request(body, prompt=prompt, max_tokens=_max_tokens(body, "max_tokens", 16))


def parse_chat(body: object) -> GenerationRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    checked = [_message(i, m) for i, m in enumerate(messages)]
    max_tokens = _max_tokens(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _max_tokens(body, "max_tokens", None)
    return _request(body, messages=checked, max_tokens=max_tokens)


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _request(body: dict, **fields) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: the name /v1/models lists", "model")
    for name, neutral in _UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise bad_request(f"{name}={body[name]!r} is not supported by this server", name)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options applies only with stream true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise bad_request("stream_options must be an object whose include_usage is true or false", "stream_options")
        include_usage = options.get("include_usage", False)
    return GenerationRequest(model=model, sampling=_sampling(body), stop=_stop(body.get("stop")), stream=stream,
                             include_usage=include_usage, **fields)


def _sampling(body: dict) -> dict:
    """The SamplingParams fields the body sets; SamplingParams checks their values."""
    names = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "ignore_eos": False, "stop_token_ids": ()}
    out = {name: body[name] for name in names if body.get(name) is not None}
    if out.get("top_k") == -1:
        out["top_k"] = 0  # -1 means no limit in vLLM's dialect
    if "stop_token_ids" in out and not isinstance(out["stop_token_ids"], list):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    return out


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < 1:
        raise bad_request(f"{name} must be an int >= 1, got {value!r}", name)
    return value


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings (token ids go in stop_token_ids)", "stop")
    return tuple(s for s in stop if s)


def _message(i: int, message: object) -> dict:
    """A message as a chat template reads it: text parts joined into content, null fields dropped."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        content = "\n".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
    return {**{k: v for k, v in message.items() if v is not None}, **({} if content is None else {"content": content})}


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


class OpenAIResponse:
    """The bodies and chunks of one response, sharing its id and creation time."""

    def __init__(self, model: str, chat: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.head = {"id": self.id, "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model}

    def body(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self.head, "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """A stream chunk: text new since the last one; the chat's first names the role."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self.head, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self.head, "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
