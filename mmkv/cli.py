"""The `mmkv` command. `mmkv serve` runs the OpenAI-compatible HTTP server; every flag also reads
an MMKV_* environment variable (the flag wins). More commands join `app` as subcommands.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import time
from datetime import datetime, timezone
from typing import Annotated

import typer

app = typer.Typer(name="mmkv", help="Multimodal KV-cache reuse for vision-language models.",
                  no_args_is_help=True, add_completion=False)

log = logging.getLogger("mmkv.cli")

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName",
                                                                           "color_message"}  # uvicorn's ANSI copy


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out.update(zip(("client", "method", "path", "http_version", "status"), record.args))
        out.update({k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def logging_config(json_logs: bool, level: str) -> dict:
    """One dictConfig for mmkv's and uvicorn's loggers, so all lines share a format."""
    formatter = ({"()": JsonFormatter} if json_logs
                 else {"format": "%(asctime)s %(levelname)-7s %(name)s: %(message)s"})
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    logger = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"default": handler},
        "loggers": {"mmkv": logger, "uvicorn": logger, "uvicorn.access": logger, "uvicorn.error": {"level": level.upper()}},
    }


@app.callback()
def main() -> None:
    """Multimodal KV-cache reuse for vision-language models."""


@app.command()
def serve(
    model_dir: Annotated[str | None, typer.Argument(
        envvar="MMKV_MODEL_DIR", show_default=False,
        help="Local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint dir, or a hub id (Qwen/Qwen2.5-VL-7B-Instruct) "
             "already in the local Hugging Face cache. Default: the bundled sample model.")] = None,
    host: Annotated[str, typer.Option(envvar="MMKV_HOST", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="MMKV_PORT")] = 8000,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", envvar="MMKV_API_KEY",
        help="Accepted bearer key; repeat for several (env: space-separated). Each key is its own tenant.")] = None,
    seam_tokens: Annotated[int, typer.Option(envvar="MMKV_SEAM_TOKENS",
                                             help="Tokens recomputed after each spliced chunk.")] = 1,
    rope_policy: Annotated[str, typer.Option(envvar="MMKV_ROPE_POLICY",
                                             help="How cached keys move to new positions.")] = "native",
    blend: Annotated[str, typer.Option(envvar="MMKV_BLEND", help=(
        "The fidelity dial's default: the share of each spliced chunk recomputed in context, 0 (plain splice) "
        "to 1, one ratio or per chunk kind (image=0.2,skill=0.05); requests may set their own."))] = "0",
    blend_select: Annotated[str, typer.Option(envvar="MMKV_BLEND_SELECT", help=(
        "How the dial chooses tokens: deviation (a probe over the first layers) or stride."))] = "deviation",
    cache_gb: Annotated[float, typer.Option(envvar="MMKV_CACHE_GB", help="KV cache budget, GiB.")] = 2.0,
    max_pixels: Annotated[int | None, typer.Option(envvar="MMKV_MAX_PIXELS",
                                                   help="Larger images are downscaled to this.")] = None,
    min_pixels: Annotated[int | None, typer.Option(envvar="MMKV_MIN_PIXELS",
                                                   help="Smaller images are upscaled to this.")] = None,
    max_images_per_request: Annotated[int, typer.Option(envvar="MMKV_MAX_IMAGES_PER_REQUEST")] = 16,
    max_videos_per_request: Annotated[int, typer.Option(envvar="MMKV_MAX_VIDEOS_PER_REQUEST", help=(
        "Video parts a chat request may hold (inline or by id); more is a 400 before any is decoded."))] = 8,
    max_video_tokens_per_request: Annotated[int, typer.Option(envvar="MMKV_MAX_VIDEO_TOKENS_PER_REQUEST", help=(
        "Video tokens a chat request's videos may hold together; more is a 400 naming the part that crosses "
        "it, before any video is computed."))] = 32768,
    max_queue: Annotated[int, typer.Option(envvar="MMKV_MAX_QUEUE",
                                           help="Requests waiting for the engine before 429.")] = 64,
    max_batch: Annotated[int, typer.Option(envvar="MMKV_MAX_BATCH", min=1,
                                           help="Generations decoded together (continuous batching).")] = 8,
    prefill_chunk: Annotated[int, typer.Option(envvar="MMKV_PREFILL_CHUNK", min=0,
                                               help="Prompt tokens per prefill forward between decode steps "
                                                    "(chunked prefill); 0 = whole prefills.")] = 512,
    prefill_slice_ms: Annotated[float, typer.Option(envvar="MMKV_PREFILL_SLICE_MS", min=0,
                                                    help="A turn's prefill runs as forwards of about this "
                                                         "long; a request arriving between two is prefilled "
                                                         "next. 0 = one forward a turn.")] = 0.0,
    ride_prefill: Annotated[bool, typer.Option("--ride-prefill/--no-ride-prefill", envvar="MMKV_RIDE_PREFILL",
                                               help="A prefill with at most 64 tokens left runs in the decode "
                                                    "step's forward (weights read once for both).")] = True,
    preempt_prefill: Annotated[bool, typer.Option("--preempt-prefill/--no-preempt-prefill",
                                                  envvar="MMKV_PREEMPT_PREFILL",
                                                  help="A request arriving while a prefill forward runs stops "
                                                       "it at its next layer and is prefilled first; the "
                                                       "piece runs again.")] = True,
    max_body_mb: Annotated[float, typer.Option(envvar="MMKV_MAX_BODY_MB", help="Largest request body (413).")] = 32.0,
    file_store_gb: Annotated[float, typer.Option(envvar="MMKV_FILE_STORE_GB",
                                                 help="Uploaded image bytes kept in memory, all keys (507).")] = 2.0,
    key_file_quota_mb: Annotated[float, typer.Option(envvar="MMKV_KEY_FILE_QUOTA_MB",
                                                     help="Uploaded bytes one API key may keep (429).")] = 512.0,
    key_file_quota_count: Annotated[int, typer.Option(envvar="MMKV_KEY_FILE_QUOTA_COUNT",
                                                      help="Uploaded files one API key may keep (429).")] = 10_000,
    skill_store_gb: Annotated[float, typer.Option(envvar="MMKV_SKILL_STORE_GB",
                                                  help="Skill KV bytes, all keys together (507).")] = 1.0,
    key_skill_quota_mb: Annotated[float, typer.Option(envvar="MMKV_KEY_SKILL_QUOTA_MB",
                                                      help="Skill KV bytes one API key may keep (429).")] = 256.0,
    key_skill_quota_count: Annotated[int, typer.Option(envvar="MMKV_KEY_SKILL_QUOTA_COUNT",
                                                       help="Skills one API key may keep (429).")] = 1000,
    image_threads: Annotated[int, typer.Option(envvar="MMKV_IMAGE_THREADS",
                                               help="Threads decoding images before they reach the engine.")] = 2,
    body_timeout_s: Annotated[float, typer.Option(envvar="MMKV_BODY_TIMEOUT_S",
                                                  help="A request body must arrive within this (408).")] = 60.0,
    header_timeout_s: Annotated[float, typer.Option(envvar="MMKV_HEADER_TIMEOUT_S",
                                                    help="Request headers must arrive within this, else the "
                                                         "connection is closed.")] = 10.0,
    keep_alive_s: Annotated[float, typer.Option(envvar="MMKV_KEEP_ALIVE_S",
                                                help="Idle keep-alive connections are closed after this.")] = 5.0,
    max_connections: Annotated[int, typer.Option(envvar="MMKV_MAX_CONNECTIONS",
                                                 help="Open connections, and running requests, before 503.")] = 512,
    max_header_kb: Annotated[int, typer.Option(envvar="MMKV_MAX_HEADER_KB",
                                               help="Largest request line plus headers (400).")] = 64,
    shutdown_grace_s: Annotated[float, typer.Option(envvar="MMKV_SHUTDOWN_GRACE_S",
                                                    help="On SIGTERM, time running requests still get.")] = 10.0,
    allow_image_url_prefix: Annotated[list[str] | None, typer.Option(
        "--allow-image-url-prefix", envvar="MMKV_ALLOW_IMAGE_URL_PREFIX",
        help="Let image_url parts fetch URLs starting with this (e.g. https://img.example.com/ or "
             "file:///srv/images/). Repeatable. Default: data: URLs only.")] = None,
    served_model_name: Annotated[list[str] | None, typer.Option(
        "--served-model-name", envvar="MMKV_SERVED_MODEL_NAME",
        help="A name chat requests may give as `model` (repeatable; env: space-separated); the first is the one "
             "responses report. Default: the model's id (the hub id or the directory's name). Any other name is "
             "a 404.")] = None,
    max_tokens_default: Annotated[int, typer.Option(envvar="MMKV_MAX_TOKENS_DEFAULT",
                                                    help="max_tokens when a request sets none.")] = 512,
    allow_fidelity: Annotated[bool, typer.Option("--allow-fidelity", envvar="MMKV_ALLOW_FIDELITY",
                                                 help="Let requests ask for mmkv.fidelity (a second, whole "
                                                      "forward that stalls every decode). Default: off, a 400.")] = False,
    shadow_rate: Annotated[float, typer.Option(envvar="MMKV_SHADOW_RATE", min=0.0, max=1.0,
                                               help="Share of fast-path requests (spliced image or skill, "
                                                    "erratum, edit) recomputed exactly in idle capacity and "
                                                    "compared (/v1/mmkv/fidelity, /metrics). 0: off.")] = 0.0,
    shadow_alert: Annotated[float, typer.Option(envvar="MMKV_SHADOW_ALERT", min=0.0, max=1.0,
                                                help="Log and count an alert when a kind's agreement over the "
                                                     "last --shadow-window shadows falls below this.")] = 0.9,
    shadow_window: Annotated[int, typer.Option(envvar="MMKV_SHADOW_WINDOW", min=1,
                                               help="Shadows per kind the alert looks at.")] = 100,
    shadow_blend: Annotated[str, typer.Option(envvar="MMKV_SHADOW_BLEND", help=(
        "Blend ratios to certify on live traffic, e.g. 0,0.1,0.2,0.4: each shadowed splice is also replayed at "
        "every ratio (idle capacity, nothing stored) and /v1/mmkv/fidelity names the smallest whose exact "
        "lower bound meets --shadow-target. Needs --shadow-rate."))] = "",
    shadow_target: Annotated[float | None, typer.Option(envvar="MMKV_SHADOW_TARGET", help=(
        "Agreement with a full recompute a --shadow-blend ratio must certify (one-sided 95% lower bound), "
        "in (0, 1). Default: 0.99."))] = None,
    first_sight_in_context: Annotated[bool, typer.Option(
        "--first-sight-in-context/--first-sight-precompile", envvar="MMKV_FIRST_SIGHT_IN_CONTEXT",
        help="An image whose KV is in no tier: computed in its request's context (as exact-prefix caching "
             "would), its reusable KV built afterwards in idle turns; or precompiled (vision tower, isolated "
             "prefill) before the turn.")] = True,
    background_mb: Annotated[float, typer.Option(envvar="MMKV_BACKGROUND_MB", min=0.0, help=(
        "Pending background builds of first-seen images: their visual features and the KV their builds will "
        "hold; a build beyond it is dropped and counted."))] = 256.0,
    slot_mb: Annotated[float, typer.Option(envvar="MMKV_SLOT_MB", min=0.0, help=(
        "Prompt-length KV buffers kept for reuse on a CPU, in use and free together: a conversation's buffer "
        "from its last turn holds the prefix its next turn hits, in place. 0: none kept."))] = 1024.0,
    cpu_linear: Annotated[str, typer.Option(envvar="MMKV_CPU_LINEAR", help=(
        "On a CPU: onednn (the language model's linear layers on oneDNN with weights prepacked once, "
        "held once; few-row decode steps and short prefills much faster than MKL's) or dense (PyTorch's "
        "nn.Linear). No effect on a GPU."))] = "onednn",
    device: Annotated[str | None, typer.Option(envvar="MMKV_DEVICE",
                                               help="cpu, cuda or cuda:N. Default: cuda when present.")] = None,
    dtype: Annotated[str | None, typer.Option(envvar="MMKV_DTYPE", help="float32, bfloat16 or float16. "
                                              "Default: bfloat16 on CUDA, float32 on CPU.")] = None,
    log_json: Annotated[bool, typer.Option("--log-json", envvar="MMKV_LOG_JSON",
                                           help="Log one JSON object per line.")] = False,
    log_level: Annotated[str, typer.Option(envvar="MMKV_LOG_LEVEL")] = "info",
    store_dir: Annotated[str, typer.Option(envvar="MMKV_STORE_DIR", help=(
        "Disk tier: uploads, skills and chunk KV kept here survive restarts. 'auto': "
        "~/.cache/mmkv/<model fingerprint>; 'none': RAM only."))] = "auto",
    store_gb: Annotated[float, typer.Option(envvar="MMKV_STORE_GB",
                                            help="Chunk KV kept in the disk tier, GiB (LRU beyond).")] = 20.0,
    redis_url: Annotated[str | None, typer.Option(envvar="MMKV_REDIS_URL", help=(
        "Shared tier: redis://[user:password@]host:port/db or rediss:// (TLS). Servers on one Redis share "
        "uploads, skills and chunk KV. Default: none."))] = None,
    mooncake_master: Annotated[str | None, typer.Option(envvar="MMKV_MOONCAKE_MASTER", help=(
        "Shared tier on Mooncake Store instead of Redis: the mooncake_master's HOST:PORT (needs "
        "pip install 'mmkv[mooncake]' and libibverbs1). Default: none."))] = None,
    mooncake_metadata: Annotated[str | None, typer.Option(envvar="MMKV_MOONCAKE_METADATA", help=(
        "Mooncake's metadata server URL. Default: http://<master host>:8080/metadata (the master's "
        "own, with --enable_http_metadata_server=true)."))] = None,
    mooncake_segment_mb: Annotated[int, typer.Option(envvar="MMKV_MOONCAKE_SEGMENT_MB", min=1, help=(
        "RAM this server lends to the Mooncake pool."))] = 1024,
    mooncake_buffer_mb: Annotated[int, typer.Option(envvar="MMKV_MOONCAKE_BUFFER_MB", min=1, help=(
        "Mooncake transfer buffer: the largest chunk shared."))] = 256,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (chat completions, files, models)."""
    from mmkv.engine import Engine
    from mmkv.errors import MMKVError, ModelLoadError
    from mmkv.server.app import ServerSettings, create_app
    from mmkv.server.serve import ConnectionLimits, serve

    config = logging_config(log_json, log_level)
    logging.config.dictConfig(config)
    where = str(model_dir) if model_dir else "the bundled sample model"
    log.info(f"loading {where}", extra={"model_dir": str(model_dir) if model_dir else None})
    t0 = time.perf_counter()
    try:
        from mmkv.request.blend import parse_blend_flag
        from mmkv.request.shadow import parse_shadow_blend

        settings = ServerSettings(  # first: a bad flag fails before the model loads
            api_keys=tuple(api_key or ()), max_queue=max_queue, max_batch=max_batch, max_body_bytes=int(max_body_mb * (1 << 20)),
            prefill_chunk=prefill_chunk, prefill_slice_ms=prefill_slice_ms, ride_prefill=ride_prefill,
            preempt_prefill=preempt_prefill,
            file_store_bytes=int(file_store_gb * (1 << 30)), max_images_per_request=max_images_per_request,
            max_videos_per_request=max_videos_per_request,
            key_file_bytes=int(key_file_quota_mb * (1 << 20)), key_files=key_file_quota_count,
            skill_store_bytes=int(skill_store_gb * (1 << 30)), key_skill_bytes=int(key_skill_quota_mb * (1 << 20)),
            key_skills=key_skill_quota_count,
            image_threads=image_threads, body_timeout_s=body_timeout_s,
            allowed_image_url_prefixes=tuple(allow_image_url_prefix or ()), default_max_tokens=max_tokens_default,
            served_model_names=tuple(served_model_name or ()), allow_fidelity=allow_fidelity,
            shadow_rate=shadow_rate, shadow_alert=shadow_alert, shadow_window=shadow_window,
            shadow_blend=parse_shadow_blend(shadow_blend), shadow_target=shadow_target)
        engine = Engine.from_pretrained(model_dir, dtype=dtype, device=device, seam_tokens=seam_tokens,
                                        blend=parse_blend_flag(blend), blend_select=blend_select,
                                        rope_policy=rope_policy, cache_bytes=int(cache_gb * (1 << 30)),
                                        min_pixels=min_pixels, max_pixels=max_pixels,
                                        store_dir=None if store_dir == "none" else store_dir,
                                        store_bytes=int(store_gb * (1 << 30)), redis_url=redis_url,
                                        mooncake_master=mooncake_master, mooncake_metadata=mooncake_metadata,
                                        store_options={"mooncake_segment_bytes": mooncake_segment_mb << 20,
                                                       "mooncake_buffer_bytes": mooncake_buffer_mb << 20},
                                        first_sight_in_context=first_sight_in_context,
                                        background_bytes=int(background_mb * (1 << 20)),
                                        slot_bytes=int(slot_mb * (1 << 20)),
                                        max_video_tokens_per_request=max_video_tokens_per_request,
                                        cpu_linear=cpu_linear)
        limits = ConnectionLimits(max_connections=max_connections, header_timeout_s=header_timeout_s,
                                  keep_alive_s=keep_alive_s, max_header_bytes=max_header_kb << 10,
                                  grace_s=shutdown_grace_s)
        app = create_app(engine, settings)  # with a shared tier: its tenant secret, or a refusal to start
    except (MMKVError, AssertionError, ValueError) as exc:
        missing = isinstance(exc, ModelLoadError) and model_dir is not None and not os.path.isdir(model_dir)
        hint = ("\nmmkv serve: pass MODEL_DIR as a local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint directory "
                "(config.json, weights, tokenizer) or a hub id in the local cache, or leave it out to serve the "
                "bundled sample model" if missing else "")
        typer.echo(f"mmkv serve: {getattr(exc, 'message', None) or exc}{hint}", err=True)
        raise typer.Exit(code=2) from None
    log.info(f"loaded {engine.model_id} in {time.perf_counter() - t0:.1f}s (linear layers: {engine.cpu_linear})",
             extra={"model": engine.model_id, "load_s": round(time.perf_counter() - t0, 3),
                    "cpu_linear": engine.cpu_linear})
    if engine.tiers is not None:  # the shared URL is logged without its credentials
        tiers = engine.tiers
        log.info(f"tiers: disk {tiers.root or 'off'}, shared {tiers.shared.url if tiers.shared else 'off'}",
                 extra={"store_dir": str(tiers.root) if tiers.root else None,
                        "shared": tiers.shared.url if tiers.shared else None})
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(f"listening on {host} with no --api-key: anyone who can reach it can use it")
    log.info(f"OpenAI base URL: http://{host}:{port}/v1")
    try:
        serve(app, host, port, limits, log_config=config, log_level=log_level.lower())
    finally:
        engine.close()  # queued tier writes land, the store directory is released


