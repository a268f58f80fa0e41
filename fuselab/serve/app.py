"""The OpenAI-compatible HTTP server: a FastAPI app over one engine's AsyncLLM.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
"stream": true), GET /v1/models, /health and /metrics. The handlers only check requests, turn
prompts into token ids (on the HTTP side, never the engine thread) and wire them to the engine;
errors come back as OpenAI's JSON with their status, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response as HTTPResponse, StreamingResponse
from starlette.exceptions import HTTPException

from fuselab.engine.async_llm import DEFAULT_MAX_WAITING, AsyncLLM, EngineBusy, EngineDead, RequestStream
from fuselab.engine.llm import LLM
from fuselab.serve.chat_template import ChatTemplate, ChatTemplateError
from fuselab.serve.metrics import CONTENT_TYPE, ServerMetrics
from fuselab.serve.protocol import APIError, GenerationRequest, OpenAIResponse, bad_request, parse_chat, \
    parse_completion, usage


def build_app(llm: LLM, model_name: str, *, api_key: str | None = None, max_waiting: int = DEFAULT_MAX_WAITING,
              chat_template: ChatTemplate | None = None) -> FastAPI:
    """The app serving `llm` as `model_name`. Its engine thread starts and stops with the app
    (its lifespan) and is app.state.engine. /v1 routes need `Authorization: Bearer API_KEY`
    when api_key is set. chat_template defaults to the checkpoint's."""
    metrics = ServerMetrics()
    engine = AsyncLLM(llm, max_waiting=max_waiting, on_finish=metrics.on_finish)
    template = chat_template or ChatTemplate.from_dir(llm.engine_config.model_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.close()

    app = FastAPI(title="fuselab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics = engine, metrics
    handler = _Handler(engine, model_name, template, metrics)

    def error_response(err: APIError) -> JSONResponse:
        metrics.on_refused(err.status)
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:  # unknown path, wrong method
        message = f"{request.method} {request.url.path}: {err.detail}"
        return error_response(APIError(err.status_code, message, type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant time: how long a wrong key takes to refuse says nothing of the right one.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> HTTPResponse:
        return HTTPResponse(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(engine.stats()), media_type=CONTENT_TYPE)

    created = int(time.time())

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "fuselab", "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> HTTPResponse:
        check_key(request)
        return await handler.generate(request, parse_completion(await _json(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> HTTPResponse:
        check_key(request)
        return await handler.generate(request, parse_chat(await _json(request)))

    return app


async def _json(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON: {err}") from None


class _Handler:
    """One generation request, from its checked body to its response."""

    def __init__(self, engine: AsyncLLM, model_name: str, template: ChatTemplate | None,
                 metrics: ServerMetrics) -> None:
        self.engine, self.model_name, self.template, self.metrics = engine, model_name, template, metrics
        self.max_model_len = engine.llm.max_model_len

    async def generate(self, request: Request, req: GenerationRequest) -> HTTPResponse:
        if req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist here; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        chat = req.messages is not None
        name = "messages" if chat else "prompt"
        prompt = self._prompt_ids(req)
        max_tokens = self._check_length(len(prompt), req.max_tokens, name) if isinstance(prompt, list) \
            else req.max_tokens or 16
        try:
            stream = self.engine.submit(prompt, req.sampling_params(max_tokens), req.stop, name)
        except (ValueError, TypeError) as err:
            raise bad_request(str(err), param=str(err).split(" ", 1)[0]) from None
        except EngineBusy as err:
            raise APIError(503, f"the server is at capacity: {err}", type="server_error", code="queue_full") from None
        except EngineDead as err:
            raise APIError(503, str(err), type="server_error", code="engine_stopped") from None
        response = OpenAIResponse(self.model_name, chat)
        if req.stream:
            return StreamingResponse(self._events(stream, response, req.include_usage),
                                     media_type="text/event-stream")
        return await self._collect(request, stream, response)

    def _prompt_ids(self, req: GenerationRequest) -> str | list[int]:
        """Token ids of the prompt or the rendered chat; a string where there is no tokenizer to
        make them, for the engine's check to refuse with its message."""
        tokenizer = self.engine.llm.tokenizer
        if req.messages is not None:
            if self.template is None:
                raise bad_request("this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                                  "chat_template; or start the server with --chat-template): use /v1/completions",
                                  "messages")
            try:
                text = self.template.render(req.messages, add_generation_prompt=True)
            except ChatTemplateError as err:
                raise bad_request(str(err), "messages") from None
            return text if tokenizer is None else tokenizer.encode(text, add_special_tokens=False)
        if isinstance(req.prompt, str) and tokenizer is not None:
            return tokenizer.encode(req.prompt)
        return req.prompt

    def _check_length(self, num_prompt: int, max_tokens: int | None, name: str) -> int:
        """max_tokens, or what the context leaves; a prompt that does not fit with it is refused."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"{name} has {num_prompt} tokens, and this model's maximum context length is {limit} "
                              "tokens, output included", name, code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, and {num_prompt + max_tokens} "
                              f"were asked for ({num_prompt} in the {name}, max_tokens={max_tokens}): lower max_tokens",
                              "max_tokens", code="context_length_exceeded")
        return max_tokens

    async def _events(self, stream: RequestStream, response: OpenAIResponse,
                      include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta, the usage if asked, then [DONE]. A client that
        leaves cancels this generator, whose exit aborts the request."""
        num_tokens = 0
        try:
            if response.chat:
                yield _event(response.chunk(None, first=True))
            async for delta in stream:
                num_tokens += len(delta.token_ids)
                if delta.finish_reason == "abort":
                    raise EngineDead("the server is shutting down")
                yield _event(response.chunk(delta.text, delta.finish_reason))
            if include_usage:
                yield _event(response.usage_chunk(usage(stream.num_prompt_tokens, num_tokens)))
        except EngineDead as err:
            yield _event(APIError(503, str(err), type="server_error", code="engine_stopped").body())
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    async def _collect(self, request: Request, stream: RequestStream, response: OpenAIResponse) -> HTTPResponse:
        """The whole output as one body; the request is aborted if the client leaves first."""
        async def read() -> tuple[str, int, str | None]:
            parts, num_tokens, reason = [], 0, None
            async for delta in stream:
                parts.append(delta.text)
                num_tokens += len(delta.token_ids)
                reason = delta.finish_reason
            return "".join(parts), num_tokens, reason

        reader, watcher = asyncio.ensure_future(read()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((reader, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            reader.cancel()
            stream.abort()
        if not reader.done() or reader.cancelled():
            return HTTPResponse(status_code=499)  # nobody is left to read it
        try:
            text, num_tokens, reason = reader.result()
        except EngineDead as err:
            raise APIError(503, str(err), type="server_error", code="engine_stopped") from None
        if reason == "abort":
            raise APIError(503, "the server is shutting down", type="server_error", code="engine_stopped")
        return JSONResponse(response.body(text, reason, usage(stream.num_prompt_tokens, num_tokens)))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
