"""OpenAI-compatible HTTP server over the one decoding loop (`medusa serve`), batching continuously.

One worker thread, the Scheduler's (scheduler.py), owns the model. Every request it has admitted is a row of one
running batch (text.Requests): a request joins at the next step (its prefill) and leaves when done, cancelled or
disconnected, so eight users are served by one forward pass a step, not one after another. Up to `max_batch` requests
run; up to `max_queue` more wait, and beyond that a request is answered at once with a 503 (an OpenAI-style error)
instead of queueing without bound. Each request's text reaches its HTTP response through an asyncio queue, so the
event loop never waits on the model (a step's text for every row in one wake-up of the loop). A request is checked
(fields, tree, prompt length) before it is queued, so a bad one gets an ordinary 400 even when it asked for a stream;
one that names a tree (`medusa.tree`) decodes on the served model with that tree for itself (MedusaModel.trees_for).
A client that goes away, at any moment, cancels its job: out of the queue at once, out of the batch before the next
forward pass. The worker's loop outlives any failure (Scheduler.serve); /health says when it has stopped. The
request and response bodies are openai_schema.py's.

>>> scheduler = Scheduler()
>>> uvicorn.run(create_app(scheduler.load(MedusaModel.from_pretrained), "SmolLM2-135M-Instruct", scheduler))
"""

import asyncio
import contextlib
import hmac
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from .base import check_context
from .config import GenerationConfig, ServerConfig
from .guard import Ladder
from .model import MedusaModel
from .openai_schema import (
    CHAT,
    COMPLETION,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    Endpoint,
    MedusaOptions,
    RequestError,
    chat_message,
    error_body,
    generation_config,
    sse,
    usage,
)
from .scheduler import Finished, Job, Scheduler, job_events
from .tree import spec_size

WEB = Path(__file__).with_name("web")  # the chat page's static files
DEFAULT_CONFIG = ServerConfig()  # create_app's limits unless given others (frozen: one instance serves every app)


# ---- the checks a request gets before it is queued ----


def request_trees(medusa: MedusaModel, options: MedusaOptions | None, config: ServerConfig) -> Ladder | None:
    """The request's own tree, for the served model (None: the model's), checked against the server's limits before
    it is built, then against the heads."""
    if options is None or options.tree is None:
        return None
    nodes, depth = spec_size(options.tree)
    if nodes > config.max_tree_nodes or depth > config.max_tree_depth:
        raise RequestError(f"medusa.tree: {nodes} candidates, {depth} deep; this server takes trees of at most "
                           f"{config.max_tree_nodes} candidates and depth {config.max_tree_depth}", "medusa.tree",
                           "tree_too_large")
    try:
        return medusa.trees_for(options.tree)
    except ValueError as error:
        raise RequestError(str(error), "medusa.tree") from None


def prompt_ids(medusa: MedusaModel, body: CommonRequest, config: GenerationConfig) -> torch.Tensor:
    """The request's prompt as ids [T], checked against the model's vocabulary and context."""
    param = "messages" if isinstance(body, ChatRequest) else "prompt"
    try:
        if isinstance(body, ChatRequest):
            ids = medusa.encode(messages=[chat_message(m) for m in body.messages])
        else:
            ids = medusa.encode(body.prompt, raw=True)
        vocab = medusa.model.get_output_embeddings().out_features
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt: token ids must lie in [0, {vocab}), got {ids.min()}..{ids.max()}")
    except ValueError as error:
        raise RequestError(str(error), param) from None
    try:
        check_context(medusa.model, ids.numel(), config.max_new_tokens)
    except ValueError as error:
        raise RequestError(str(error), param, "context_length_exceeded") from None
    return ids


def prepare(medusa: MedusaModel, body: CommonRequest, limits: ServerConfig
            ) -> tuple[Ladder | None, torch.Tensor, GenerationConfig]:
    """Every check a request gets before it is queued (raises RequestError)."""
    config = generation_config(body)
    return request_trees(medusa, body.medusa, limits), prompt_ids(medusa, body, config), config


# ---- the responses ----


