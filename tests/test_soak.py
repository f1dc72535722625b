"""Issue 70's soak: `medusa serve` as users start it, a few hundred requests over real HTTP from concurrent clients,
normal, streaming, malformed and abandoned ones mixed. At the end: no 5xx but 503 busy, every answer its solo answer,
nothing in flight, and the process's memory back near where it was after a warm-up round of the same mix."""

import contextlib
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_process import medusa_serve

from medusa_decoding.config import DEFAULT_MODEL

REQUESTS = 300
CLIENTS = 10  # more than the rows and the queue (below): some requests must get 503 busy
SERVER = ("--max-batch", "4", "--max-queue", "4")
WARM_UP = 60  # requests of the same mix before memory is first read
PROMPTS = ("Name three colours.", "What is the capital of France?", "Write one sentence about cats.",
           "Give me a synonym for happy.", "What is 2 + 2?", "Say hello in Spanish.")
LENGTHS = (4, 12, 24)
MALFORMED = (
    b'{"model": "x", "messages": [',
    json.dumps({"model": DEFAULT_MODEL.name, "messages": [{"role": "alien", "content": "Hi"}]}).encode(),
    b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % DEFAULT_MODEL.name.encode(),
    json.dumps({"model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": "Hi"}],
                "medusa": {"tree": [5000, 5000]}}).encode(),
    json.dumps({"model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": "Hi"}],
                "temperature": -1}).encode(),
)
MEMORY_SLACK = 16 * 2**20  # what the server may grow by after its warm-up (seen: under 1 MiB)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def one(url: str, kind: str, prompt: str, length: int, rng: random.Random) -> tuple[str, int, str | None]:
    """One request of `kind` -> (kind, HTTP status, the answer's text where it completed); a client told 503 busy
    waits a moment before its next request, as clients back off."""
    result = send(url, kind, prompt, length, rng)
    if result[1] == 503:
        time.sleep(rng.uniform(0.2, 0.6))
    return result


def send(url: str, kind: str, prompt: str, length: int, rng: random.Random) -> tuple[str, int, str | None]:
    body = {"model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": prompt}], "max_tokens": length}
    if kind == "malformed":
        response = httpx.post(f"{url}/v1/chat/completions", content=rng.choice(MALFORMED),
                              headers={"content-type": "application/json"}, timeout=60)
        return kind, response.status_code, None
    if kind == "chat":
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        ok = response.status_code == 200
        return kind, response.status_code, response.json()["choices"][0]["message"]["content"] if ok else None
    if kind == "abandoned-chat":  # a client whose timeout is shorter than the answer
        with contextlib.suppress(httpx.ReadTimeout):
            response = httpx.post(f"{url}/v1/chat/completions", json=body,
                                  timeout=httpx.Timeout(60, read=rng.uniform(0.01, 0.3)))
            return kind, response.status_code, None
        return kind, 0, None
    leave_after = rng.randrange(1, 6) if kind == "abandoned-stream" else None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        if response.status_code != 200:
            return kind, response.status_code, None
        text = ""
        for n, line in enumerate(response.iter_lines()):
            if n == leave_after:
                return kind, 0, None
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += event["choices"][0]["delta"].get("content") or ""
        return kind, 200, text


def test_a_soak_of_mixed_clients_leaves_the_server_as_it_found_it():
    rng = random.Random(0)
    kinds = ("chat", "stream", "malformed", "abandoned-chat", "abandoned-stream")
    plan = [(rng.choice(kinds), rng.choice(PROMPTS), rng.choice(LENGTHS), random.Random(n)) for n in range(REQUESTS)]
    with medusa_serve(*SERVER) as (url, pid):
        solo = {(p, n): one(url, "chat", p, n, rng)[2] for p in PROMPTS for n in LENGTHS}  # one at a time
        assert all(solo.values())
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda args: one(url, *args), plan[:WARM_UP]))
            warm = rss(pid)
            results += list(pool.map(lambda args: one(url, *args), plan[WARM_UP:]))
        deadline = time.monotonic() + 30
        while (state := httpx.get(f"{url}/health").json())["in_flight"]:  # the last abandoned ones may still run
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        final = rss(pid)
    statuses = [status for _, status, _ in results]
    assert all(status < 500 or status == 503 for status in statuses), sorted(set(statuses))
    assert all(status == 400 for kind, status, _ in results if kind == "malformed")
    answered = [(args, text) for args, (_, status, text) in zip(plan, results) if text is not None]
    assert len(answered) > REQUESTS // 5 and 503 in statuses  # the mix ran, and the queue filled
    assert [text for _, text in answered] == [solo[prompt, length] for (_, prompt, length, _), _ in answered]
    assert state["status"] == "ok" and state["running"] == state["queued"] == 0 and state["restarts"] == 0
    assert final < warm + MEMORY_SLACK, f"the server grew from {warm / 2**20:.0f} to {final / 2**20:.0f} MiB"
