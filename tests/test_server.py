"""`medusa serve` over real HTTP: uvicorn on a free loopback port, the official `openai` client as the caller."""

import contextlib
import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

import medusa_decoding.text as text_module
from medusa_decoding.config import DEFAULT_MODEL, ServerConfig
from medusa_decoding.model import GenerationOutput, MedusaModel
from medusa_decoding.openai_schema import MedusaOptions, RequestError
from medusa_decoding.scheduler import Scheduler
from medusa_decoding.server import create_app, request_trees, serving

MODEL_ID = DEFAULT_MODEL.name
MAX_TOKENS = 12
CONCURRENT_TOKENS = 8  # 8 requests and their 8 references: the slowest test
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about cats.",
    "Give me a synonym for happy.",
    "What is 2 + 2?",
    "Describe the moon in five words.",
    "Say hello in Spanish.",
    "What do bees make?",
)
LONG_RUN = 1000  # tokens a disconnect test asks for: far more than it lets run
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # a raw prompt that keeps going
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base_url(smollm):
    # one fixed tree: steps compared with `expected` must not follow time
    trees, smollm.tree = smollm.trees, smollm.tree
    with serving(create_app(smollm, MODEL_ID)) as url:
        yield url
    smollm.trees = trees


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(smollm):
    """Greedy answers from MedusaModel.generate (what `medusa generate` prints), computed once each."""
    cache = {}

    def answer(prompt: str, raw: bool = False, **overrides):
        key = (prompt, raw, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = smollm.generate(prompt, raw=raw, **{"max_new_tokens": MAX_TOKENS, **overrides})
        return cache[key]

    return answer


def chat(client, prompt: str, **kw):
    """Greedy unless kw says otherwise."""
    return client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": prompt}],
        **{"max_tokens": MAX_TOKENS, "temperature": 0, **kw},
    )


