"""An agent session on every architecture family's tiny model (tests/helpers/arch_models.py): how
much of turns 2 and 3 the prefix cache serves, through the chat service's prompt building
(the system prompt's end, the history's end) and the engine (no HTTP), RAM tier then a
restart from the disk tier. Prints one row per family; CPU, seconds of work per family.

    PYTHONPATH=src python bench/agent_cache_arch.py [--before] [family ...]

``--before``: without the history-end and chunk-boundary checkpoints (only the system
prompt's entry and the checkpoint at each prompt's end), for comparison.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

from arch_models import FAMILIES, build  # noqa: E402
from engine_runner import request, running_engine, solo  # noqa: E402

from mlx_server.engine.cache.checkpoints import needs_checkpoints  # noqa: E402
from mlx_server.engine.cache.disk import DiskPromptCache  # noqa: E402
from mlx_server.models.base import settle_arrays  # noqa: E402
from mlx_server.service import ChatService  # noqa: E402
from mlx_server.types import ChatRequest  # noqa: E402

SYSTEM = "You are a coding agent. Read the files, run the tests, report tersely. " * 11
TURNS = ["List the files.", "Now run the tests.", "Summarise the failures."]
ANSWER = "<think>The user wants this done.</think>Done."


def messages(turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": TURNS[i]})
        if i < turn:
            msgs.append({"role": "assistant", "content": ANSWER})
    return msgs


def session(name: str, root: Path, before: bool) -> str:
    from mlx_lm import load

    model, tokenizer = load(str(build(name, root / name)))[:2]
    settle_arrays(model)
    hints = not before and needs_checkpoints(model)
    service = ChatService(name, tokenizer, None, ctx_size=4096, history_ends=hints)  # type: ignore[arg-type]
    reqs = []
    for t in range(3):
        req, _ = service.build_request(ChatRequest(messages(t), max_tokens=3), f"turn-{t}")
        hinted = {"system_prefix_tokens": req.system_prefix_tokens, "history_end": req.history_end}
        reqs.append(request(req.prompt_tokens, 3, ignore_eos=True, **hinted))
    prompts = [r.prompt_tokens for r in reqs]
    every = {"checkpoint_every": 0} if before else {}
    disk = DiskPromptCache(root / f"{name}-disk", 1 << 30, min_tokens=64)
    with running_engine(model, tokenizer, prompt_cache_disk=disk, **every) as engine:
        ram = solo(engine, reqs)
    disk = DiskPromptCache(root / f"{name}-disk", 1 << 30, min_tokens=64, lock_wait_s=30)
    with running_engine(model, tokenizer, prompt_cache_disk=disk, **every) as engine:
        (restart,) = solo(engine, reqs[2:])
        failures = engine.stats()["prompt_cache_failures"]
    sizes = [len(p) for p in prompts]
    cells = [f"{r.cached} / {n}" for r, n in zip(ram[1:], sizes[1:], strict=True)]
    same = "yes" if restart.text == ram[2].text else "NO"
    return f"| {name} | {' | '.join(cells)} | {restart.cached} / {sizes[2]} | {same} | {failures} |"


def main() -> None:
    before = "--before" in sys.argv
    names = [a for a in sys.argv[1:] if a != "--before"] or list(FAMILIES)
    print(
        "| family | turn 2 cached / prompt | turn 3 | turn 3 after a restart (disk) "
        "| same output | cache failures |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                print(session(name, Path(tmp), before), flush=True)
            except Exception as e:  # one family's failure is a row, not the end of the table
                print(f"| {name} | failed: {type(e).__name__}: {e} | | | | |", flush=True)


if __name__ == "__main__":
    main()
