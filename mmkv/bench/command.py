"""`mmkv bench`: where a turn's time goes. Every arm of a table runs interleaved in one run
(arm 1, arm 2, ..., arm 1, arm 2, ...) so machine noise hits all alike; medians are printed.

    mmkv bench --config bench --threads 2 --json bench.json    # the 144M random Qwen2.5-VL
    mmkv bench MODEL_DIR --modes image,skill                   # a local checkpoint
    mmkv bench --config qwen2.5-vl-7b --device cuda            # full-size random bf16 model on a GPU

Arms, each timed up to the turn's next-token logits:
- full recompute: vision tower + one causal forward over the whole prompt (`reuse=False`);
- exact-prefix caching: the earlier turns' KV copied in (block-aligned, as vLLM / SGLang automatic
  prefix caching reuses it when the image moved), vision tower, the rest prefilled;
- encoder cache + prefix caching: the same with the image's features cached (no vision tower);
- mmkv splice k=0 / k=1: prefix KV + the cached chunk rotated into place + one forward of the
  new tokens (seam k);
- engine (reuse): `Engine.generate` TTFT of the same turn end to end (template, tokenizer,
  hashing, edit detection, prefix-cache lookup included), its CPU time also to the first token;
  the prefix-cache insert runs after that token and is printed on its own;
- text-only turn: the same number of new tokens after a text context of the same length, served
  the same way (prefix KV copied in, one forward);
- limit: one forward of exactly the splice's new tokens over KV already in place (nothing copied).

The video mode (`--modes video`, not in the default set) asks about a clip of `--video-groups`
temporal groups of `--group-tokens` tokens each again after new text, with the image mode's arms.
The stream mode (`--modes stream`) grows a live stream and times a question after k = 1 and 4 new
groups at 8 / 16 / 32 / 48 / 64 groups (a 32-group window: the last two points slide it), end to
end beside a full recompute of the same prompt.

Under each image and skill table: tokens/s of 16 greedy decode steps after a splice k=1 of the
turn and after a full prefill of the same prompt, interleaved.

The agent mode replays a seeded multi-turn session (new screenshots, earlier ones shown again,
a spliced skill, errata), its client keeping the last `--window` screenshots (0: all) and dropping
them `--drop-chunk` at a time, and reports each arm's TTFT, tokens computed and tokens reused per
turn and summed over the turns: full recompute, exact-prefix caching, encoder cache + prefix
caching, mmkv exact (screenshots sent inline: a new one computed in context, its chunk built in the
background after the turn, untimed; earlier ones spliced; the text after a dropped screenshot
recomputed), mmkv composed (`history_policy: "compose"`), the limit; per turn, mmkv exact /
exact-prefix caching (each session's two times paired: their median ratio and, from 6 sessions, its
95% interval) and the background build's time. `--agent-arms prefix,exact` runs those two only:
more sessions in the same time.

    mmkv bench --modes agent --agent-turns 16 --window 5                  # UI-TARS: keeps 5, drops one at a time
    mmkv bench --modes agent --agent-turns 16 --window 3 --drop-chunk 3   # Anthropic's loop: keeps 3, drops 3 at a time
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from mmkv.bench import CONFIGS

MODES = ("image", "skill", "errata", "agent", "copy", "bytes", "blend", "video", "stream")
DEFAULT_MODES = ("image", "skill", "errata", "agent", "copy", "bytes")  # blend, video and stream on demand: minutes


def format_header(h: dict) -> str:
    m = h["model"]
    return (f"# mmkv bench | {h['machine']} | {h['device']}, torch threads {h['threads']}, OMP_WAIT_POLICY "
            f"{h['omp_wait_policy']} | python "
            f"{h['versions']['python']}, torch {h['versions']['torch']}, transformers {h['versions']['transformers']}\n"
            f"# model {m['id']} ({m['family']}, {m['params_m']}M params, {m['dtype']}, linear layers "
            f"{m.get('linear', 'dense')}): LM {m['lm']}; vision "
            f"{m['vision']} | medians of {h['repeats']} rounds, arms interleaved; ratios from CPU time")


def format_table(t: dict) -> str:
    notes = "".join(f", {k.replace('_', ' ')} {v}" for k, v in t["notes"].items() if k != "note")
    lines = [f"### {t['mode']}: {t['case']} (prompt {t['prompt_tokens']} tokens{notes})",
             "| arm | ms | CPU ms | speed-up vs full | % of limit | LM tokens computed | vision runs |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['ms']:.1f} | {r['cpu_ms']:.1f} | {r['speedup_vs_full']:.2f}x | "
              f"{r['pct_of_limit']:.0f}% | {r['computed_tokens']} | {r['vision_runs']} |" for r in t["rows"]]
    cpu = {r["arm"]: r["cpu_ms"] for r in t["rows"]}
    fast = next(a for a in ("mmkv splice k=1", "mmkv erratum (appended)") if a in cpu)
    after = {r["arm"]: r.get("after_first_token_cpu_ms", 0.0) for r in t["rows"]}
    lines.append(f"\n{fast} / text-only turn: {cpu[fast] / cpu['text-only turn']:.2f}x"
                 + (f"; engine (reuse) / text-only turn: {cpu['engine (reuse)'] / cpu['text-only turn']:.2f}x"
                    f" (its CPU time to the first token; the prefix-cache insert after it: "
                    f"{after['engine (reuse)']:.1f} ms)" if "engine (reuse)" in cpu else ""))
    if d := t.get("decode"):
        lines.append(f"decode, {d['steps']} greedy steps (CPU time): {d['full_tokens_s']:.1f} tokens/s after a full "
                     f"prefill, {d['splice_tokens_s']:.1f} after a splice k=1 ({d['splice_over_full']:.2f}x)")
    return "\n".join(lines) + "\n"


def format_copy(rows: list[dict]) -> str:
    lines = ["### splice copy vs plain clone of the same bytes (GB per CPU-second)",
             "| chunk | MB | splice GB/s | clone GB/s | splice / clone | before: three torch passes GB/s | before / clone |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['chunk']} | {r['bytes'] / 1e6:.1f} | {r['splice_gb_s']:.1f} | {r['clone_gb_s']:.1f} | "
              f"{100 * r['ratio']:.0f}% | {r['before_gb_s']:.1f} | {100 * r['before_ratio']:.0f}% |" for r in rows]
    return "\n".join(lines) + "\n"


def _window(a: dict) -> str:
    if not a["window"]:
        return "the client resends the whole history"
    chunk = "one at a time" if a["drop_chunk"] == 1 else f"{a['drop_chunk']} at a time"
    return f"the client keeps the last {a['window']} screenshots, dropping them {chunk}"


def _sent(t: dict, before: dict | None) -> str:
    """Screenshots in the turn's prompt, and how many this turn's window dropped."""
    drops = t["dropped"] - (before["dropped"] if before else 0)
    return f"{t['screenshots']}" + (f" (drops {drops})" if drops else "")


def format_agent(a: dict) -> str:
    last = a["sessions"][-1]
    arms = [r["arm"] for r in a["summary"]]
    lines = [f"### agent: {a['turns']} turns, seed {a['seed']}, screenshots of {a['image_tokens']} tokens, "
             f"{a['skill_tokens']}-token skill, {_window(a)} (final prompt {last[-1]['prompt_tokens']} tokens; "
             f"cumulative over the turns, median of {a['repeats']} sessions)",
             "| arm | cumulative TTFT ms | CPU ms | speed-up vs full | vs exact-prefix | % of limit "
             "| LM tokens computed | vision runs | tokens reused |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['ms']:.1f} | {r['cpu_ms']:.1f} | {_opt(r['speedup_vs_full'], '.2f', 'x')} | "
              f"{r['speedup_vs_prefix']:.2f}x | {_opt(r['pct_of_limit'], '.0f', '%')} | {r['computed_tokens']} | "
              f"{r['vision_runs']} | {r['reused_tokens']} |" for r in a["summary"]]
    lines += ["", "per turn, each arm's TTFT ms / LM tokens computed / tokens reused (the last session); mmkv exact "
              "against exact-prefix caching, TTFT (CPU time to the first token), and mmkv's background build after "
              "the turn (medians of the sessions):", "",
              "| turn | what the turn adds | screenshots sent | prompt tokens | new tokens | " + " | ".join(arms)
              + " | mmkv exact reused per plan | mmkv / exact-prefix, wall (CPU) | background build ms |",
              "|---" * (len(arms) + 8) + "|"]
    lines += [f"| {t['turn']} | {t['events']} | {_sent(t, before)} | {t['prompt_tokens']} | {t['new_tokens']} | "
              + " | ".join(f"{t['arms'][arm]['ms']:.0f} / {t['arms'][arm]['computed_tokens']} / "
                           f"{t['arms'][arm]['reused_tokens']}" for arm in arms)
              + f" | {t['mmkv_expected_reused']} | {_ratio(p['mmkv_over_prefix_ms'], p['interval_ms'])} "
                f"({_ratio(p['mmkv_over_prefix_cpu'], p['interval_cpu'])}) | "
                f"{p['background_ms']:.0f} |" for before, t, p in zip([None, *last], last, a["per_turn"])]
    worst = max(a["per_turn"], key=lambda p: p["mmkv_over_prefix_cpu"])
    above = [p["turn"] for p in a["per_turn"] if (p["interval_cpu"][0] or 0) > 1]
    lines += [f"\nmmkv exact / exact-prefix caching, per turn (median over the sessions of each session's ratio): at "
              f"most {worst['mmkv_over_prefix_cpu']:.2f}x in CPU time (turn {worst['turn']}), at most "
              f"{max(p['mmkv_over_prefix_ms'] for p in a['per_turn']):.2f}x in wall time; "
              + (f"turns whose whole 95% interval (CPU) lies above 1.00x: {', '.join(map(str, above))}. " if above else
                 "no turn's 95% interval (CPU) lies wholly above 1.00x. " if a["repeats"] >= 6 else
                 "intervals need 6 sessions or more. ")
              + "A screenshot first seen in a turn is computed in its context; its reusable chunk is built after the "
                "turn, untimed (an agent's environment step is the idle time: the background build ms column)."]
    lines += ["\nthe turns of each kind together, and the turns both arms computed alike (as many vision-tower runs, "
              "at most a block fewer tokens for mmkv): per session, mmkv exact's TTFT summed over them over "
              "exact-prefix caching's; median of the sessions, 95% interval:", "",
              "| turns | which | mmkv / exact-prefix, wall | CPU |", "|---|---|---|---|"]
    lines += [f"| {k['kind']} | {', '.join(map(str, k['turns']))} | {_ratio(k['mmkv_over_prefix_ms'], k['interval_ms'])} "
              f"| {_ratio(k['mmkv_over_prefix_cpu'], k['interval_cpu'])} |" for k in a["per_kind"]]
    lines += [f"\n{arm}: next token as full recompute's on {g['k']} of {g['n']} turns (exact 95% interval "
              f"{g['low']:.3f}-{g['high']:.3f})" for arm, g in a["agreement"].items()]
    return "\n".join(lines) + "\n"


def _opt(value: float | None, spec: str, unit: str) -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _ratio(median: float, interval: list) -> str:
    """A median ratio, with its 95% interval when there is one."""
    low, high = interval
    return f"{median:.2f}x" + ("" if low is None else f" [{low:.2f}-{high:.2f}]")


def format_bytes(rows: list[dict]) -> str:
    lines = ["### bytes per cached token", "| what | KV bytes / token | stored bytes / token | "
             "2 x layers x kv_heads x head_dim x dtype |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['kv_bytes_per_token']:.0f} | {r['stored_bytes_per_token']:.0f} | "
              f"{r['ideal_bytes_per_token']:.0f} |" for r in rows]
    return "\n".join(lines) + "\n"


def _format_blend(t: dict) -> str:
    from mmkv.bench.blend import format_blend

    return format_blend(t)


def format_stream(s: dict) -> str:
    from mmkv.bench.video import format_stream as fmt

    return fmt(s)


FORMATS = {"header": format_header, "table": format_table, "agent": format_agent, "blend": _format_blend,
           "stream": format_stream, "copy": lambda f: format_copy(f["rows"]),
           "bytes": lambda f: format_bytes(f["rows"])}


def _ints(value: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"takes comma-separated integers, got {value!r}", param_hint=flag) from None


def _check_window(window: int, drop_chunk: int, modes: list[str]) -> None:
    if window < 0:
        raise typer.BadParameter(f"must be 0 (the whole history) or the screenshots to keep, got {window}",
                                 param_hint="--window")
    if not window and drop_chunk != 1:
        raise typer.BadParameter("applies with a --window (the whole history drops nothing)", param_hint="--drop-chunk")
    if not 1 <= drop_chunk <= max(window, 1):
        raise typer.BadParameter(f"must be 1 to --window ({window}), got {drop_chunk}", param_hint="--drop-chunk")
    if window and "agent" not in modes:
        raise typer.BadParameter("applies to the agent mode: add agent to --modes", param_hint="--window")


def _agent_arms(value: str, modes: list[str]) -> tuple[str, ...]:
    """--agent-arms: short names of `AGENT_ARM_NAMES`, exact-prefix caching and mmkv exact among them."""
    from mmkv.bench.run import AGENT_ARM_NAMES, AGENT_ARMS, AGENT_PAIR

    names = [n.strip() for n in value.split(",") if n.strip()]
    if unknown := [n for n in names if n not in AGENT_ARM_NAMES]:
        raise typer.BadParameter(f"unknown {', '.join(unknown)}; expected some of {', '.join(AGENT_ARM_NAMES)}",
                                 param_hint="--agent-arms")
    arms = tuple(AGENT_ARM_NAMES[n] for n in names)
    if any(arm not in arms for arm in AGENT_PAIR):
        raise typer.BadParameter("must include prefix and exact (the per-turn comparison)", param_hint="--agent-arms")
    if set(arms) != set(AGENT_ARMS) and "agent" not in modes:
        raise typer.BadParameter("applies to the agent mode: add agent to --modes", param_hint="--agent-arms")
    return arms


def _check_window_drops(window: int, agent_turns: int, seed: int) -> None:
    """A window as large as the session's screenshots would never drop one."""
    from mmkv.bench.run import agent_script

    attached = sum(t.images() for t in agent_script(agent_turns, seed))
    if window >= attached > 0:
        raise typer.BadParameter(f"the {agent_turns}-turn session (seed {seed}) attaches {attached} screenshots, so a "
                                 f"window of {window} never drops one: use 0 for the whole history, or fewer",
                                 param_hint="--window")


