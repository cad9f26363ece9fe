"""The server's limits and switches, one frozen dataclass; `mmkv serve` fills it from flags (docs/server.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerSettings:
    api_keys: tuple[str, ...] = ()
    max_queue: int = 64  # engine jobs waiting before new ones get 429
    max_batch: int = 8  # generations decoded together (continuous batching); more wait in the queue
    prefill_chunk: int = 512  # prompt tokens per prefill forward between decode steps; 0 = whole prefills
    ride_prefill: bool = True  # a prefill with a few tokens left runs in the decode step's forward
    preempt_prefill: bool = True  # a request arriving mid-forward cuts a prefill forward short at its next layer
    prefill_slice_ms: float = 0.0  # a turn's prefill runs as forwards of about this long, arrivals looked at between; 0 = one
    max_body_bytes: int = 32 << 20  # any request body, uploads and data: URLs included (413 above)
    body_timeout_s: float = 60.0  # a request body must arrive within this, from the first byte (408)
    file_store_bytes: int = 2 << 30  # uploaded image bytes kept, all tenants together (507)
    key_file_bytes: int = 512 << 20  # uploaded bytes one API key may keep (429 file_quota_exceeded)
    key_files: int = 10_000  # uploaded files one API key may keep
    skill_store_bytes: int = 1 << 30  # skill KV bytes, all keys together (507 skill_store_full)
    key_skill_bytes: int = 256 << 20  # skill KV bytes one API key may keep (429 skill_quota_exceeded)
    key_skills: int = 1000  # skills one API key may keep
    max_images_per_request: int = 16
    max_videos_per_request: int = 8  # video parts (inline or by id), counted before any is decoded
    image_threads: int = 2  # threads decoding and resizing images before their job is queued
    max_pending_images: int = 64  # images waiting for those threads before new ones get 429
    allowed_image_url_prefixes: tuple[str, ...] = ()  # e.g. "https://images.example.com/", "file:///srv/img/"
    default_max_tokens: int = 512
    # mmkv.fidelity runs a second forward (in prefill chunks) and delays that request's first token:
    # an operator's diagnostic, off unless asked for; a request that asks while it is off is a 400.
    allow_fidelity: bool = False
    # The online fidelity monitor (mmkv/request/shadow.py): the share of fast-path requests recomputed
    # exactly in idle turns (0: off), the agreement over the last `shadow_window` below which it alerts.
    shadow_rate: float = 0.0
    shadow_alert: float = 0.9
    shadow_window: int = 100
    # The dial's recommendation: shadowed splices also replayed at these blend ratios, and the smallest
    # whose exact one-sided lower bound meets `shadow_target` (None: 0.99 with ratios) reported.
    shadow_blend: tuple[float, ...] = ()
    shadow_target: float | None = None
    # The names a chat request's `model` may carry, as vLLM's --served-model-name: the first is the one
    # responses and /v1/models report. Empty: the engine's own model id. Any other name is a 404.
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self):
        assert self.max_queue >= 1, "max_queue must be at least 1"
        assert self.max_batch >= 1, "max_batch must be at least 1"
        assert self.prefill_chunk >= 0, "prefill_chunk must be >= 0 (0: prefills are not chunked)"
        assert self.prefill_slice_ms >= 0, "prefill_slice_ms must be >= 0 (0: a turn's share is one forward)"
        assert self.max_body_bytes > 0 and self.file_store_bytes > 0, "byte limits must be positive"
        assert self.key_file_bytes > 0 and self.key_files > 0, "per-key quotas must be positive"
        assert min(self.skill_store_bytes, self.key_skill_bytes, self.key_skills) > 0, "skill quotas must be positive"
        assert self.body_timeout_s > 0, "body_timeout_s must be positive"
        assert self.max_images_per_request >= 0, "max_images_per_request must be >= 0"
        assert self.max_videos_per_request >= 0, "max_videos_per_request must be >= 0"
        assert self.image_threads >= 1 and self.max_pending_images >= 1, "image_threads and max_pending_images >= 1"
        assert self.default_max_tokens >= 1, "the default max_tokens must be at least 1"
        assert 0.0 <= self.shadow_rate <= 1.0 and 0.0 <= self.shadow_alert <= 1.0, "shadow rate / alert in [0, 1]"
        assert self.shadow_window >= 1, "shadow_window must be at least 1"
        assert self.shadow_rate > 0 or not (self.shadow_blend or self.shadow_target is not None), \
            "--shadow-blend and --shadow-target need --shadow-rate above 0 (they read the shadowed requests)"
        assert self.shadow_target is None or 0.0 < self.shadow_target < 1.0, "--shadow-target must be in (0, 1)"
        assert self.shadow_target is None or self.shadow_blend, \
            "--shadow-target needs --shadow-blend (the ratios whose agreement it is checked on)"
        assert all(name and name.strip() == name for name in self.served_model_names), \
            "a served model name is non-empty, without surrounding spaces"
        assert len(set(self.served_model_names)) == len(self.served_model_names), "served model names repeat"