async def cancel_on_disconnect(request: Request, job: Job, scheduler: Scheduler) -> None:
    """Watches the request's connection from the moment its job is queued: a client may leave before any response
    starts (and a stream that never starts never closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scheduler.cancel(job)


async def answer(scheduler: Scheduler, medusa: MedusaModel, limits: ServerConfig, endpoint: Endpoint,
                 body: CommonRequest, request: Request):
    trees, ids, config = await asyncio.to_thread(prepare, medusa, body, limits)  # tokenizing is not free
    job = Job(medusa, ids, config, trees, asyncio.get_running_loop())
    head = {"id": endpoint.id_prefix + uuid.uuid4().hex, "created": int(time.time()), "model": body.model}
    scheduler.submit(job)  # before any response starts: a full queue is an ordinary 503
    events = job_events(job, scheduler, asyncio.create_task(cancel_on_disconnect(request, job, scheduler)))
    if body.stream:
        return StreamingResponse(stream(endpoint, head, ids.numel(), events), media_type="text/event-stream")
    pieces = [event async for event in events]
    done = pieces.pop()
    return {
        **head,
        "object": endpoint.object,
        "choices": [endpoint.choice("".join(piece.text for piece in pieces), done.finish_reason, False)],
        "usage": usage(ids.numel(), done.out),
    }


async def stream(endpoint: Endpoint, head: dict, prompt_tokens: int, events) -> AsyncIterator[str]:
    """Server-sent events: a chunk per text piece, a final chunk with finish_reason and usage, [DONE]. Each piece's
    chunk carries `medusa`: {"step": the request's forward pass it came from (1: the prefill), "accepted": the
    tokens that pass accepted}, an extension OpenAI clients ignore (the chat page draws each pass from it)."""

    def chunk(choice: dict, **extra) -> str:
        return sse({**head, "object": endpoint.chunk_object, "choices": [choice], **extra})

    try:
        if endpoint.opening_delta is not None:
            yield chunk({"index": 0, "delta": endpoint.opening_delta, "logprobs": None, "finish_reason": None})
        async for event in events:
            if isinstance(event, Finished):
                yield chunk(endpoint.choice("", event.finish_reason, True), usage=usage(prompt_tokens, event.out))
            else:
                yield chunk(endpoint.choice(event.text, None, True), medusa={"step": event.step,
                                                                           "accepted": event.accepted})
    except Exception as error:  # headers are sent: the error travels as an event, as OpenAI's API does
        yield sse(error_body(f"generation failed: {error}", kind="server_error"))
    yield sse("[DONE]")


# ---- the app ----


def create_app(medusa: MedusaModel, model_id: str, scheduler: Scheduler | None = None,
               config: ServerConfig = DEFAULT_CONFIG) -> FastAPI:
    """The ASGI app serving `medusa` under the name `model_id` (requests must name it), on `scheduler` (the one that
    loaded it, for speed) or a new one; `config`: the limits a request must keep."""
    scheduler = scheduler or Scheduler()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="medusa-decoding", summary="OpenAI-compatible MEDUSA decoding", lifespan=lifespan)

    def check_model(body: CommonRequest) -> None:
        if body.model != model_id:
            raise RequestError(
                f"The model `{body.model}` does not exist; this server serves `{model_id}`",
                "model", "model_not_found",  # the issue asks 400; OpenAI itself answers 404
            )

    def check_key(request: Request) -> None:
        """--api-key: every /v1/ request names it, as OpenAI's clients send theirs (Authorization: Bearer KEY)."""
        given = request.headers.get("authorization", "").encode()
        if config.api_key is not None and not hmac.compare_digest(given, f"Bearer {config.api_key}".encode()):
            raise RequestError("Incorrect API key provided: send it as the header `Authorization: Bearer KEY`",
                               code="invalid_api_key", status=401)

    api = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @api.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body)
        return await answer(scheduler, medusa, config, CHAT, body, request)

    @api.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        return await answer(scheduler, medusa, config, COMPLETION, body, request)

    @api.get("/models")
    async def models():
        return {"object": "list",
                "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "medusa-decoding"}]}

    app.include_router(api)
    app.mount("/static", StaticFiles(directory=WEB), name="static")

    @app.get("/", include_in_schema=False)
    async def page():
        """The chat page (web/): a chat and a race of MEDUSA against plain decoding, over the API above."""
        return FileResponse(WEB / "index.html")

    @app.get("/health")
    async def health():
        """503 with "status": "error" once the worker's loop has stopped: an orchestrator should restart the process."""
        alive = scheduler.alive()
        body = {"status": "ok" if alive else "error", "model": model_id, **scheduler.counts()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        return JSONResponse(error_body(str(error), error.param, error.code, error.kind), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            detail = first.get("ctx", {}).get("error", first["msg"])
            return JSONResponse(error_body(f"the body is not valid JSON: {detail}", code="invalid_json"),
                                status_code=400)
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        where = param or "the body must be a JSON object (Content-Type: application/json)"
        return JSONResponse(error_body(f"{where}: {first['msg']}", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        return JSONResponse(error_body(f"internal error: {error}", kind="server_error"), status_code=500)

    return app


@contextlib.contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1"):
    """`app` under uvicorn on a free port of `host`, in a thread -> its base URL (tests, the load benchmark)."""
    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if thread.is_alive():  # uvicorn waits for every response to end: one never did
            raise RuntimeError("the server did not stop within 30 s: a request never ended")
