"""What depends on the device: default batch and prefill sizes, and the warm-up at load.

On a GPU a decode step of a small model takes a few milliseconds and a batch of 32 costs
little more than a batch of 8, while a CPU is compute bound at a few sequences; a GPU
prefills thousands of tokens in the time a CPU takes for a few hundred. MLX's CUDA backend
also compiles kernels for shapes it meets for the first time, so the first batch of each
size stalls unless it was run once before the server says it is ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx

from mlx_server.engine.core.wired import hands_off

CPU_BATCH = 8
GPU_BATCH = 32
CPU_PREFILL_STEP = 512
GPU_PREFILL_STEP = 2048
# Prefill chunk lengths the lone path pads to where kernels are built per shape, so that a
# warm chat turn (its history cached, a few dozen new tokens) meets a length built before;
# above 512 in steps of half the last, so that padding adds at most half a chunk's work (a
# 1,157-token prompt: 1,536, not 2,048). None below 64: MLX's CUDA backend builds a 4-bit
# matmul's kernel per tile of rows (``qmm_sm80``: 8-16, 17-32 and 33 or more rows; 25-30 s
# each on a fresh H100 for an 8B model), so with 16 and 32 a first short prompt waited for
# a kernel the warm-up had not reached (a 31-token prompt: 26.8 s); padded to 64, every
# short chunk meets the one kernel of 33 rows or more, at the cost of a few milliseconds.
PREFILL_BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048)
# Prefill chunks up to this many tokens: their attention is computed plainly on CUDA
# (models/cuda_attention.SHORT_QUERY), so the key length before them builds nothing.
SHORT_CHUNK = 64
# The longest key buffer whose lone decode step the warm-up runs where kernels are built per
# shape (see ``lone_decode_lengths``); those up to LONE_DECODE_EARLY come first in idle time.
LONE_DECODE_KEYS = 8192
LONE_DECODE_EARLY = 2048
IDLE_BUDGETS = 2  # idle time's warm-up budget, in budgets of the readiness line's
# Where kernels are built per shape, a first token slower than this means they are being
# built now (an empty kernel cache: seconds per kernel), not read from disk (milliseconds):
# the rest of the warm-up then waits for idle time (``WarmUp``, ``cold``).
COLD_FIRST_TOKEN_S = 3.0
# A decode step with grammars (``runners.batch_step.DecodeStep``). False reads the fed
# tokens, then fills the masks on a worker thread while this one launches the forward pass:
# the host's two jobs overlap. True queues the pass behind the previous step first, as free
# decoding does, then reads the tokens and fills while the device runs it. Measured on an
# H200 with a 1B bf16 model (``bench/constrained_engine.py``, json_schema over free
# decoding, bench/results/gpu-2026-12-06h-constrained-engine-1b-0-h200.log): False 0.85 at 8
# streams and 0.64 at 32, True 0.65 and 0.48. At those sizes the host is the bound (a free
# step is about its launch), and True puts the fill after the launch on one thread where
# False overlaps them (``bench/constrained_engine.py --phases`` on an H100 at 32 streams:
# the fill 4.2-4.5 ms after a 6.4 ms launch, against 4.3 ms on the worker under a 5.6-6.7
# ms one). On this CPU the two are alike.
GRAMMAR_LAUNCH_FIRST = False


def bucket(n: int, limit: int) -> int:
    """The smallest bucket length that holds ``n`` tokens, at most ``limit`` (never below n)."""
    for b in PREFILL_BUCKETS:
        if b >= n:
            return max(n, min(b, limit))
    return n


def on_gpu() -> bool:
    """Whether MLX computes on a GPU (Metal or CUDA) rather than the CPU."""
    return bool(mx.default_device().type == mx.DeviceType.gpu)


def builds_kernels_on_first_use() -> bool:
    """MLX's CUDA backend compiles kernels for each new shape (Metal's are prebuilt)."""
    cuda = getattr(mx, "cuda", None)
    return bool(on_gpu() and cuda is not None and cuda.is_available())


def default_batch_size(kv_budget_bytes: int, full_context_bytes: int) -> int:
    """Sequences decoded together: 8 on a CPU; on a GPU as many full-context sequences (of
    ``full_context_bytes`` each) as the KV budget holds, between 8 and 32 (admission still
    queues by actual KV use)."""
    if not on_gpu():
        return CPU_BATCH
    fit = kv_budget_bytes // max(1, full_context_bytes)
    return int(min(GPU_BATCH, max(CPU_BATCH, fit)))


def default_prefill_step() -> int:
    """Prompt tokens per prefill chunk (and, paced, per step)."""
    return GPU_PREFILL_STEP if on_gpu() else CPU_PREFILL_STEP


# One piece of the warm-up: called, a generator whose steps are run one at a time.
Piece = Callable[[], Generator[None, None, None]]


@dataclass
class ShapePieces:
    """Shapes a runner of its own adds to the warm-up (a speculative runner's verify
    passes): ``first`` before serving as far as the warm-up's budget allows (what does not
    fit runs first in idle time), ``later`` by batch size in idle time, each size's after
    its decode steps; ``budget_s``: seconds they add to the warm-up's budget."""

    first: list[Piece] = field(default_factory=list)
    later: dict[int, list[Piece]] = field(default_factory=dict)
    budget_s: float = 0.0
    what: str = ""  # for the log line: "verify passes of widths 1, 2, 4, 8"


