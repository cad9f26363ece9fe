"""`mmkv eval`: the VQA agreement evaluation, its stress grid, the errata task and the episodes task
(registered in mmkv/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

TASKS = ("agreement", "errata", "episodes", "agent-window", "video")


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for group in (values or []) for v in group.split(",") if v.strip()]


def eval_command(
    model_dir: Annotated[Path | None, typer.Argument(
        show_default=False, help="Local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint dir. Default: the bundled model "
                        "(--task video: its video-trained copy, samples/models/qwen2_5_vl-tiny-video).")] = None,
    task: Annotated[str, typer.Option(help="agreement (splice vs full recompute), errata (edit policies) or "
                                           "episodes (multi-token, two-image, text-field and erratum episodes), agent-window "
                                           "(history_policy compose on windowed agent loops; --limit: "
                                           "conversations per kind) or video (synthetic clips: splice, no-rotate and "
                                           "shuffled-frames against full).")]
    = "agreement",
    grid: Annotated[bool, typer.Option("--grid", help="agreement task: the stress grid instead of the main run.")]
    = False,
    set_dir: Annotated[Path | None, typer.Option("--set", help="VQA set dir. Default: samples/vqa.")] = None,
    arms: Annotated[list[str] | None, typer.Option(
        "--arms", help="Arms to run (repeat or comma-separate); the reference always runs. Default: all.")] = None,
    limit: Annotated[int, typer.Option(help="Items, round-robin over question types; 0 = all.")] = 0,
    seed: Annotated[int, typer.Option(help="First conversation seed; also seeds arm order and bootstrap.")] = 0,
    seeds: Annotated[int, typer.Option(help="Conversation seeds per item (seed .. seed+seeds-1). Default 6: "
                                            "360 items x 6 = 2160 paired requests.")] = 6,
    layout: Annotated[str, typer.Option(help="new_chat (later request in a new chat) or continue (it continues "
                                             "the earlier chat).")] = "new_chat",
    decomposition: Annotated[bool, typer.Option(help="Run the block-masked oracles for the error "
                                                     "decomposition.")] = True,
    blend: Annotated[list[str] | None, typer.Option(
        "--blend", help="agreement task (and --grid): one arm per fidelity-dial ratio, e.g. 0,0.05,0.1,0.2,0.4,1 "
                        "(a share of each spliced chunk recomputed in context); then only these and full run, "
                        "unless --arms names more. video task: one more splice arm per ratio.")] = None,
    blend_select: Annotated[list[str] | None, typer.Option(
        "--blend-select", help="How the dial chooses tokens, for every --blend ratio: deviation, stride or "
                               "both (comma-separated). Default: deviation.")] = None,
    k: Annotated[list[str] | None, typer.Option("--k", help="errata: K values for selective@K.")] = None,
    chain: Annotated[int, typer.Option(min=0, max=64, help="errata: also run each conversation as a loop of this "
                                                          "many edits, a new value and one more turn each step "
                                                          "(in_place and selective@K chained on their own KV).")] = 0,
    conditions: Annotated[list[str] | None, typer.Option(
        "--conditions", help="--grid: the conditions to run (repeat or comma-separate). Default: all.")] = None,
    out: Annotated[Path, typer.Option(help="Where report.json, report.md and the plot go.")] = Path("eval-out"),
    max_new_tokens: Annotated[int | None, typer.Option(help="Greedy answer length cap. Default: 6; episodes: each "
                                                              "type's longest answer as the model's tokenizer spells "
                                                              "it (at least 16 for describe, 8 otherwise).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1, ...")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16, float16.")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for torch; 0 = torch's default. Tiny models on a "
                                              "shared CPU run fastest on 1.")] = 0,
    anchor: Annotated[str, typer.Option(help="Precompile chunks after the chat template's default header "
                                             "(system) or alone (none): run both to choose for your model.")] = "system",
    merge: Annotated[list[Path] | None, typer.Option(
        "--merge", help="report.json files of one model over disjoint seeds: pooled into one report in --out, "
                        "no model run.")] = None,
    compare: Annotated[tuple[Path, Path] | None, typer.Option(
        "--compare", help="Two report.json of the same items and seeds (two models), `--compare A B`: exact "
                          "McNemar per arm, no model run.")] = None,
) -> None:
    """How often does the fast path answer exactly like a full recompute? Exact intervals per arm."""
    from mmkv.engine import Engine
    from mmkv.errors import MMKVError

    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        if compare and all(compare):
            from mmkv.vqa_eval.compare import compare_reports

            typer.echo(compare_reports(*compare))
            return
        if merge:
            from mmkv.vqa_eval.run import merge_reports

            report = merge_reports(merge, out)
            typer.echo((out / "report.md").read_text())
            return
        if task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}")
        from mmkv.vqa_eval.run import blend_arms

        dial = blend_arms([float(r) for r in _split(blend)], _split(blend_select) or ["deviation"]) if blend else []
        bad = [s for s in _split(blend_select) if s not in ("deviation", "stride")]
        if bad or (dial and task not in ("agreement", "video")):
            raise ValueError("--blend runs with the agreement and video tasks; --blend-select takes deviation and stride")
        if task == "video" and model_dir is None:
            from mmkv.vqa_eval.video_eval import VIDEO_MODEL

            model_dir = VIDEO_MODEL
        engine = Engine.from_pretrained(model_dir, dtype=dtype, device=device, anchor=anchor)
        common = dict(set_dir=set_dir, limit=limit or None, seed=seed, out=out,
                      max_new_tokens=max_new_tokens or (None if task == "episodes" else 6), engine=engine)
        if task == "agent-window":
            from mmkv.vqa_eval.agent_window import run_agent_window

            report = run_agent_window(model_dir, **common)
        elif task == "video":
            from mmkv.vqa_eval.video_eval import run_video_eval

            if set_dir:
                raise ValueError("--set applies to the VQA set; --task video draws its own clips")
            if _split(blend_select):
                raise ValueError("--blend-select applies to the agreement task; --task video's dial arms use deviation")
            report = run_video_eval(model_dir, limit=limit or None, seeds=seeds, seed=seed, out=out,
                                    max_new_tokens=common["max_new_tokens"], engine=engine,
                                    blend=tuple(float(r) for r in _split(blend or [])))
        elif task == "episodes":
            from mmkv.vqa_eval.episodes_eval import run_episodes

            report = run_episodes(model_dir, **common)
        elif task == "errata":
            from mmkv.vqa_eval.errata import run_errata

            ks = [int(x) for x in _split(k)] or None
            report = run_errata(model_dir, ks=ks, seeds=seeds, chain=chain, **common)
        elif grid:
            from mmkv.vqa_eval.grid import run_grid

            report = run_grid(model_dir, arms=_split(arms) or None, seeds=seeds, extra_arms=dial,
                              conditions=_split(conditions) or None, **common)
        else:
            from mmkv.vqa_eval.run import run_eval

            report = run_eval(model_dir, arms=_split(arms) or None, seeds=seeds, layout=layout,
                              decomposition=decomposition, extra_arms=dial, **common)
    except (MMKVError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"mmkv eval: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo((out / "report.md").read_text())
    typer.echo(f"wrote {out}/report.json, report.md and the plot ({report['wall_s']:.0f}s)")


app = typer.Typer(add_completion=False)
app.command(name="eval")(eval_command)

if __name__ == "__main__":
    app()