@app.command()
def selftest(
    model_dir: Annotated[str | None, typer.Argument(
        envvar="MMKV_MODEL_DIR", show_default=False,
        help="A checkpoint dir or hub id in the local cache, as `mmkv serve` takes it. Default: the bundled "
             "sample model.")] = None,
    device: Annotated[str | None, typer.Option(envvar="MMKV_DEVICE",
                                               help="cpu, cuda or cuda:N. Default: cuda when present.")] = None,
    dtype: Annotated[str | None, typer.Option(envvar="MMKV_DTYPE", help="float32, bfloat16 or float16. "
                                              "Default: bfloat16 on CUDA, float32 on CPU.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Check that cached KV computes what the model computes, on this device and dtype: the splice
    against its oracle, re-rotated keys, batched decoding, an image and a skill round trip. Exit
    code 1 when a check fails, 2 when the model does not load."""
    from mmkv.errors import MMKVError
    from mmkv.selftest import format_report, run_selftest

    try:
        report = run_selftest(model_dir, device=device, dtype=dtype)
    except MMKVError as exc:
        typer.echo(f"mmkv selftest: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(json.dumps(report.as_json(), indent=2) if json_out else format_report(report))
    raise typer.Exit(code=0 if report.passed else 1)


from mmkv.vqa_eval.cli import eval_command  # noqa: E402  (its heavy imports happen inside)

app.command(name="eval")(eval_command)

from mmkv.bench.command import bench_command  # noqa: E402  (its heavy imports happen inside)

app.command(name="bench")(bench_command)

from mmkv.bench.tiers import bench_tiers_command  # noqa: E402  (its heavy imports happen inside)

app.command(name="bench-tiers")(bench_tiers_command)

from mmkv.bench.concurrency import bench_concurrency_command  # noqa: E402  (its heavy imports happen inside)

app.command(name="bench-concurrency")(bench_concurrency_command)

from mmkv.bench.serve import bench_serve_command  # noqa: E402  (its heavy imports happen inside)

app.command(name="bench-serve")(bench_serve_command)
from mmkv.bench.peers import bench_peers_command  # noqa: E402  (its heavy imports happen inside)

app.command(name="bench-peers")(bench_peers_command)

if __name__ == "__main__":
    app()