def streamed_text(client, prompt: str, **kw) -> tuple[str, list]:
    chunks = list(chat(client, prompt, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks


def health(base_url) -> dict:
    response = httpx.get(f"{base_url}/health")
    assert response.status_code == 200
    return response.json()


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    state = health(base_url)
    assert state["status"] == "ok" and state["model"] == MODEL_ID and state["in_flight"] == 0


def test_greedy_chat_matches_generate(client, smollm, expected):
    want = expected(PROMPTS[0])
    response = chat(client, PROMPTS[0])
    assert response.object == "chat.completion" and response.model == MODEL_ID
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == want.text
    ended = want.token_ids[-1] in smollm.eos_ids
    assert response.choices[0].finish_reason == ("stop" if ended else "length")
    prompt_tokens = smollm.encode(PROMPTS[0]).numel()
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(want.token_ids)
    assert response.usage.total_tokens == prompt_tokens + len(want.token_ids)
    stats = response.usage.model_extra["medusa"]
    assert stats["steps"] == want.steps
    assert stats["acceleration_rate"] == pytest.approx(want.acceleration_rate)


def test_stream_concatenates_to_the_same_text(client, expected):
    text, chunks = streamed_text(client, PROMPTS[0])
    assert text == expected(PROMPTS[0]).text
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(expected(PROMPTS[0]).token_ids)


def test_stream_ends_with_done(base_url):
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_concurrent_streams_are_batched_and_each_gets_its_own_answer(base_url, client, expected):
    want = [expected(p, max_new_tokens=CONCURRENT_TOKENS) for p in PROMPTS]  # sequential references first
    before = health(base_url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: streamed_text(client, p, max_tokens=CONCURRENT_TOKENS)[0], PROMPTS))
    assert got == [out.text for out in want]
    assert len(set(got)) == len(PROMPTS)  # distinct answers: a mix-up could not pass unnoticed
    alone = sum(out.steps for out in want)  # forward passes one at a time, the prefills included
    assert health(base_url)["forward_passes"] - before["forward_passes"] < 0.75 * alone  # rows shared the passes


def test_a_cancelled_row_leaves_the_others_undisturbed(base_url, client, expected):
    body = {"model": MODEL_ID, "prompt": COUNTING, "max_tokens": LONG_RUN, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as doomed:
            lines = doomed.iter_lines()  # held: a line iterator that is collected closes the stream
            next(line for line in lines if line.startswith("data: {"))  # it is generating
            answer = pool.submit(chat, client, PROMPTS[1])
            deadline = time.monotonic() + 30
            while health(base_url)["running"] < 2:  # both rows in the batch: now the first one leaves
                assert time.monotonic() < deadline, "the second request never joined the batch"
                time.sleep(0.01)
        assert answer.result().choices[0].message.content == expected(PROMPTS[1]).text
    assert health(base_url)["in_flight"] == 0


def test_a_full_queue_answers_503_and_the_server_serves_on(smollm):
    """One row and no queue: while a request runs, the next is refused at once with an OpenAI-style error."""
    body = {"model": MODEL_ID, "prompt": COUNTING, "max_tokens": LONG_RUN, "temperature": 0, "stream": True}
    with serving(create_app(smollm, MODEL_ID, Scheduler(max_batch=1, max_queue=0))) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as running:
            lines = running.iter_lines()  # held: a line iterator that is collected closes the stream
            next(line for line in lines if line.startswith("data: {"))
            refused = httpx.post(f"{url}{CHAT}", json=GOOD, timeout=60)
            assert health(url)["running"] == 1 and health(url)["rejected"] == 1
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_busy" and refused.json()["error"]["type"] == "server_error"
        deadline = time.monotonic() + 30
        while health(url)["in_flight"]:  # the first one's client left
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(f"{url}{CHAT}", json=GOOD, timeout=60).status_code == 200


def test_completions_use_the_raw_prompt(client, expected):
    want = expected("The capital of France is", raw=True)
    response = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert response.object == "text_completion"
    assert response.choices[0].text == want.text
    assert response.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want.text


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_ends_early_with_stop(client, expected, streaming):
    full = expected(PROMPTS[1]).text
    stop = full.split()[2]  # a word from the middle of the greedy answer
    want = expected(PROMPTS[1], stop=(stop,))
    assert want.text == full[: full.find(stop)]
    if streaming:
        text, chunks = streamed_text(client, PROMPTS[1], stop=[stop])
        finish, usage = chunks[-1].choices[0].finish_reason, chunks[-1].usage
    else:
        response = chat(client, PROMPTS[1], stop=stop)
        text, finish, usage = response.choices[0].message.content, response.choices[0].finish_reason, response.usage
    assert text == want.text
    assert finish == "stop"
    assert usage.completion_tokens == len(want.token_ids) < MAX_TOKENS


def test_sampling_with_a_seed_repeats(client):
    runs = [chat(client, PROMPTS[2], temperature=0.8, seed=7).choices[0].message.content for _ in range(2)]
    assert runs[0] == runs[1]


def test_per_request_tree_and_acceptance(client, expected):
    plain = chat(client, PROMPTS[0], extra_body={"medusa": {"tree": [], "lookup": 0, "corpus": 0}})  # plain decoding
    assert plain.choices[0].message.content == expected(PROMPTS[0]).text
    assert plain.usage.model_extra["medusa"]["steps"] == plain.usage.completion_tokens
    typical = chat(client, PROMPTS[0], extra_body={"medusa": {"acceptance": "typical", "tree": [2, 2]}})
    assert typical.usage.completion_tokens == MAX_TOKENS or typical.choices[0].finish_reason == "stop"


def test_a_request_that_names_a_tree_decodes_on_the_loaded_model(client, smollm, expected, monkeypatch):
    """medusa.tree is the request's own: the served model decodes with it (no second MedusaModel is built, and the
    model keeps its tree), as generate(tree=...) does, and greedy it is still the model's own answer."""
    tree = ((0,), (1,), (0, 0))

    def built(*args, **kwargs):
        raise AssertionError("a MedusaModel was built for a request")

    own = smollm.trees
    want = expected(PROMPTS[0], tree=tree)
    monkeypatch.setattr(MedusaModel, "__init__", built)
    response = chat(client, PROMPTS[0], extra_body={"medusa": {"tree": [list(path) for path in tree]}})
    assert response.choices[0].message.content == want.text == expected(PROMPTS[0]).text  # lossless
    assert response.usage.model_extra["medusa"]["steps"] == want.steps
    assert smollm.trees is own


CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD_REQUESTS = {
    "malformed JSON": (CHAT, b'{"model": "x", "messages": [', 400, None),
    "missing messages": (CHAT, {"model": MODEL_ID}, 400, "messages"),
    "messages of the wrong type": (CHAT, {**GOOD, "messages": "Hi"}, 400, "messages"),
    "temperature of the wrong type": (CHAT, {**GOOD, "temperature": "hot"}, 400, "temperature"),
    "unknown model": (CHAT, {**GOOD, "model": "gpt-4"}, 400, "model"),
    "negative max_tokens": (CHAT, {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    "zero max_completion_tokens": (CHAT, {**GOOD, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    "negative temperature": (CHAT, {**GOOD, "temperature": -0.5}, 400, "temperature"),
    "unknown acceptance": (CHAT, {**GOOD, "medusa": {"acceptance": "bogus"}}, 400, "medusa.acceptance"),
    "tree not prefix-closed": (CHAT, {**GOOD, "medusa": {"tree": [[0, 0]]}}, 400, "medusa.tree"),
    "tree deeper than the heads": (CHAT, {**GOOD, "medusa": {"tree": [1, 1, 1, 1, 1]}}, 400, "medusa.tree"),
    "unsupported field": (CHAT, {**GOOD, "logprobs": True}, 400, "logprobs"),
    "over-long prompt": (CHAT, {**GOOD, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    "over-long prompt, streaming": (
        "/v1/completions", {"model": MODEL_ID, "prompt": "word " * 9000, "stream": True}, 400, "prompt",
    ),
    "token id past the vocabulary": ("/v1/completions", {"model": MODEL_ID, "prompt": [1, 10**9]}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {"model": MODEL_ID, "prompt": ""}, 400, "prompt"),
    # issue 70: each of these was answered (200 or 500) before
    "tree larger than the server takes": (CHAT, {**GOOD, "medusa": {"tree": [5000, 5000]}}, 400, "medusa.tree"),
    "lone surrogate in a message": (
        CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "Hi \\ud800"}]}' % MODEL_ID.encode(), 400,
        "messages",
    ),
    "lone surrogate in a prompt": (
        "/v1/completions", b'{"model": "%s", "prompt": "\\udfff there"}' % MODEL_ID.encode(), 400, "prompt",
    ),
    "unknown role": (CHAT, {**GOOD, "messages": [{"role": "alien", "content": "Hi"}]}, 400, "messages.0.role"),
    "tool role (no tools here)": (CHAT, {**GOOD, "messages": [{"role": "tool", "content": "Hi"}]}, 400,
                                  "messages.0.role"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error_and_the_server_serves_on(base_url, case):
    path, body, status, param = BAD_REQUESTS[case]
    send = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes)
            else {"json": body})
    response = httpx.post(f"{base_url}{path}", timeout=60, **send)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert health(base_url)["in_flight"] == 0
    after = httpx.post(f"{base_url}{CHAT}", json=GOOD, timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        chat(client, "word " * 9000, stream=True)


@pytest.mark.parametrize("streaming", [True, False])
def test_client_that_leaves_frees_the_model(base_url, client, streaming):
    before = health(base_url)
    body = {"model": MODEL_ID, "prompt": COUNTING, "max_tokens": LONG_RUN, "temperature": 0, "stream": streaming}
    if streaming:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: {"))  # it is generating
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 30
    while (state := health(base_url))["in_flight"]:
        assert time.monotonic() < deadline, "the abandoned generation kept the model"
        time.sleep(0.05)
    assert state["cancelled"] == before["cancelled"] + 1
    assert state["forward_passes"] - before["forward_passes"] < LONG_RUN // 10
    assert chat(client, PROMPTS[4]).usage.completion_tokens >= 1  # and the next request is served


def test_client_that_leaves_while_queued_is_never_run(smollm, monkeypatch):
    """One row: the second request waits in the queue, its client leaves, and it is dropped without running."""
    body = {"model": MODEL_ID, "prompt": COUNTING, "max_tokens": LONG_RUN, "temperature": 0}
    add, joined = text_module.Requests.add, []
    monkeypatch.setattr(text_module.Requests, "add", lambda self, *args: joined.append(args) or add(self, *args))
    with serving(create_app(smollm, MODEL_ID, Scheduler(max_batch=1))) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as running:
            lines = running.iter_lines()  # held: a line iterator that is collected closes the stream
            next(line for line in lines if line.startswith("data: {"))  # the model is busy with it
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=body,
                                      timeout=httpx.Timeout(60, read=1.0))
                queued = max(health(url)["queued"] for _ in range(10))
                with pytest.raises(httpx.ReadTimeout):  # queued behind it, then gone
                    waiting.result()
        assert queued == 1
        deadline = time.monotonic() + 30
        while (state := health(url))["in_flight"] or state["cancelled"] < 2:
            assert time.monotonic() < deadline, "an abandoned generation kept the model"
            time.sleep(0.05)
        assert state["cancelled"] == 2 and state["running"] == state["queued"] == 0
        assert len(joined) == 1  # the queued one never joined the batch (no prefill)


def test_a_failing_generation_reports_a_server_error_and_the_server_serves_on(base_url, client, smollm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the model fell over")

    monkeypatch.setattr(text_module.Requests, "step", broken)
    response = httpx.post(f"{base_url}{CHAT}", json=GOOD, timeout=60)
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal error: the model fell over", "type": "server_error", "param": None, "code": None,
    }
    with httpx.stream("POST", f"{base_url}{CHAT}", json={**GOOD, "stream": True}, timeout=60) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
    assert json.loads(events[-2])["error"]["message"] == "generation failed: the model fell over"
    assert events[-1] == "[DONE]"
    monkeypatch.undo()
    assert chat(client, PROMPTS[4]).usage.completion_tokens >= 1


def test_medusa_serve_loads_the_model_on_the_thread_that_runs_it(monkeypatch):
    """A second thread running torch work slows every thread's OpenMP workers (scheduler.Scheduler): one thread only."""
    from medusa_decoding import cli

    threads = {}

    def load(args):
        threads["load"] = threading.current_thread()
        return "the model"

    monkeypatch.setattr(cli, "load", load)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: None)
    cli.main(["serve"])
    assert threads["load"] is not threading.current_thread()
    assert threads["load"].name.startswith("medusa-generate")  # the Scheduler's one worker, which generates too


def test_a_tree_past_the_servers_limits_is_refused_before_it_is_built(smollm):
    for options, limits in [({"tree": [3, 2]}, {"max_tree_nodes": 8}), ({"tree": [[0], [0, 0], [0, 0, 0]]},
                                                                         {"max_tree_depth": 2})]:
        assert request_trees(smollm, MedusaOptions(**options), ServerConfig()) is not None  # within the defaults
        with pytest.raises(RequestError, match="this server takes trees of at most") as refused:
            request_trees(smollm, MedusaOptions(**options), ServerConfig(**limits))
        assert refused.value.code == "tree_too_large" and refused.value.param == "medusa.tree"


def leave_at_random(url: str, body: dict, seconds: float) -> None:
    """A client with a short timeout: it reads for `seconds` (a stream's chunks, or nothing), then hangs up."""
    if not body["stream"]:
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{url}{CHAT}", json=body, timeout=httpx.Timeout(30, read=seconds))
        return
    start = time.monotonic()
    with contextlib.suppress(httpx.ReadTimeout), httpx.stream("POST", f"{url}{CHAT}", json=body,
                                                              timeout=httpx.Timeout(30, read=seconds)) as response:
        for _ in response.iter_lines():
            if time.monotonic() - start > seconds:
                break


def wait_until_idle(url: str, seconds: float = 10) -> dict:
    deadline = time.monotonic() + seconds
    while (state := health(url))["in_flight"]:
        assert time.monotonic() < deadline, f"requests stayed in flight: {state}"
        time.sleep(0.02)
    return state


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bursts_of_clients_that_leave_never_wedge_the_server(smollm, expected, seed):
    """Issue 70: more clients than rows, each hanging up at a random moment (queued, admitted, in its prefill, mid-
    stream, after its answer), twice; then the next request is answered at once and nothing is left in flight."""
    rng = random.Random(seed)
    with serving(create_app(smollm, MODEL_ID, Scheduler(max_batch=4, max_queue=16))) as url:
        for _burst in range(3):
            clients = [({**GOOD, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": 200,
                         "stream": bool(rng.getrandbits(1))}, rng.uniform(0, 0.5)) for _ in range(12)]
            with ThreadPoolExecutor(len(clients)) as pool:
                list(pool.map(lambda client: leave_at_random(url, *client), clients))
            start = time.monotonic()
            response = httpx.post(f"{url}{CHAT}", json={**GOOD, "messages": [{"role": "user", "content": PROMPTS[1]}],
                                                        "max_tokens": MAX_TOKENS}, timeout=10)
            assert response.status_code == 200 and time.monotonic() - start < 10
            assert response.json()["choices"][0]["message"]["content"] == expected(PROMPTS[1]).text
            state = wait_until_idle(url)
            assert state["status"] == "ok" and state["running"] == state["queued"] == 0 and state["restarts"] == 0


def test_a_failure_of_the_loop_is_logged_fails_its_requests_and_the_loop_restarts(smollm, expected, monkeypatch,
                                                                                  caplog):
    def broken(out, step):
        monkeypatch.undo()  # once
        raise RuntimeError("a bug in the loop")

    with serving(create_app(smollm, MODEL_ID, Scheduler())) as url:
        monkeypatch.setattr(GenerationOutput, "add_step", broken)
        with caplog.at_level(logging.ERROR, logger="medusa_decoding.scheduler"):
            failed = httpx.post(f"{url}{CHAT}", json=GOOD, timeout=30)
        assert failed.status_code == 500 and "a bug in the loop" in failed.json()["error"]["message"]
        assert "the decoding loop failed" in caplog.text and "Traceback" in caplog.text
        answer = chat(openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30), PROMPTS[1])
        assert answer.choices[0].message.content == expected(PROMPTS[1]).text
        state = wait_until_idle(url)
        assert state["status"] == "ok" and state["restarts"] == 1


def test_health_says_error_once_the_loop_has_stopped(smollm, monkeypatch):
    """A worker stopped for good (here SystemExit inside a step) fails what it held and what waited, answers every
    new request 503, and /health turns 503 "error" so that an orchestrator restarts the process."""
    def stop(*args, **kwargs):
        raise SystemExit("stopped")

    with serving(create_app(smollm, MODEL_ID, Scheduler())) as url:
        monkeypatch.setattr(text_module.Requests, "step", stop)
        failed = httpx.post(f"{url}{CHAT}", json=GOOD, timeout=30)
        assert failed.status_code == 500 and "the worker stopped" in failed.json()["error"]["message"]
        state = httpx.get(f"{url}/health")
        assert state.status_code == 503 and state.json()["status"] == "error" and state.json()["in_flight"] == 0
        refused = httpx.post(f"{url}{CHAT}", json=GOOD, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_stopped"


def test_stream_chunks_say_which_forward_pass_they_came_from(client, expected):
    """The chat page's extension (OpenAI clients ignore it): each piece's forward pass and what that pass accepted."""
    want = expected(PROMPTS[0])
    text, chunks = streamed_text(client, PROMPTS[0])
    pieces = [c.model_extra["medusa"] for c in chunks if c.choices[0].delta.content]
    steps = [piece["step"] for piece in pieces]
    assert steps[0] == 1 and steps == sorted(set(steps)) and steps[-1] <= want.steps
    assert [piece["accepted"] for piece in pieces] == [want.accept_lengths[step - 1] for step in steps]
    assert any(piece["accepted"] > 1 for piece in pieces)  # the shipped heads' guesses were taken somewhere


def test_the_chat_page_is_served_offline(base_url):
    page = httpx.get(f"{base_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "static/app.js" in page.text and "http" not in page.text.split("<body>")[1]  # nothing fetched from away
    for name in ("app.js", "style.css"):
        assert httpx.get(f"{base_url}/static/{name}").status_code == 200


def test_an_api_key_guards_every_v1_route_and_the_openai_client_sends_it(smollm, monkeypatch):
    key = "sk-local-test"
    with serving(create_app(smollm, MODEL_ID, Scheduler(), ServerConfig(api_key=key))) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            for method, path, body in (("POST", CHAT, GOOD), ("GET", "/v1/models", None)):
                refused = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
                assert refused.status_code == 401, (headers, path)
                assert refused.json()["error"]["type"] == "invalid_request_error"
                assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{url}{CHAT}", json=GOOD, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/").status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        assert chat(good, PROMPTS[4]).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_medusa_serve_takes_its_key_from_the_option_or_the_environment(monkeypatch):
    import medusa_decoding.server as server_module
    from medusa_decoding import cli

    keys = []
    monkeypatch.setattr(cli, "load", lambda args: "the model")
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: None)
    monkeypatch.setattr(server_module, "create_app",
                        lambda medusa, name, scheduler, config: keys.append(config.api_key))
    monkeypatch.setenv("MEDUSA_API_KEY", "from-env")
    cli.main(["serve"])
    cli.main(["serve", "--api-key", "from-option"])
    monkeypatch.delenv("MEDUSA_API_KEY")
    cli.main(["serve"])
    assert keys == ["from-env", "from-option", None]
