#!/usr/bin/env python3
"""Summarise a GPU run's results.jsonl: one block per model, one line per layer, then the ratios."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any


def cpu_note(r: dict[str, Any]) -> str:
    """The server's CPU per 1,000 tokens, where the line has it (``--server-pid``)."""
    cpu = r.get("server_cpu_s_per_1k_tok")
    return f", server CPU {cpu:.3f} s per 1,000 tokens" if cpu is not None else ""


def main(path: str) -> None:
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in open(path):
        r = json.loads(line)
        model = r.get("label", "").split(" ")[-1]
        rows[model].append(r)
    for model, rs in rows.items():
        print(f"== {model}")
        f: dict[str, float] = {}
        for r in rs:
            lab, sc = r.get("label", ""), r.get("scenario")
            who = lab.split(" ")[0]
            if sc == "raw_engine":
                f["raw"] = r["decode_tok_s_median"]
                print(
                    f"  raw_engine       decode {r['decode_tok_s_median']:.0f} tok/s, prefill {r.get('prefill_tok_s_median') or 0:.0f} tok/s, long ttft {r['wall_ttft_long_prompt_s_median']:.3f} s"
                )
            elif sc == "layer":
                layer, n, what = r.get("layer"), r.get("n"), r.get("what")
                if what == "new_lengths":
                    new = ", ".join(f"{x * 1000:.0f}" for x in r["ttft_new_s"])
                    print(
                        f"  {layer:16} ttft ms, new prompt lengths: {new}; a seen one: {r['ttft_seen_s'] * 1000:.0f}"
                    )
                elif what == "shapes":
                    ms = lambda xs: ", ".join(f"{x * 1000:.1f}" for x in xs)  # noqa: E731
                    print(
                        f"  {layer:16} chunk after {r['prefix_tokens']} cached, ms: new chunk lengths {ms(r['new_chunk_len_s'])}, seen {r['seen_chunk_len_s'] * 1000:.1f}; new prefix lengths {ms(r['new_prefix_len_s'])}, seen {r['seen_prefix_len_s'] * 1000:.1f}"
                    )
                elif layer == "stream_generate" and what == "prefill":
                    f["raw_prefill"] = r["ttft_s"]
                    print(
                        f"  stream_generate  prefill {r['prompt_tokens']} tok: ttft {r['ttft_s']:.3f} s"
                    )
                elif layer == "stream_generate":
                    key = "stream_ignore_eos" if r.get("ignore_eos") else "stream"
                    f[key] = r["decode_tok_s"]
                    print(
                        f"  stream_generate  decode {r['decode_tok_s']:.0f} tok/s (ignore_eos {bool(r.get('ignore_eos'))})"
                    )
                elif layer == "batch_generator":
                    f[f"bg{n}"] = r["aggregate_tok_s"]
                    print(
                        f"  BatchGenerator N={n:<3} aggregate {r['aggregate_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.0f}, step {r['step_ms']:.2f} ms"
                    )
                elif layer == "engine" and what == "prefill":
                    print(
                        f"  Engine           prefill {r['prompt_tokens']} tok cold ttft {r['cold_ttft_s']:.3f} s, warm ({r['warm_prompt_tokens']}) {r['warm_ttft_s']:.4f} s"
                    )
                elif layer == "disk_evictions" and what == "ratio":
                    q, each = r.get("decode_disk_over_ram_per_round"), r.get("disk_save_ms_each")
                    vs = f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})" if q else "-"
                    w = r["aggregate_disk_over_ram_per_round"]
                    vs += f", aggregate {w['median']:.2f} ({w['min']:.2f}-{w['max']:.2f})"
                    ms_each = f"{each:.2f} ms" if each is not None else "-"
                    print(
                        f"  disk tier  N={n:<3} decode with / without it per round {vs}; {r['disk_saves']} saves, {ms_each} each on the engine thread"
                    )
                elif layer == "engine" and what == "first_burst":
                    print(f"  Engine           first burst N=8 ttft p95 {r['ttft_p95_s']:.3f} s")
                elif layer == "engine" and n:
                    f[f"eng{n}"] = r["aggregate_tok_s"]
                    ph = r.get("phases", {})
                    parts = ", ".join(
                        f"{k} {v['ms_per_step']:.2f}" for k, v in ph.items() if isinstance(v, dict)
                    )
                    ratio = r.get("decode_ratio_per_round")
                    vs = (
                        f", decode / BatchGenerator per round {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}), asyncio cpu {r.get('main_cpu_ms_per_step', 0):.2f} ms/step"
                        if ratio
                        else ""
                    )
                    print(
                        f"  Engine     N={n:<3} aggregate {r['aggregate_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.0f}{vs}; ms/step: {parts}"
                    )
            elif sc == "burst":
                lv = r["levels"][0]
                f[f"{who}_burst_p95"] = lv.get("ttft_p95_s", -1)
                print(
                    f"  {who:6} first burst N={lv['n']} ttft p95 {lv.get('ttft_p95_s', -1):.3f} s, aggregate {lv.get('aggregate_tok_s', 0):.0f}"
                )
            elif sc == "single":
                f[f"{who}_single"] = r["decode_tok_s_median"]
                print(
                    f"  {who:6} single decode {r['decode_tok_s_median'] or 0:.0f} tok/s, ttft {r['ttft_s_median'] or 0:.3f} s{cpu_note(r)}"
                )
            elif sc == "concurrency":
                for x in r["levels"]:
                    f[f"{who}_n{x['n']}"] = x.get("aggregate_tok_s", 0)
                print(
                    f"  {who:6} aggregate (N, tok/s, ttft p95 s):",
                    [
                        (
                            x["n"],
                            round(x.get("aggregate_tok_s", 0)),
                            round(x.get("ttft_p95_s", 0), 2),
                        )
                        for x in r["levels"]
                    ],
                )
                pre = [
                    (x["n"], x.get("server_prompt_ms_min"), x.get("server_prompt_ms_max"))
                    for x in r["levels"]
                ]
                if any(lo is not None for _, lo, _ in pre):  # one prefill wave: min ≈ max
                    print(
                        f"  {who:6} server prefill ms (N, min, max):",
                        [(n, round(lo or 0), round(hi or 0)) for n, lo, hi in pre],
                    )
                cpu = [(x["n"], x.get("server_cpu_s_per_1k_tok")) for x in r["levels"]]
                if any(c is not None for _, c in cpu):
                    print(
                        f"  {who:6} server CPU s per 1,000 tokens (N, s):",
                        [(n, round(c, 3) if c is not None else None) for n, c in cpu],
                    )
            elif sc == "variants":
                o, w = r["ours_decode_tok_s"], r["raw_decode_tok_s"]
                q = r.get("ratio_per_round") or {}  # kits before the rounds lack it
                per_round = ""
                if q.get("min"):  # the issue's measure: the median of the rounds' own ratios
                    per_round = f", per round {q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})"
                order = ""
                if r.get("rounds"):
                    order = ", positions " + "/".join(str(x["position"]) for x in r["rounds"])
                print(
                    f"  variant {r['variant']:18} ours {o['median'] or 0:.0f} ({o['min'] or 0:.0f}-{o['max'] or 0:.0f}) / raw {w['median'] or 0:.0f} ({w['min'] or 0:.0f}-{w['max'] or 0:.0f}) tok/s: medians' ratio {r['ratio_median'] or 0:.2f}{per_round}{order}"
                )
            elif sc == "long_ctx":
                turns = ", ".join(
                    f"failed: {t['error']}"
                    if "error" in t
                    else f"{t['ttft_s']:.2f} s cached {t['cached_tokens']}/{t['prompt_tokens']}"
                    for t in r["turns"]
                )
                print(f"  {who:6} long_ctx ttft per turn: {turns}")
            elif sc == "constrained":
                parts = ", ".join(
                    f"N={x['n']} {x.get('ratio') or 0:.2f}"
                    + (
                        f" (median of {len(q['all'])} rounds, {q['min']:.2f}-{q['max']:.2f})"
                        if (q := x.get("ratio_per_round")) and len(q["all"]) > 1
                        else ""
                    )
                    for x in r["levels"]
                )
                print(f"  {who:6} constrained json_schema/free: {parts}")
            elif sc == "prefix":
                f[f"{who}_cold"] = r["ttft_cold_turn1_s"]
                f[f"{who}_warm"] = r["ttft_warm_median_s"]
                print(
                    f"  {who:6} prefix ttft cold {r['ttft_cold_turn1_s']:.3f} s ({r['turns'][0]['prompt_tokens']} tok), warm {r['ttft_warm_median_s']:.4f} s"
                )

        def ratio(a: str, b: str, f: dict[str, float] = f) -> str:
            return f"{f[a] / f[b]:.2f}" if f.get(a) and f.get(b) else "-"

        print(
            f"  ratios: ours single/raw {ratio('ours_single', 'raw')}, ours single/stream_generate {ratio('ours_single', 'stream')}, "
            f"ours N32/BG32 {ratio('ours_n32', 'bg32')}, ours N32/N8 {ratio('ours_n32', 'ours_n8')}, "
            f"ours/mlxlm N8 {ratio('ours_n8', 'mlxlm_n8')}, N32 {ratio('ours_n32', 'mlxlm_n32')}, "
            f"cold/raw prefill {ratio('ours_cold', 'raw_prefill')}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
