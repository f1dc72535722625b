"""`medusa chat` driven through a real terminal (pty): history, /stats, /reset, Ctrl-D and Ctrl-C."""

import json
import os
import re
import signal
import sys

import pexpect
import pytest
from conftest import EXACT_KERNELS

from medusa_decoding.chat import ASSISTANT_PROMPT, USER_PROMPT

MAX_NEW_TOKENS = 16
TIMEOUT_S = 240  # a loaded 2-core machine; typically a few seconds per answer
FIRST, SECOND = "My name is Alice.", "What is my name?"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATS = re.compile(r"(\d+) tokens in (\d+) forward passes: acceleration ([\d.]+) tokens/pass, ([\d.]+) tokens/s")


def restore_ctrl_c() -> None:
    """Ctrl-C as a terminal gives it: a runner started as a background job ignores SIGINT, its children inherit
    that, and Python then never raises KeyboardInterrupt (the Ctrl-C test hung in such a CI run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# not --tree auto: fitting it to the child's one thread costs a cold cache half a minute; the demo's test covers auto
def spawn_chat(tree: str = "[[0], [1]]") -> pexpect.spawn:
    env = {**os.environ, "TERM": "dumb", "OMP_NUM_THREADS": "1"}
    args = ["-m", "medusa_decoding.cli", "chat", "--max-new-tokens", str(MAX_NEW_TOKENS), "--tree", tree,
            "--kernels", EXACT_KERNELS]  # the smollm fixture's, whose answers these are compared with
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=TIMEOUT_S,
                          preexec_fn=restore_ctrl_c)
    child.expect_exact(USER_PROMPT)
    return child


def say(child: pexpect.spawn, line: str) -> str:
    """Types a line, waits for the next prompt; returns what the chat printed in between (echo removed)."""
    child.sendline(line)
    child.expect_exact(USER_PROMPT)
    shown = ANSI.sub("", child.before).replace("\r\n", "\n")
    assert shown.startswith(line + "\n"), shown
    return shown[len(line) + 1:]


def streamed_answer(shown: str) -> str:
    assert shown.startswith(ASSISTANT_PROMPT) and shown.endswith("\n"), shown
    return shown[len(ASSISTANT_PROMPT):-1]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_two_turns_share_history_stats_count_every_pass_reset_forgets_and_ctrl_d_exits(smollm, one_thread):
    child = spawn_chat(json.dumps(smollm.tree.paths))  # `auto` fits a tree per thread count: the child has 1
    first = streamed_answer(say(child, FIRST))
    second = streamed_answer(say(child, SECOND))
    stats = STATS.fullmatch(say(child, "/stats").strip())
    assert say(child, "/reset") == "(history cleared)\n"
    after_reset = streamed_answer(say(child, SECOND))
    child.sendeof()  # Ctrl-D
    child.expect(pexpect.EOF)
    rest = child.before
    child.close()

    trees, smollm.tree = smollm.trees, smollm.tree  # the child's fixed tree: a guard's picks (--tree auto) follow time
    try:
        out_first = smollm.generate(messages=[user(FIRST)], max_new_tokens=MAX_NEW_TOKENS)
        history = [user(FIRST), {"role": "assistant", "content": first}, user(SECOND)]
        out_second = smollm.generate(messages=history, max_new_tokens=MAX_NEW_TOKENS)
        alone = smollm.generate(messages=[user(SECOND)], max_new_tokens=MAX_NEW_TOKENS)
    finally:
        smollm.trees = trees

    assert first == out_first.text
    assert second == out_second.text  # the second prompt carried the first turn
    assert after_reset == alone.text != second  # after /reset it did not
    assert stats, "no /stats line"
    tokens, passes = int(stats[1]), int(stats[2])
    assert tokens == len(out_first.token_ids) + len(out_second.token_ids)
    assert passes == out_first.steps + out_second.steps
    assert float(stats[3]) == pytest.approx(tokens / passes, abs=0.005) and float(stats[4]) > 0
    assert child.exitstatus == 0 and "Traceback" not in rest


def test_ctrl_c_during_an_answer_exits_cleanly():
    child = spawn_chat()
    child.sendline("Write a long story about a dragon.")
    child.expect_exact(ASSISTANT_PROMPT)
    child.sendintr()  # Ctrl-C: while the answer streams (or at the next prompt if it was quicker)
    child.expect(pexpect.EOF)
    output = child.before
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in output and "KeyboardInterrupt" not in output
