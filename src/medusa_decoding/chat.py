"""`medusa chat`: a multi-turn conversation in the terminal, each answer streamed as MEDUSA accepts it.

The whole history goes through the chat template every turn (MedusaModel `messages=`). Commands:
/reset clears the history, /stats shows the session's tokens per forward pass and tokens/s, /exit,
Ctrl-D or Ctrl-C quits.
"""

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from .config import GenerationConfig
from .model import MedusaModel
from .text import TextPieces

USER_PROMPT = "you> "
ASSISTANT_PROMPT = "assistant> "
HELP = "/reset clears the history, /stats shows the speed, /exit or Ctrl-D quits"


@dataclass
class Session:
    """The conversation so far, and what producing its answers cost."""

    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: int = 0
    forward_passes: int = 0  # the prefill of each answer included
    seconds: float = 0.0

    def stats(self) -> str:
        rate = self.tokens / max(self.forward_passes, 1)
        speed = self.tokens / self.seconds if self.seconds else 0.0
        return (f"{self.tokens} tokens in {self.forward_passes} forward passes: "
                f"acceleration {rate:.2f} tokens/pass, {speed:.1f} tokens/s")


def answer(medusa: MedusaModel, session: Session, config: GenerationConfig, out: TextIO, raw: bool = False) -> str:
    """Streams the reply to the history (raw: as raw text, conversation.py); counts its tokens, forward passes and
    time into the session."""
    start, reply, pieces = time.perf_counter(), "", TextPieces(config.stop)
    for step in medusa.each_step(messages=session.messages, raw=raw, config=config):
        session.tokens += len(step.tokens)
        session.forward_passes += 1
        piece = pieces.add(step.text, step.done)
        reply += piece
        out.write(piece)
        out.flush()
    session.seconds += time.perf_counter() - start
    return reply


def chat(medusa: MedusaModel, config: GenerationConfig, out: TextIO = sys.stdout, raw: bool = False) -> Session:
    """The read-answer loop; returns the session when the user leaves (/exit, Ctrl-D, Ctrl-C)."""
    import readline  # noqa: F401  line editing and history for input()

    session = Session()
    out.write(f"medusa chat: {medusa.model.name_or_path}, {medusa.heads.config.num_heads} heads, "
              f"{medusa.tree.num_nodes - 1}-node tree. {HELP}\n")
    try:
        while (line := input(USER_PROMPT).strip()) != "/exit":
            if line == "/reset":
                session.messages.clear()
                out.write("(history cleared)\n")
            elif line == "/stats":
                out.write(session.stats() + "\n")
            elif line.startswith("/"):
                out.write(f"unknown command {line!r}: {HELP}\n")
            elif line:
                session.messages.append({"role": "user", "content": line})
                out.write(ASSISTANT_PROMPT)
                try:
                    reply = answer(medusa, session, config, out, raw)
                except ValueError as error:  # e.g. the history outgrew the context: drop this turn
                    session.messages.pop()
                    out.write(f"\nerror: {error} (/reset starts over)\n")
                    continue
                session.messages.append({"role": "assistant", "content": reply})
                out.write("\n")
    except (EOFError, KeyboardInterrupt):
        out.write("\n")
    return session
