"""How sequences end, on the engine thread: each generated token delivered and the finished
leave the runner (their KV state to the prefix cache), cancelled ones are taken out,
faulted ones end with their own error, and everything ends when the engine stops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_server.engine.core import faults
from mlx_server.engine.core.delivery import Seq, deliver_finish, deliver_token
from mlx_server.engine.core.handle import Outbox
from mlx_server.engine.core.prefixes import Prefixes
from mlx_server.engine.core.scheduler import Scheduler
from mlx_server.engine.runners.base import Response, Runner
from mlx_server.engine.sampling.samplers import reset_random_state


@dataclass
class Endings:
    """The engine's ending side, over its scheduler, runner and prefix-cache side."""

    tokenizer: Any
    sched: Scheduler
    runner: Runner
    prefixes: Prefixes
    outbox: Outbox

    def responses(self, responses: list[Response]) -> None:
        """Each generated token to its sequence; sequences that finished leave."""
        active, keep = self.sched.active, self.prefixes.keep
        stopped: list[Seq] = []
        for r in responses:
            seq = active.get(r.uid)
            if seq is None or seq.fault is not None:
                continue  # gone, or ends below without the token its broken step produced
            try:
                reason = deliver_token(self.tokenizer, seq, r)
            except Exception as e:  # this sequence's output handling: its own error
                faults.note_output_fault(seq, e)
                continue
            if reason is None:
                continue
            active.pop(r.uid)
            if r.finish_reason is None:
                stopped.append(seq)  # a stop string matched: it leaves the runner now
            else:
                keep(seq, r.prompt_cache, r.all_tokens)
            self.finish(seq, reason)
        self.faulted()
        if stopped:
            saved = self.runner.remove([s.uid for s in stopped])
            for seq in stopped:
                keep(seq, *saved.get(seq.uid, (None, [])))

    def faulted(self) -> None:
        """Take sequences whose own sampler, processors, output or step (a ``Progress``
        with an error) failed out of the runner and end each with its error; the others go
        on."""
        bad = faults.faulted(self.sched.active.values())
        if not bad:
            return
        self.runner.remove([s.uid for s in bad])
        for seq in bad:
            self.sched.active.pop(seq.uid, None)
            self.finish(seq, "error", error=faults.sequence_failed(seq))
        reset_random_state()

    def cancelled(self) -> None:
        """End the cancelled requests, queued and running (their KV state is kept)."""
        for seq in self.sched.take_cancelled_queued():
            self.finish(seq, "cancelled")
        active = self.sched.active
        gone = [uid for uid, s in active.items() if s.handle.cancelled]
        if gone:
            saved = self.runner.remove(gone)
            for uid in gone:
                seq = active.pop(uid)
                self.prefixes.keep(seq, *saved.get(uid, (None, [])))
                self.finish(seq, "cancelled")

    def finish(self, seq: Seq, reason: str, error: str | None = None) -> None:
        self.sched.release(seq)
        deliver_finish(seq, reason, error, quiet=self.sched.stopping)

    def fail(self, message: str, *, queued: bool) -> None:
        """End every running (and with ``queued``, every queued) sequence: "cancelled" when
        ``message`` is that, else an error with ``message``."""
        reason = "cancelled" if message == "cancelled" else "error"
        for seq in self.sched.take_all(queued):
            deliver_finish(seq, reason, error=message if reason == "error" else None, quiet=True)
        self.outbox.flush()
