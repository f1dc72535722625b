"""The server's one worker thread and its queue: requests wait for a row of one running batch (text.Requests), join
it at the next step (their prefill) and leave when done, cancelled or disconnected; each one's text goes back to its
HTTP response through an asyncio queue, a step's events for every row in one wake-up of the event loop.

>>> scheduler = Scheduler(max_batch=8, max_queue=32)
>>> medusa = scheduler.load(MedusaModel.from_pretrained)    # on the worker's thread (see Scheduler)
>>> scheduler.start()
>>> scheduler.submit(Job(medusa, ids, config, None, loop))  # then read the job's events: job_events
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .config import GenerationConfig, ServerConfig
from .guard import Ladder
from .model import GenerationOutput, MedusaModel
from .openai_schema import RequestError
from .text import Requests, Step, TextPieces, admit, check_max_batch

log = logging.getLogger(__name__)


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

    model: MedusaModel  # the served one, whatever tree the request names
    ids: torch.Tensor  # [T]
    config: GenerationConfig
    trees: Ladder | None  # the request's own (MedusaModel.trees_for); None: the model's
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
            except Exception as error:  # a failed pass fails its rows (their cache is half written); serve on
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
        self.batch = self.batch or Requests(job.model)  # every job's model is the served one
        try:
            job.start = time.perf_counter()
            (_, step), = self.batch.add(id(job), job.ids, job.config, job.trees)
        except Exception as error:  # reported to its client; the other rows run on
            return self.end(job, error)
        self.forward_passes += 1
        self.deliver(job, step)

    def deliver(self, job: Job, step: Step) -> None:
        """A step's text for its job; its end, if it was the last."""
        job.out.add_step(step)
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
