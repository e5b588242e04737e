"""A small OpenAI-compatible HTTP server around one qwen_rt.Generator (FastAPI + uvicorn).

    pip install "qwen_rt[server]"        # fastapi, uvicorn
    python examples/openai_server.py --model Qwen/Qwen3-0.6B --port 8000

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`"stream": true` sends server-sent
events), and GET /stats (the engine's counters; not OpenAI's). A client that disconnects cancels its request.
A request the engine cannot take gets a 400 whose message says why. Any OpenAI client works against it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}])
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

import qwen_rt


class SamplingFields(BaseModel):
    """Sampling fields common to both endpoints (OpenAI's, plus vLLM's top_k, min_p, repetition_penalty and
    ignore_eos)."""
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: Optional[bool] = None
    n: int = 1
    stream: bool = False

    def sampling(self) -> dict:
        fields = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "ignore_eos")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int]]


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class BadRequest(ValueError):
    """A request the server refuses before the engine sees it (status 400 unless given)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _result_unless_disconnected(request: Request, req: qwen_rt.Request) -> qwen_rt.Completion:
    """The request's completion; cancelled (and ended "cancelled") when the client goes away first."""
    waiting = asyncio.ensure_future(asyncio.to_thread(req.result))
    while not waiting.done():
        if await request.is_disconnected():
            await asyncio.to_thread(req.cancel)
            break
        await asyncio.wait({waiting}, timeout=0.25)
    return await waiting


def create_app(gen: qwen_rt.Generator, model_name: str) -> FastAPI:
    app = FastAPI(title="qwen_rt OpenAI-compatible server")
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return _error(400, f"invalid request: {problems}")

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        return _error(exc.status, str(exc))

    @app.exception_handler(ValueError)  # what qwen_rt refuses: out-of-range values, too long a prompt, ...
    async def _refused(_, exc: ValueError):
        return _error(400, str(exc))

    @app.exception_handler(TypeError)
    async def _wrong_type(_, exc: TypeError):
        return _error(400, str(exc))

    def check(body: SamplingFields) -> None:
        if body.model != model_name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {model_name!r}", 404)
        if body.n != 1:
            raise BadRequest(f"n must be 1 (one choice per request), got {body.n}")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "qwen_rt"}]}

    @app.get("/stats")
    async def stats():
        return gen.stats()

    def usage(comp_or_req) -> dict:
        prompt, completion = len(comp_or_req.prompt_token_ids), len(comp_or_req.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def finish(reason: str | None) -> str | None:
        return {"cancelled": "abort"}.get(reason, reason)

    async def respond(request: Request, req: qwen_rt.Request, stream: bool, kind: str, choice) -> Any:
        """kind: "text_completion" or "chat.completion"; choice(text, finish_reason, streaming) -> a choice dict."""
        rid = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": model_name}
        if not stream:
            comp = await _result_unless_disconnected(request, req)
            return {**head, "object": kind, "choices": [choice(comp.text, finish(comp.finish_reason), False)],
                    "usage": usage(comp)}

        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

        async def events():
            # Leaving _deltas early cancels the request: when the client is gone (checked before each chunk, as the
            # server may not notice a closed connection until a write fails) or this task is cancelled.
            async with contextlib.aclosing(_deltas(req)) as deltas:
                async for delta in deltas:
                    if await request.is_disconnected():
                        return
                    if delta.text or delta.finish_reason:
                        yield _sse({**head, "object": chunk_kind,
                                    "choices": [choice(delta.text, finish(delta.finish_reason), True)]})
            yield _sse({**head, "object": chunk_kind, "choices": [], "usage": usage(req)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        req = gen.submit(body.prompt, **body.sampling())  # bad values raise here: a 400
        return await respond(request, req, body.stream, "text_completion",
                             lambda text, reason, _: {"index": 0, "text": text, "finish_reason": reason,
                                                      "logprobs": None})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check(body)
        sampling = body.sampling()
        if body.max_completion_tokens is not None:
            sampling["max_tokens"] = body.max_completion_tokens
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:
            template_kwargs["tools"] = [t.get("function", t) for t in body.tools]
        prompt = gen.chat_prompt(body.messages, **template_kwargs)  # malformed messages raise here: a 400
        req = gen.submit(prompt, **sampling)

        def choice(text, reason, streaming):
            message = {"role": "assistant", "content": text}
            return {"index": 0, "finish_reason": reason, "logprobs": None,
                    ("delta" if streaming else "message"): message}

        return await respond(request, req, body.stream, "chat.completion", choice)

    return app


async def _deltas(req: qwen_rt.Request):
    """The request's deltas for asyncio; leaving early (a cancelled task) cancels the request."""
    it = iter(req)
    done = object()
    try:
        while (delta := await asyncio.to_thread(next, it, done)) is not done:
            yield delta
    finally:
        if not req.finished:
            req.cancel()  # not awaited: in a cancelled task the next await would raise before it ran


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local folder or Hugging Face Hub id (with a tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the folder's config (its tokenizer kept), for load tests")
    args = p.parse_args(argv)
    with qwen_rt.Generator(args.model, device=args.device, max_model_len=args.max_model_len,
                           max_batch_size=args.max_batch_size, load_format=args.load_format) as gen:
        if gen.tokenizer is None:
            raise SystemExit(f"{args.model} has no tokenizer: the server takes and returns text")
        uvicorn.run(create_app(gen, args.served_model_name or args.model), host=args.host, port=args.port,
                    log_level="warning")


if __name__ == "__main__":
    main()
