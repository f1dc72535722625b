"""OpenAI-compatible HTTP server over the one decoding loop (`medusa serve`), batching continuously.

One worker thread, the Scheduler's, owns the model. Every request it has admitted is a row of one running batch
(model.Requests): a request joins at the next step (its prefill) and leaves when done, cancelled or disconnected, so
eight users are served by one forward pass a step, not one after another. Up to `max_batch` requests run; up to
`max_queue` more wait, and beyond that a request is answered at once with a 503 (an OpenAI-style error) instead of
queueing without bound. Each request's text reaches its HTTP response through an asyncio queue, so the event loop
never waits on the model (a step's text for every row in one wake-up of the loop). A request is checked (fields,
tree, prompt length) before it is queued, so a bad one gets an ordinary 400 even when it asked for a stream. A
client that goes away, at any moment, cancels its job: out of the queue at once, out of the batch before the next
forward pass. The worker's loop outlives any failure (Scheduler.serve); /health says when it has stopped.

>>> scheduler = Scheduler()
>>> uvicorn.run(create_app(scheduler.load(MedusaModel.from_pretrained), "SmolLM2-135M-Instruct", scheduler))
"""

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from .base import check_context
from .config import GenerationConfig, ServerConfig
from .model import GenerationOutput, MedusaModel, Requests, Step, TextPieces, admit, check_max_batch, record
from .tree import spec_size

log = logging.getLogger(__name__)
WEB = Path(__file__).with_name("web")  # the chat page's static files

# request field -> GenerationConfig field; the later of two aliases wins
OPENAI_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
}


# ---- the request bodies: unknown fields are refused, never silently ignored ----


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MedusaOptions(Strict):
    """The `medusa` extra body: per-request decoding choices (defaults: GenerationConfig's)."""

    acceptance: str | None = None
    tree: list[list[int]] | list[int] | None = None  # paths or Cartesian sizes; [] = plain decoding
    top_k: int | None = None
    typical_epsilon: float | None = None
    typical_delta: float | None = None
    lookup: int | None = None  # lookup drafts: at most this many tokens a step (GenerationConfig.lookup)
    corpus: int | None = None  # corpus drafts: at most this many tokens a step (GenerationConfig.corpus)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]  # OpenAI's roles but tools' (no tools here)
    content: str | list[TextPart] | None = None
    name: str | None = None


class CommonRequest(Strict):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stream: bool = False
    stream_options: dict | None = None  # accepted: usage always rides on the final chunk
    n: Literal[1] = 1
    user: str | None = None
    medusa: MedusaOptions | None = None


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(CommonRequest):
    prompt: str | list[int]  # text (no chat template) or token ids


class RequestError(Exception):
    """Becomes an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.code, self.status, self.kind = param, code, status, kind


def error_body(message: str, param=None, code=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- turning a request into a job ----


def generation_config(body: CommonRequest) -> GenerationConfig:
    """The fields the request gives, over GenerationConfig's defaults; a rejected value blames its field."""
    sources = {name: field for field, name in OPENAI_FIELDS.items() if getattr(body, field) is not None}
    values = {name: getattr(body, field) for name, field in sources.items()}
    if isinstance(values.get("stop"), str):
        values["stop"] = (values["stop"],)
    if body.medusa is not None:
        values |= body.medusa.model_dump(exclude_none=True, exclude={"tree"})
        sources |= {name: f"medusa.{name}" for name in body.medusa.model_fields_set - {"tree"}}
    try:
        return GenerationConfig(**values)
    except ValueError as error:  # GenerationConfig's messages start with the field's name
        raise RequestError(str(error), next((p for n, p in sources.items() if str(error).startswith(n)), None)) from None