def warm_up(
    model: Any,
    max_batch_size: int,
    prefill_step_size: int,
    budget_s: float = 30.0,
    buckets: bool = False,
) -> float:
    """Run one full prefill chunk and a few decode steps at every batch size up to
    ``max_batch_size``, with a generator of its own (nothing reaches the prefix cache), and
    with ``buckets`` a lone prefill of every bucket length after a cached prefix. Stops
    early after ``budget_s``. Returns the seconds it took."""
    plan = WarmUp(model, max_batch_size, prefill_step_size, budget_s, buckets=buckets)
    secs = plan.before_ready()
    while plan.pending:
        secs += plan.step()
    return secs


class WarmUp:
    """The warm-up in pieces. Before the readiness line, what a first, lone request meets:
    the lone path's short prefill buckets, batch size 1 and the samplers' kernels
    (``samplers``: pieces of their own, the likeliest settings first). Afterwards, one piece
    at a time while the engine has nothing else to do (``step``): the long prefill buckets, batch
    sizes 2 to ``max_batch_size``, the small ones first (what a few concurrent requests
    meet), then a full prefill chunk in the batch; with ``lone_keys``, a lone decode step
    over each key buffer length up to it (``lone_decode_lengths``; those up to
    ``LONE_DECODE_EARLY`` before the batch sizes, the rest after). A runner may add shapes
    of its own (``shapes``: a speculative runner's verify passes). A piece is one step of a
    generator of the warm-up's own (one prefill chunk or one decode step at one batch
    size), so a request that arrives meanwhile waits for that step only; a shape it meets
    before its piece has run is built on first use, as it would have been without a
    warm-up.

    Before the readiness line the warm-up's own ``budget_s`` holds for the runner's
    ``first`` shapes too: once it is spent, the rest of them (the piece under way, one
    generator step later) go to the front of the idle-time queue (``deferred`` counts them).
    ``clock``: seconds, for the budget (tests pass a fake one)."""

    def __init__(
        self,
        model: Any,
        max_batch_size: int,
        prefill_step_size: int,
        budget_s: float = 30.0,
        *,
        buckets: bool = False,
        shapes: ShapePieces | None = None,
        lone_keys: int = 0,
        solo: bool = False,
        samplers: list[Piece] | None = None,
        cold: bool = False,
        building_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.model = model
        # kernels are being built on first use (``COLD_FIRST_TOKEN_S``): nothing before the
        # readiness line, what a first request meets first in idle time (``before_ready``)
        self.cold = cold
        # a warm-up step this long builds kernels (a first token read from a kernel cache
        # that holds the model's pass but not every piece's kernels: after an upgrade, or a
        # cache another program filled); the readiness line then waits for no other piece
        # (None: never so judged; where kernels are not built per shape)
        self.building_s = building_s
        self.building = False  # a step before the readiness line was judged so
        # a lone request runs on the lone path (``solo``): its short buckets come before the
        # batch's size 1 (``before_ready``)
        self.solo = solo
        self.batch1_deferred = False  # batch size 1 left for idle time (the budget ran out)
        self._clock = clock or time.perf_counter
        self.ready_budget_s = budget_s
        self.max_batch_size = max_batch_size
        self.step_size = prefill_step_size
        shapes = shapes or ShapePieces()
        # idle time's own budget: what the readiness line's would hold twice over (the long
        # prefill buckets wait for idle time whatever the budget), and the runner's shapes
        self.budget_s = IDLE_BUDGETS * budget_s + shapes.budget_s
        self._first = shapes.first
        self._samplers = list(samplers or [])
        self.samplers = len(self._samplers)
        self.deferred_samplers = 0  # sampler pieces left for idle time by before_ready
        self.buckets = buckets
        self.spent = 0.0  # seconds, over every piece run so far
        self.pieces = 0  # pieces run after the readiness line
        self.deferred = 0  # pieces of ``shapes.first`` left for idle time by before_ready
        self.deferred_buckets = 0  # prefill buckets left for idle time by before_ready
        self._ready_spent = 0.0  # seconds before the readiness line (idle time has its own budget)
        full = [[1 + i % 7 for i in range(prefill_step_size + 1)]]
        self.lone_lengths = lone_decode_lengths(model, lone_keys)
        lone: list[Piece] = [partial(_lone_decode, model, n) for n in self.lone_lengths]
        early = sum(n <= LONE_DECODE_EARLY for n in self.lone_lengths)
        self._later: list[Piece] = list(shapes.later.get(1, [])) + lone[:early]
        for n in range(2, max_batch_size + 1):
            self._later += [partial(self._drain, _prompts(n), 3), *shapes.later.get(n, [])]
        self._later.append(partial(self._drain, full, 2))
        self._later += lone[early:]
        # the drain under way, one piece (generator step) at a time
        self._run: Generator[None, None, None] | None = None
        self.last = ""  # what the last idle-time piece ran (``piece_name``)

    @property
    def queued(self) -> int:
        """Pieces waiting for idle time."""
        return len(self._later)

    @property
    def pending(self) -> bool:
        """Whether pieces are left (none once the budget is spent)."""
        left = bool(self._later) or self._run is not None
        return left and self.spent - self._ready_spent < self.budget_s

    def before_ready(self) -> float:
        """The pieces a first request needs; returns their seconds. Batch size 1 always (for a
        ``solo`` engine with buckets: after the lone path's short buckets, within the budget);
        then, while the budget lasts, the lone path's short prefill buckets (a chat's next
        turn) and the runner's shapes; what is left of them goes to the front of the idle-time
        queue (``deferred`` counts the runner's), after it the long buckets from an empty
        cache (a conversation's first prompt). On a fresh CUDA machine
        each new shape builds kernels (seconds each), so without the budget the buckets
        alone could hold the readiness line for minutes; once the kernels are on disk a
        long bucket costs a cuDNN graph (tens of milliseconds), less than it would hold
        the readiness line (a model switch in Jan waits for it). ``cold`` (kernels being
        built now): none of it, all for idle time (``_all_for_idle``)."""
        t0 = self._clock()
        try:
            batch1: Piece = partial(self._drain, _prompts(1), 3)
            now, idle = self._bucket_pieces()
            if self.cold:
                self._all_for_idle(batch1, now, idle)
            else:
                self._ready_pieces(t0, batch1, now, idle)
        finally:
            mx.clear_cache()
        secs = self._spend(t0)
        self._ready_spent = self.spent
        return secs

    def _ready_pieces(self, t0: float, batch1: Piece, now: list[Piece], idle: list[Piece]) -> None:
        """``before_ready``'s pieces within the budget (see there)."""
        if not (self.solo and self.buckets):
            for _ in batch1():
                pass
        left_now = self._within_budget(now, t0)
        bucket_under_way = self._run is not None
        self.deferred_buckets = len(left_now) + bucket_under_way + len(idle)
        if self.solo and self.buckets:
            # A first request runs alone, on the lone path: its prompt's bucket and its
            # decode on a plain KV cache. On a fresh CUDA machine the batch's size 1 (other
            # kernels: mlx-lm's batch cache) took a whole 30 s budget on an 8B 4-bit model,
            # leaving the first request to build the lone path's for 28 s more.
            left_b1 = self._within_budget([batch1], t0) if not left_now else [batch1]
            self.batch1_deferred = bool(left_b1) or (self._run is not None and not bucket_under_way)
            left_now += left_b1
        out_of_budget = bool(left_now) or self._run is not None
        # the samplers' kernels (seconds each on a fresh CUDA machine), then the runner's
        left_samplers = self._within_budget(self._samplers, t0)
        sampler_under_way = self._run is not None and not out_of_budget
        self.deferred_samplers = len(left_samplers) + sampler_under_way
        out_of_budget = out_of_budget or self.deferred_samplers > 0
        left_first = self._within_budget(self._first, t0)
        if out_of_budget:  # out of budget before the runner's shapes: none of them ran
            self.deferred = len(self._first)
        else:
            self.deferred = len(left_first) + (self._run is not None)
        self._later = left_now + left_samplers + idle + left_first + self._later

    def _bucket_pieces(self) -> tuple[list[Piece], list[Piece]]:
        """The prefill buckets' pieces: the short ones (after a prefix: a chat's next turn;
        the prefix itself is a first prompt's chunk from an empty cache) and the long ones
        (from an empty cache). None without ``buckets``."""
        if not self.buckets:
            return [], []
        # the lengths bucket(n, step) gives for a chunk (n <= step); attention's kernels are
        # built per query and key length
        lengths = sorted({min(b, self.step_size) for b in PREFILL_BUCKETS})
        now: list[Piece] = [
            partial(_prefill_bucket, self.model, n) for n in lengths if n <= SHORT_CHUNK
        ]
        # a long chunk after a prefix meets a graph for its key length whatever the warm-up
        # ran; from an empty cache its shapes are the bucket's own
        long = [n for n in lengths if n > SHORT_CHUNK]
        return now, [partial(_prefill_bucket, self.model, n, 0) for n in long]

    def _all_for_idle(self, batch1: Piece, short: list[Piece], long: list[Piece]) -> None:
        """``cold``: every piece waits for idle time, what a first request meets first: on
        the lone path its prompt's chunk (the short buckets) and the likeliest samplers,
        then the batch's size 1; without it the batch's size 1 first. On a fresh H100 the
        pieces before the readiness line took 62 s for an 8B 4-bit model (each new kernel
        seconds to half a minute), and the first request still built the kernels of its
        own prompt length for 27 s; now the server says it is ready once the model has
        computed a token, and a request sent at once builds only what it meets (idle time
        starts ``warm_idle_s`` after it). The readiness line's budget, unspent, goes to idle
        time's: the warm-up may do as much in all as it would have."""
        first = (
            [*short, *self._samplers, batch1] if self.solo else [batch1, *short, *self._samplers]
        )
        self._later = first + long + self._first + self._later
        self.budget_s += self.ready_budget_s
        self.batch1_deferred = True
        self.deferred_buckets = len(short) + len(long)
        self.deferred_samplers = len(self._samplers)
        self.deferred = len(self._first)

    def _within_budget(self, pieces: list[Piece], t0: float) -> list[Piece]:
        """Run ``pieces`` in order until the readiness budget is spent, or a step is seen
        building kernels (``building_s``); returns those not started. A piece under way
        then is kept in ``_run`` (idle time goes on with it); once one is kept, nothing else
        starts."""
        pieces = list(pieces)
        while pieces and self._run is None and not self._ready_spent_now(t0):
            run = pieces.pop(0)()
            while True:
                if self._ready_spent_now(t0):  # with this piece under way: idle time's
                    self._run = run
                    break
                started = self._clock()
                done = next(run, StopIteration) is StopIteration
                took = self._clock() - started
                if self.building_s is not None and took >= self.building_s:
                    self.building = True
                if done:
                    break
        return pieces

    def _ready_spent_now(self, t0: float) -> bool:
        """Whether the readiness line waits for no more: its budget spent, or kernels seen
        being built."""
        return self.building or self._clock() - t0 >= self.ready_budget_s

    def step(self) -> float:
        """Run the next piece (one generator step); returns its seconds."""
        t0 = self._clock()
        try:
            if self._run is None:
                piece = self._later.pop(0)
                self.last = piece_name(piece)
                self._run = piece()
            if next(self._run, StopIteration) is StopIteration:
                self._run = None
        except BaseException:
            self.close()
            raise
        finally:
            self.pieces += 1
            if not self.pending:
                self.close()
        return self._spend(t0)

    def close(self) -> None:
        """Drop what is left (the drain under way closes its generator)."""
        if self._run is not None:
            self._run.close()
            self._run = None
        self._later = []
        mx.clear_cache()

    def _spend(self, t0: float) -> float:
        secs = self._clock() - t0
        self.spent += secs
        return secs

    def _drain(self, prompts: list[list[int]], max_tokens: int) -> Generator[None, None, None]:
        """Generate ``max_tokens`` for every prompt, yielding after each generator step."""
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(
            self.model,
            completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.max_batch_size,
            prefill_step_size=self.step_size,
            stop_tokens=[],
        )
        hands_off(gen)
        try:
            left = set(gen.insert(prompts, max_tokens=[max_tokens] * len(prompts)))
            while left:
                for r in gen.next()[1]:
                    if r.finish_reason is not None:
                        left.discard(r.uid)
                yield
        finally:
            gen.close()


def piece_name(piece: Any) -> str:
    """A warm-up piece for the log: its function and its number arguments ("drain: a batch
    of 8", "prefill_bucket 768 0", "lone_decode 4096")."""
    fn = getattr(piece, "func", piece)
    name = getattr(fn, "__name__", type(fn).__name__).strip("_")
    args = getattr(piece, "args", ())
    if name == "drain" and args and isinstance(args[0], list):
        return f"drain: a batch of {len(args[0])}"
    numbers = [str(a) for a in args if isinstance(a, int) and not isinstance(a, bool)]
    return " ".join([name, *numbers])


def _prompts(n: int) -> list[list[int]]:
    return [[1 + (i + j) % 7 for j in range(16)] for i in range(n)]


def first_token(model: Any) -> Any:
    """Compute one token's logits on a fresh cache, then one decode step: a model that
    cannot run (a layer kind, a dtype or a kernel this build lacks) fails here, before the
    server says it is ready, and the first request does not pay for building the smallest
    kernels. Returns the logits' dtype (what samplers are handed)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([[1, 2]]), cache=cache)
    mx.eval(logits[:, -1, :], [c.state for c in cache])
    # and one decode step on it: the kernels every answer's tokens need (on CUDA a lone
    # sequence's first decode also meets the graph of its 256-key buffer)
    step = model(mx.array([[3]]), cache=cache)
    mx.eval(step[:, -1, :], [c.state for c in cache])
    return logits.dtype


def lone_decode_lengths(model: Any, limit: int) -> list[int]:
    """The key-buffer lengths, up to ``limit``, whose decode step a lone sequence meets on
    CUDA: MLX gives a one-token query over a slice of a key buffer whose length is a
    multiple of mlx-lm's ``KVCache`` step (256) to cuDNN from 256 keys on, and cuDNN builds
    a graph for each buffer length, so a lone answer that grows its cache past a length not
    met before waits for one. A sequence prefilled from an empty cache keeps such buffers
    (the cache grows by whole steps). None where the model's cache has other layers than
    ``KVCache`` and recurrent states (a sliding window, quantized keys: other kernels)."""
    if limit <= 0:
        return []
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    kv = [c for c in cache if type(c) is KVCache]
    if not kv or not all(c in kv or isinstance(c, ArraysCache) for c in cache):
        return []
    step = kv[0].step
    return list(range(step, limit - limit % step + 1, step))


def _lone_decode(model: Any, total: int) -> Generator[None, None, None]:
    """One decode step of a lone sequence whose key buffers hold ``total`` positions, the
    last of them the new token's (one warm-up piece; see ``lone_decode_lengths``)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[1, 2]]), cache=cache)
    grown = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None and c.values is not None:
            k, v = c.keys, c.values
            c.keys = mx.zeros((*k.shape[:2], total, k.shape[3]), dtype=k.dtype)
            c.values = mx.zeros((*v.shape[:2], total, v.shape[3]), dtype=v.dtype)
            c.offset = total - 1
            grown += [c.keys, c.values]
    mx.eval(grown)  # evaluated buffers: MLX reads the slice's layout from them
    logits = model(mx.array([[3]]), cache=cache)
    mx.eval(logits[:, -1, :])
    yield from ()  # one step: done when it returns


def _prefill_bucket(model: Any, n: int, prefix: int = 64) -> Generator[None, None, None]:
    """A lone prefill chunk of ``n`` tokens after ``prefix`` tokens (one warm-up piece)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if prefix:  # a "cached" prefix
        model(mx.array([[1 + i % 7 for i in range(prefix)]]), cache=cache)
    logits = model(mx.array([[1 + i % 7 for i in range(n)]]), cache=cache)
    mx.eval(logits[:, -1, :], [c.state for c in cache])
    yield from ()  # one step: done when it returns
