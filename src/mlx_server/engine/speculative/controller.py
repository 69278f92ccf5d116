"""How many tokens to draft next: the count that maximises expected tokens per second.

With a per-token acceptance rate ``a`` (the chance a drafted token is accepted given the
ones before it were), a draft of ``k`` yields ``(1 - a**(k+1)) / (1 - a)`` tokens per step;
a step with ``k`` drafts costs ``t0 + c*k`` (measured: ``t0`` from steps without a draft,
``c`` from the extra time of steps with one). The count drops to zero when drafting does
not pay; one step in 64 measures ``t0`` afresh; every ``probe_every`` steps at zero one token is drafted again, so a sequence
whose text turns repetitive starts speculating again.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, max_k: int, *, prior: float = 0.6, probe_every: int = 16):
        self.max_k = max_k
        self.rate = prior  # acceptance per drafted token, moving average
        self.t0 = 0.0  # seconds of a step without a draft (0: not measured yet)
        self.per_token = 0.0  # extra seconds per drafted token
        self._idle = 0
        self._probe_every = probe_every
        self._steps = 0

    def next_k(self) -> int:
        if self.max_k <= 0:
            return 0
        self._steps += 1
        if self._steps % 64 == 2:  # a step without a draft now and then measures t0
            return 0
        best = self._best()
        if best == 0:
            self._idle += 1
            if self._idle >= self._probe_every:
                self._idle = 0
                return 1
        return best

    def _best(self) -> int:
        if self.t0 <= 0:
            return self.max_k  # nothing measured yet: try
        a = min(self.rate, 0.999)
        best, best_speed = 0, 1.0 / self.t0
        for k in range(1, self.max_k + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            speed = tokens / (self.t0 + self.per_token * k)
            if speed > best_speed * 1.02:  # a margin: noise should not make it speculate
                best, best_speed = k, speed
        return best

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        """One verification step: ``drafted`` proposed, ``accepted`` kept, how long it took."""
        if drafted == 0:
            self.t0 = seconds if self.t0 <= 0 else 0.8 * self.t0 + 0.2 * seconds
            return
        # Accepted tokens form a prefix: accepted of the first accepted + 1 tries succeeded.
        tries = min(drafted, accepted + 1)
        self.rate = 0.8 * self.rate + 0.2 * (accepted / tries)
        if self.t0 > 0:
            extra = max(0.0, (seconds - self.t0) / drafted)
            self.per_token = extra if self.per_token <= 0 else 0.8 * self.per_token + 0.2 * extra