def _ratios(value: str) -> list[float]:
    try:
        ratios = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        ratios = []
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
        raise typer.BadParameter(f"takes comma-separated ratios in [0, 1], got {value!r}", param_hint="--blend")
    return ratios


def _run_blend(engine, images: list[int], skills: list[int], repeats: int, ratios: list[float]) -> list[dict]:
    """The dial's tables (mmkv.bench.blend), one per image and skill size, printed as measured."""
    from dataclasses import asdict

    from mmkv.bench.blend import bench_blend

    tables = []
    for kind, sizes in (("image", images), ("skill", skills)):
        for n in sizes:
            tables.append(asdict(bench_blend(engine, kind, n, repeats, ratios)))
            typer.echo(FORMATS["blend"](tables[-1]))
    return tables


def _video_groups(value: str, group_tokens: int) -> list[int]:
    groups = _ints(value, "--video-groups")
    if any(not 2 <= g <= 384 for g in groups):
        raise typer.BadParameter(f"each must be 2 to 384 groups (4 to 768 frames), got {value!r}",
                                 param_hint="--video-groups")
    if group_tokens < 1 or round(group_tokens ** 0.5) ** 2 != group_tokens:
        raise typer.BadParameter(f"must be a square number of tokens, got {group_tokens}", param_hint="--group-tokens")
    return groups