def request_model(medusa: MedusaModel, options: MedusaOptions | None, config: ServerConfig) -> MedusaModel:
    """The served model, or a view of it (same weights) with the request's own tree, checked against the server's
    limits before it is built, then against the heads."""
    if options is None or options.tree is None:
        return medusa
    nodes, depth = spec_size(options.tree)
    if nodes > config.max_tree_nodes or depth > config.max_tree_depth:
        raise RequestError(f"medusa.tree: {nodes} candidates, {depth} deep; this server takes trees of at most "
                           f"{config.max_tree_nodes} candidates and depth {config.max_tree_depth}", "medusa.tree",
                           "tree_too_large")
    try:
        return medusa.with_heads(medusa.heads, options.tree)
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


def chat_message(message: Message) -> dict:
    """A message as the chat template takes it; OpenAI's "developer" is the "system" of models trained before it."""
    content = message.content if not isinstance(message.content, list) else "".join(p.text for p in message.content)
    return {"role": "system" if message.role == "developer" else message.role, "content": content or ""}


# ---- the worker ----


@dataclass
class Finished:
    out: GenerationOutput
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "cancelled" (the client left)


@dataclass
class Piece:
    """Text of a request's answer, and the forward pass it came from: its number in the request (1: the prefill) and
    the tokens that pass accepted (what a stream chunk's `medusa` extension says)."""

    text: str
    step: int
    accepted: int


@dataclass(eq=False)  # compared by identity: a queued job is found and removed as itself
class Job:
    """One request on its way through the worker: inputs, a queue of events out, a cancel flag in."""

    model: MedusaModel
    ids: torch.Tensor  # [T]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Pieces, then Finished or an error
    cancelled: threading.Event = field(default_factory=threading.Event)
    out: GenerationOutput = field(default_factory=GenerationOutput)  # what the worker produced so far
    pieces: TextPieces = field(init=False)  # what of its text was sent
    start: float = 0.0  # when its prefill began

    def __post_init__(self):
        self.pieces = TextPieces(self.config.stop)


