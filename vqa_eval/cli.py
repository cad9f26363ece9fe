"""`mmkv eval`: the VQA agreement evaluation from the command line (registered in mmkv/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def eval_command(
    model_dir: Annotated[Path | None, typer.Argument(
        show_default=False, help="Local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint dir. Default: the bundled model.")] = None,
    set_dir: Annotated[Path | None, typer.Option("--set", help="VQA set dir. Default: samples/vqa.")] = None,
    arms: Annotated[list[str] | None, typer.Option(
        "--arms", help="Arms to run (repeat or comma-separate); `full` always runs. Default: all.")] = None,
    limit: Annotated[int, typer.Option(help="Items, round-robin over question types; 0 = all.")] = 0,
    seed: Annotated[int, typer.Option(help="Seeds the conversations, arm order and bootstrap.")] = 0,
    out: Annotated[Path, typer.Option(help="Where report.json, report.md and agreement.png go.")] = Path("eval-out"),
    max_new_tokens: Annotated[int, typer.Option(help="Greedy answer length cap.")] = 6,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1, ...")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16, float16.")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for torch; 0 = torch's default. Tiny models on a "
                                              "shared CPU run fastest on 1.")] = 0,
    anchor: Annotated[str, typer.Option(help="Precompile chunks after the chat template's default header "
                                             "(system) or alone (none): run both to choose for your model.")] = "system",
) -> None:
    """How often does the fast path answer exactly like a full recompute? Agreement per arm."""
    from mmkv.engine import Engine
    from mmkv.errors import MMKVError
    from mmkv.vqa_eval.run import run_eval

    if threads:
        import torch

        torch.set_num_threads(threads)
    names = [a.strip() for group in (arms or []) for a in group.split(",") if a.strip()]
    try:
        engine = Engine.from_pretrained(model_dir, dtype=dtype, device=device, anchor=anchor)
        report = run_eval(model_dir, set_dir, names or None, limit or None, seed, out, max_new_tokens, engine=engine)
    except (MMKVError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"mmkv eval: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo((out / "report.md").read_text())
    typer.echo(f"wrote {out}/report.json, report.md, agreement.png ({report['wall_s']:.0f}s)")


app = typer.Typer(add_completion=False)
app.command(name="eval")(eval_command)

if __name__ == "__main__":
    app()