def bench_command(
    model_dir: Annotated[Path | None, typer.Argument(
        show_default=False, help="Local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint dir (overrides --config).")] = None,
    config: Annotated[str, typer.Option(help=f"Random model to build: {', '.join(CONFIGS)}.")] = "bench",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16. Default: the config's (bench, tiny: "
                                                   "float32; full-size: bfloat16).")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for torch (printed).")] = os.cpu_count() or 1,
    repeats: Annotated[int, typer.Option(help="Timed rounds per table, after one warm-up.")] = 5,
    modes: Annotated[str, typer.Option(help=f"Comma-separated, of: {', '.join(MODES)}.")] = ",".join(DEFAULT_MODES),
    image_tokens: Annotated[str, typer.Option(help="Image sizes, in image tokens (square images).")] = "64,256,1024",
    skill_tokens: Annotated[str, typer.Option(help="Skill sizes, in tokens.")] = "1024,2048,4096",
    policy_tokens: Annotated[int, typer.Option(help="errata: the policy's length in tokens.")] = 2048,
    turns: Annotated[int, typer.Option(help="errata: turns of the agent loop (the first is not counted).")] = 6,
    agent_turns: Annotated[int, typer.Option(help="agent: turns of the seeded session.")] = 8,
    seed: Annotated[int, typer.Option(help="agent: the session's seed.")] = 0,
    window: Annotated[int, typer.Option(help="agent: screenshots the client keeps, the oldest dropped first "
                                              "(0: the whole history).")] = 0,
    drop_chunk: Annotated[int, typer.Option(help="agent: screenshots dropped at a time, 1 to --window (1: one at "
                                                  "a time, as UI-TARS; --window: in chunks, as Anthropic's "
                                                  "computer-use loop).")] = 1,
    blend: Annotated[str, typer.Option("--blend", help="blend mode: the dial's ratios, comma-separated (each "
                                                       "image and skill size, both selectors).")]
    = "0,0.05,0.1,0.2,0.4,1",
    video_groups: Annotated[str, typer.Option(help="video: clip lengths, in temporal groups (two frames "
                                                   "each).")] = "8,32,64",
    group_tokens: Annotated[int, typer.Option(help="video: tokens of one temporal group (a square "
                                                   "number).")] = 16,
    agent_arms: Annotated[str, typer.Option(help="agent: the arms to run, of full, prefix, encoder, exact, composed, "
                                                 "limit (prefix and exact always).")]
    = "full,prefix,encoder,exact,composed,limit",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write every figure to this file.")] = None,
) -> None:
    """Where a turn's time goes: full recompute, prefix caching, encoder cache, mmkv splice, the limit."""
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    if unknown := [m for m in chosen if m not in MODES]:
        raise typer.BadParameter(f"unknown {', '.join(unknown)}; expected some of {', '.join(MODES)}",
                                 param_hint="--modes")
    if threads < 1 or repeats < 1 or turns < 2 or agent_turns < 3:
        raise typer.BadParameter("--threads and --repeats must be >= 1, --turns >= 2, --agent-turns >= 3")
    if config not in CONFIGS:
        raise typer.BadParameter(f"expected one of {', '.join(CONFIGS)}", param_hint="--config")
    _check_window(window, drop_chunk, chosen)
    arms = _agent_arms(agent_arms, chosen)
    images, skills = _ints(image_tokens, "--image-tokens"), _ints(skill_tokens, "--skill-tokens")
    ratios = _ratios(blend)
    videos = _video_groups(video_groups, group_tokens)
    t0 = time.perf_counter()
    # Idle OpenMP threads sleep instead of spinning: on a shared CPU spinning threads slow every
    # multi-threaded op several-fold. Read once, when torch loads its OpenMP runtime (printed).
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    import torch

    from mmkv.bench.run import BenchError, build_engine, run_bench
    from mmkv.errors import MMKVError

    _check_window_drops(window, agent_turns, seed)  # refused before the process's thread count changes
    torch.set_num_threads(threads)
    try:
        engine = build_engine(config, model_dir, device, dtype, max(images, default=256))
        report = run_bench(engine, chosen, repeats, threads, images, skills, policy_tokens, turns,
                           lambda kind, figures: typer.echo(FORMATS[kind](figures)), agent_turns, seed, window,
                           drop_chunk, videos, group_tokens, arms)
        if "blend" in chosen:
            report["blend"] = _run_blend(engine, images, skills, repeats, ratios)
    except (BenchError, MMKVError) as exc:
        typer.echo(f"mmkv bench: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(code=2) from None
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["argv"] = sys.argv[1:]
    if json_out:
        json_out.write_text(json.dumps(report, indent=1))
        typer.echo(f"wrote {json_out}")
    typer.echo(f"(bench ran {report['wall_s']:.0f} s)")