class Scheduler:
    """The one worker thread that touches the model and runs the batch, and the queue of requests waiting for a row
    of it. Counters feed /health.

    Load the model on it too (`load`, before `start`): torch's OpenMP (libgomp) keeps a pool of workers for every
    thread that has run parallel work, and once those outnumber the cores every pool stops spin-waiting, so a model
    loaded on the main thread and run on this one decodes markedly slower.

    A request is queued (`waiting`), then held (`held`: admitted to the batch) until its last event; a client that
    leaves takes its job out of the queue at once, or out of the batch before the next forward pass. Whatever fails
    ends the requests it touched with the error, and the loop goes on; a failure of the loop itself is logged and
    the loop restarts.
    """

    def __init__(self, max_batch: int = ServerConfig.max_batch, max_queue: int = ServerConfig.max_queue):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be a non-negative integer, got {max_queue!r}")
        check_max_batch(max_batch)  # before the first request
        self.max_batch, self.max_queue = max_batch, max_queue
        self.lock = threading.Condition()
        self.waiting: deque[Job] = deque()  # guarded by lock
        self.held: dict[int, Job] = {}  # by id(job); changed by the worker under lock, read by /health under it
        self.batch: Requests | None = None  # the worker's
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="medusa-generate")
        self.loop: Future | None = None  # the worker's loop, once started
        self.closed = False
        self.rejected = self.cancelled = self.restarts = 0
        self.forward_passes = self.row_steps = self.candidates = 0  # by the worker
        self.outbox: list[tuple[Job, object]] = []  # the worker's events for the jobs' queues, sent once a step

    def load(self, load: Callable[[], MedusaModel]) -> MedusaModel:
        return self.worker.submit(load).result()

    def start(self) -> None:
        """Starts the worker's loop (once; after `load`, which would wait behind it)."""
        with self.lock:
            if self.loop is None and not self.closed:
                self.loop = self.worker.submit(self.serve)

    def alive(self) -> bool:
        """The worker's loop is running: requests will be served."""
        return self.loop is not None and not self.loop.done() and not self.closed

    def submit(self, job: Job) -> None:
        """Queues a job for the next step, or refuses it (503) when max_queue jobs wait already."""
        with self.lock:
            if not self.alive():
                self.rejected += 1
                raise RequestError("the server cannot decode: its worker is not running", code="worker_stopped",
                                   status=503, kind="server_error")
            if len(self.waiting) >= self.max_queue + max(self.max_batch - len(self.held), 0):
                self.rejected += 1
                raise RequestError(f"the server is busy: {len(self.held)} requests running and {len(self.waiting)} "
                                   "waiting; try again later", code="server_busy", status=503, kind="server_error")
            self.waiting.append(job)
            self.lock.notify()

    def cancel(self, job: Job) -> None:
        """Its client left: a queued job leaves the queue now, a running one the batch before the next forward pass,
        an ended one stays as it was."""
        job.cancelled.set()
        with self.lock:
            if job not in self.waiting:
                return
            self.waiting.remove(job)
            self.cancelled += 1
        job.events.put_nowait(Finished(job.out, "cancelled"))  # on the event loop: ends the request's coroutine

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify()
        self.worker.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> dict:
        """What /health reports, read at one moment: in_flight is always running + queued."""
        with self.lock:
            running, queued = len(self.held), len(self.waiting)
            return {"in_flight": running + queued, "running": running, "queued": queued, "rejected": self.rejected,
                    "cancelled": self.cancelled, "restarts": self.restarts,
                    "forward_passes": self.forward_passes,  # prefills and steps
                    "row_steps": self.row_steps,  # rows in each step, summed
                    "candidates": self.candidates}  # candidates the rows verified, summed

    def serve(self) -> None:
        """The worker's loop until the scheduler closes. A failure outside any one request (a bug) is logged with its
        traceback and ends the requests held with that error; then the loop starts again with an empty batch. What
        stops the thread itself (SystemExit) fails every request, queued ones too, and leaves /health at "error"."""
        while True:
            try:
                return self.run()
            except BaseException as error:
                log.exception("the decoding loop failed; its %d requests end with the error", len(self.held))
                failure = error if isinstance(error, Exception) else RuntimeError(f"the worker stopped: {error!r}")
                self.batch = None
                for job in list(self.held.values()):
                    self.end(job, failure)
                if failure is not error:  # never raised on the event loop: it would stop the server
                    with self.lock:
                        self.closed = True  # nothing more is queued
                        self.outbox += [(job, failure) for job in self.waiting]
                        self.waiting.clear()
                    self.send()
                    raise
                with self.lock:
                    self.restarts += 1

    def run(self) -> None:
        """Admit what waits, drop what was cancelled, one forward pass for every row; returns once closed."""
        while True:
            self.send()
            with self.lock:
                while not self.waiting and not self.held and not self.closed:
                    self.lock.wait()
                if self.closed:
                    return
                admitted = admit(self.waiting, len(self.held), self.max_batch)
                self.held |= {id(job): job for job in admitted}
            for job in admitted:
                self.prefill(job)
            for job in [job for job in self.held.values() if job.cancelled.is_set()]:
                self.batch.drop(id(job))
                self.end(job, Finished(job.out, "cancelled"))
            if not self.held:
                continue
            try:
                stepped = self.batch.step()
            except Exception as error:  # a failed pass fails its rows (their cache is half written); the worker serves on
                self.batch = None
                for job in list(self.held.values()):
                    self.end(job, error)
                continue
            self.forward_passes += 1
            self.row_steps += len(stepped)  # with candidates: the batch's size and the trees its rows verified
            self.candidates += sum(step.tree_size for _, step in stepped)
            for key, step in stepped:
                self.deliver(self.held[key], step)

    def prefill(self, job: Job) -> None:
        """An admitted job joins the batch (its prefill gives its first token), unless its client left already."""
        if job.cancelled.is_set():  # its client left while it was admitted: never run
            return self.end(job, Finished(job.out, "cancelled"))
        self.batch = self.batch or Requests(job.model)  # every job's model holds the same weights
        try:
            job.start = time.perf_counter()
            (_, step), = self.batch.add(id(job), job.ids, job.config, job.model)
        except Exception as error:  # reported to its client; the other rows run on
            return self.end(job, error)
        self.forward_passes += 1
        self.deliver(job, step)

    def deliver(self, job: Job, step: Step) -> None:
        """A step's text for its job; its end, if it was the last."""
        record(job.out, step)
        if piece := job.pieces.add(step.text, step.done):
            self.outbox.append((job, Piece(piece, job.out.steps, len(step.tokens))))
        if step.done:
            job.out.seconds = time.perf_counter() - job.start
            self.end(job, Finished(job.out, step.finish))

    def end(self, job: Job, event: "Finished | Exception") -> None:
        """The held job's last event: it leaves the counts at the same moment."""
        with self.lock:
            del self.held[id(job)]
            self.cancelled += isinstance(event, Finished) and event.finish_reason == "cancelled"
        self.outbox.append((job, event))

    def send(self) -> None:
        """The outbox to the jobs' queues, in order: one wake-up of each event loop a step, not one per row. A loop
        that has closed has no client left to tell."""
        loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for job, event in self.outbox:
            loops.setdefault(job.loop, []).append((job.events, event))
        self.outbox = []
        for loop, events in loops.items():
            with contextlib.suppress(RuntimeError):  # "Event loop is closed"
                loop.call_soon_threadsafe(put_all, events)


def put_all(events: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


async def job_events(job: Job, scheduler: Scheduler, watcher: asyncio.Task) -> AsyncIterator[Piece | Finished]:
    """Yields the queued job's pieces of text, then its Finished; cancels it if the consumer stops early."""
    try:
        while not isinstance(event := await job.events.get(), Finished):
            if isinstance(event, Exception):
                raise event
            yield event
        yield event
    finally:
        watcher.cancel()
        scheduler.cancel(job)


async def cancel_on_disconnect(request: Request, job: Job, scheduler: Scheduler) -> None:
    """Watches the request's connection from the moment its job is queued: a client may leave before any response
    starts (and a stream that never starts never closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scheduler.cancel(job)


# ---- response shapes ----


def usage(prompt_tokens: int, out: GenerationOutput) -> dict:
    completion = len(out.token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "medusa": {"acceleration_rate": out.acceleration_rate, "steps": out.steps, "tokens_per_s": out.tokens_per_s},
    }


def chat_choice(text: str, finish: str | None, stream: bool) -> dict:
    if stream:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def completion_choice(text: str, finish: str | None, stream: bool) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions and /v1/completions."""

    object: str
    chunk_object: str
    id_prefix: str
    choice: Callable[[str, str | None, bool], dict]
    opening_delta: dict | None  # the first chunk's delta (chat announces the role)


CHAT = Endpoint("chat.completion", "chat.completion.chunk", "chatcmpl-", chat_choice, {"role": "assistant", "content": ""})
COMPLETION = Endpoint("text_completion", "text_completion", "cmpl-", completion_choice, None)


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def prepare(medusa: MedusaModel, body: CommonRequest, limits: ServerConfig
            ) -> tuple[MedusaModel, torch.Tensor, GenerationConfig]:
    """Every check a request gets before it is queued (raises RequestError)."""
    config = generation_config(body)
    return request_model(medusa, body.medusa, limits), prompt_ids(medusa, body, config), config


async def answer(scheduler: Scheduler, medusa: MedusaModel, limits: ServerConfig, endpoint: Endpoint,
                 body: CommonRequest, request: Request):
    model, ids, config = await asyncio.to_thread(prepare, medusa, body, limits)  # tokenizing is not free
    job = Job(model, ids, config, asyncio.get_running_loop())
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
               config: ServerConfig = ServerConfig()) -> FastAPI:
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
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "medusa-decoding"}]}

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
            return JSONResponse(error_body(f"the body is not valid JSON: {detail}", code="invalid_json"), status_code=400)
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
