"""Videos: registration, lookup and purge per tenant, and the KV of each temporal group.

A video is cached as one chunk per temporal group (two sampled frames): on Qwen2/2.5-VL the
group's pads, on Qwen3-VL its timestamp text `<t seconds>`, vision_start, pads and vision_end, as
its processor renders each frame. Each group is prefilled once in isolation after the anchor at
canonical positions (its first pad at the anchor's end, temporal index 0) and spliced wherever a
prompt holds it, rotated per axis to the native positions there (mmkv.adapters.mrope_positions).
Groups are keyed by their own content hash, so the same group in another request, another place
or another video of the same frames runs the vision tower 0 times.

Durable tiers (mmkv/store/tiers.py), as for images: a group's KV is written through to the disk
tier under a SHA-256 durable key of its frames, times and the video grid settings, and to the
shared tier when its video is an upload (an inline video's groups stay on this server). An
upload's record (its sampled frames, zlib-compressed, and what places them) is kept in the
durable registry, so a restarted server, or another on the same shared tier, serves the same
video id and loads its groups' KV instead of running the vision tower. A delete purges the
record and every group's KV from every tier. Live streams are RAM only: their groups never reach
a tier (mmkv.request.streams).

Thread-safety: `prepare` is lock-free (decoding, on the server's image threads); every other
method runs under the engine's lock.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import torch

from mmkv.adapters import ImageFeatures, VisualGrid
from mmkv.errors import (
    InvalidVideoError,
    MMKVError,
    UnknownVideoError,
    VideoStoreFullError,
    VideoTooLargeError,
)
from mmkv.kv.chunks import CachedChunk, chunk_cache_key
from mmkv.request.streams import PreparedFrames, StreamInfo, StreamSettings, VideoStream, new_stream_id, reserve
from mmkv.store.fingerprint import content_digest
from mmkv.video import FRAME_FACTOR, DecodedVideo, PixelBudget, VideoLimits, VideoSampling, decode_video, with_hashes

log = logging.getLogger("mmkv.engine")


@dataclass(frozen=True)
class VideoInfo:
    video_id: str
    width: int  # of a source frame
    height: int
    frames: int  # sampled
    groups: int  # temporal groups: the chunks it is cached as
    video_tokens: int  # pads the LM sees for it
    duration_s: float
    sample_fps: float
    nbytes: int  # bytes of the upload (0 for frames)


@dataclass
class RegisteredVideo:
    """A registered video: its sampled, resized frames (counted in the video store) and hashes."""

    video: DecodedVideo
    uploaded: bool  # added by add_video (kept until removed); else inline, released when its request ends
    stream: bool = False  # a live stream's window: its groups' KV stays in RAM, never in a tier

    @property
    def nbytes(self) -> int:
        return self.video.frames.numel()


@dataclass(frozen=True)
class VideoGroupRef:
    """Temporal group `index` of a registered video, at one place of a prompt."""

    video: RegisteredVideo
    index: int


MAX_STREAMS_PER_TENANT = 64


def video_id_for(content_hash: str) -> str:
    return f"vid-{content_hash}"


class VideoRegistry:
    """Uploaded and inline videos per tenant and their groups' KV (through `cached_chunk`: the
    RAM store, else a precompile). `store_bytes` counts the frames of every uploaded video against
    `store_budget`."""

    def __init__(self, registries, limits: VideoLimits, store_budget: int):
        """`registries`: the engine's Registries, whose chunk lookup (`_cached_chunk`) and counters
        (vision tower runs, precompiled tokens, fresh keys) video groups share with images."""
        r = self.registries = registries
        self.adapter, self.cache, self.fingerprint, self.anchor = r.adapter, r.cache, r.fingerprint, r.settings.anchor
        self.anchor_ids, self.max_context, self.limits, self.store_budget = r.anchor_ids, r.max_context, limits, \
            store_budget
        vp = self.adapter.processor.video_processor
        factor = vp.patch_size * vp.merge_size
        self.budget = PixelBudget(factor, vp.size["shortest_edge"], vp.size["longest_edge"],
                                  min(limits.max_tokens, int(0.9 * self.max_context)) * factor ** 2)
        grid_settings = r.grid_settings
        self.grid_settings = f"{grid_settings}|video={self.budget}"
        self.timestamps = self.adapter.family.startswith("qwen3")  # Qwen3-VL: a timestamp before each frame
        self.videos: dict[tuple[str, str], RegisteredVideo] = {}
        self.streams: dict[tuple[str, str], VideoStream] = {}  # live streams (mmkv.request.streams)
        self.store_bytes = 0

    # ---- input -----------------------------------------------------------------------------------
    def prepare(self, data, sampling: VideoSampling = VideoSampling()) -> DecodedVideo:
        """Decode, sample, resize and hash (lock-free, changes nothing); refused when its tokens
        alone leave no room in the context."""
        if isinstance(data, DecodedVideo):
            return data
        video = decode_video(data, self.budget, sampling, self.limits)
        span = sum(self.group_tokens(video, g)[0].numel() for g in range(video.num_groups)) + 2
        if self.anchor_ids.numel() + span >= self.max_context:
            raise VideoTooLargeError(f"the video's {span} tokens leave no room in the context of {self.max_context} "
                                     f"tokens; lower fps, nframes or max_pixels", param="video")
        return video

    def group_tokens(self, video: DecodedVideo, g: int) -> tuple[torch.Tensor, int]:
        """Token ids of group g's chunk and the index of its first pad."""
        _, _, h, w = video.frames.shape
        pads = [self.adapter.video_token_id] * ((h // self.budget.factor) * (w // self.budget.factor))
        if not self.timestamps:
            return torch.tensor(pads), 0
        stamp = self.adapter.tokenizer(f"<{video.group_time(g):.1f} seconds>")["input_ids"]
        ids = stamp + [self.adapter.vision_start_id] + pads + [self.adapter.vision_end_id]
        return torch.tensor(ids), len(stamp) + 1

    def group_grid(self, video: DecodedVideo) -> tuple[int, int, int]:
        _, _, h, w = video.frames.shape
        patch = self.budget.factor // self.adapter.merge_size
        return 1, h // patch, w // patch

    def visual_grids(self, refs: list[VideoGroupRef]) -> list[VisualGrid]:
        """The visual runs of one video's consecutive groups: one per group on Qwen3-VL (frames
        apart), else one for them all (Qwen2/2.5-VL: one block, groups spaced in time)."""
        video = refs[0].video.video
        _, h, w = self.group_grid(video)
        if self.timestamps:
            return [self.adapter.video_grid((1, h, w), video.sample_fps) for _ in refs]
        return [self.adapter.video_grid((len(refs), h, w), video.sample_fps)]

    # ---- registry --------------------------------------------------------------------------------
    def register(self, video: DecodedVideo, tenant: str, uploaded: bool) -> tuple[str, RegisteredVideo]:
        video_id = video_id_for(video.content_hash)
        reg = self.videos.get((tenant, video_id))
        if reg is None:
            reg = RegisteredVideo(video, uploaded)
            if uploaded and self.store_bytes + reg.nbytes > self.store_budget:
                raise VideoStoreFullError(f"the video store holds {self.store_bytes} of {self.store_budget} bytes; "
                                          f"this video needs {reg.nbytes}: delete videos first", param="video")
            self.videos[(tenant, video_id)] = reg
            self.store_bytes += reg.nbytes if uploaded else 0
        elif uploaded and not reg.uploaded:
            if self.store_bytes + reg.nbytes > self.store_budget:
                raise VideoStoreFullError(f"the video store holds {self.store_bytes} of {self.store_budget} bytes; "
                                          f"this video needs {reg.nbytes}: delete videos first", param="video")
            reg.uploaded = True
            self.store_bytes += reg.nbytes
        return video_id, reg

    def add(self, video: DecodedVideo, tenant: str) -> str:
        """Register an upload, precompile every group (those cached already are reused, and written
        through to the shared tier now if an inline use computed them) and record it durably."""
        earlier = self.videos.get((tenant, video_id_for(video.content_hash)))
        was_upload = earlier is not None and earlier.uploaded
        video_id, reg = self.register(video, tenant, uploaded=True)
        try:
            for g in range(video.num_groups):
                self.group_chunk(VideoGroupRef(reg, g), tenant, publish=True)
            self._persist(video_id, reg, tenant)
        except BaseException:
            if not was_upload:  # undo this registration, never an earlier upload
                self.purge(video_id, reg, tenant, everywhere=False)
            raise
        return video_id

    def lookup(self, video_id: str, tenant: str, param: str | None = None) -> RegisteredVideo:
        """An uploaded or inline video (an upload another server or an earlier run recorded is
        adopted from the durable tiers), or a live stream's window now (refused before its first
        group completes)."""
        if (tenant, video_id) in self.streams:
            return self._stream_window(self.streams[(tenant, video_id)], param)
        return self.registries._lookup("video", video_id, tenant, param)

    def info(self, video_id: str, tenant: str) -> VideoInfo:
        v = self.lookup(video_id, tenant).video
        _, h, w = self.group_grid(v)
        pads = v.num_groups * h * w // self.adapter.merge_size ** 2
        return VideoInfo(video_id, v.width, v.height, v.frames.shape[0], v.num_groups, pads, v.duration_s,
                         v.sample_fps, v.source_bytes)

    def remove(self, video_id: str, tenant: str) -> None:
        """Forget the video (or stream) and purge every group's KV (and the prefix blocks holding
        it), in every tier, unless another video or stream this tenant holds has the same group."""
        if (stream := self.streams.pop((tenant, video_id), None)) is not None:
            self.store_bytes -= stream.reserved
            self._purge_groups(stream.hashes, tenant)
            return
        self.purge(video_id, self.lookup(video_id, tenant), tenant, everywhere=True)

    def purge(self, video_id: str, reg: RegisteredVideo, tenant: str, everywhere: bool) -> None:
        """Forget a video: its record and its groups' KV in the lower tiers first (`everywhere`: a
        delete, the shared tier included, which may refuse and leave everything here; else this
        server's only: deleted on another server), then here."""
        video = reg.video
        unheld = self._unheld(video.group_hashes, tenant, besides=(tenant, video_id))
        durables = [self.group_durable_key(video, g, tenant) for g, h in enumerate(video.group_hashes) if h in unheld]
        self.registries._forget_durable("video", video_id, list(dict.fromkeys(durables)), tenant, everywhere)
        del self.videos[(tenant, video_id)]
        self.store_bytes -= reg.nbytes if reg.uploaded else 0
        for h in unheld:
            self.cache.purge(self._key(h, tenant))

    def _purge_groups(self, hashes, tenant: str) -> None:
        for h in self._unheld(hashes, tenant):
            self.cache.purge(self._key(h, tenant))

    def _unheld(self, hashes, tenant: str, besides: tuple[str, str] | None = None) -> set[str]:
        """Those of `hashes` no video (but `besides`) or stream of this tenant holds."""
        held = {h for key, r in self.videos.items() if key[0] == tenant and key != besides
                for h in r.video.group_hashes}
        held |= {h for (t, _), s in self.streams.items() if t == tenant for h in s.hashes}
        return set(hashes) - held

    # ---- live streams (mmkv.request.streams) -------------------------------------------------------------
    def create_stream(self, tenant: str, settings: StreamSettings) -> str:
        if sum(t == tenant for t, _ in self.streams) >= MAX_STREAMS_PER_TENANT:
            raise VideoStoreFullError(f"this key holds {MAX_STREAMS_PER_TENANT} video streams, the most it may: "
                                      f"delete one first", param="stream")
        video_id = new_stream_id()
        self.streams[(tenant, video_id)] = VideoStream(video_id, settings, self.budget, self.limits)
        return video_id

    def stream(self, video_id: str, tenant: str, param: str | None = None) -> VideoStream:
        stream = self.streams.get((tenant, video_id))
        if stream is None:
            raise UnknownVideoError(f"no video stream with id {video_id!r}", param=param)
        return stream

    def append(self, video_id: str, tenant: str, prepared: PreparedFrames) -> StreamInfo:
        """Sample prepared frames into the stream (all or nothing), the window's first append
        reserving its bytes; the groups it drops are purged."""
        stream = self.stream(video_id, tenant, "stream")
        stream.check_append(prepared)
        need = reserve(stream, prepared, self.store_bytes, self.store_budget)
        stream.reserved += need
        self.store_bytes += need
        _, dropped = stream.append(prepared)
        self._purge_groups(dropped, tenant)
        return stream.info()

    def _stream_window(self, stream: VideoStream, param: str | None) -> RegisteredVideo:
        video = stream.snapshot()
        if video is None:
            raise InvalidVideoError(f"the video stream {stream.video_id!r} holds no complete temporal group yet "
                                    f"(two frames on its clock)", param=param)
        if stream.registered is None or stream.registered.video is not video:
            stream.registered = RegisteredVideo(video, uploaded=True, stream=True)
        return stream.registered

    def release(self, key: tuple[str, str]) -> None:
        """An inline video's request ended: forget it (its KV stays in the LRU) unless uploaded since."""
        reg = self.videos.get(key)
        if reg is not None and not reg.uploaded:
            del self.videos[key]

    # ---- KV ----------------------------------------------------------------------------------------
    def group_key(self, video: DecodedVideo, g: int, tenant: str) -> str:
        return self._key(video.group_hashes[g], tenant)

    def _key(self, group_hash: str, tenant: str) -> str:
        return chunk_cache_key("video", group_hash, self.fingerprint, self.grid_settings, self.anchor, tenant)

    def group_chunk(self, ref: VideoGroupRef, tenant: str, publish: bool = False) -> CachedChunk:
        """Group `ref.index`'s cached KV: RAM, else the disk and shared tiers (not for a stream's
        group), else the vision tower on its two frames and the LM prefill of its chunk in
        isolation, written through to the disk and, for an upload, the shared tier."""
        reg, key = ref.video, self.group_key(ref.video.video, ref.index, tenant)
        durable = None if reg.stream else (lambda: self.group_durable_key(reg.video, ref.index, tenant))
        return self.registries._cached_chunk(key, "video", lambda: self.precompile(ref, key), durable=durable,
                                             shared=reg.uploaded, publish=publish)

    def group_durable_key(self, video: DecodedVideo, g: int, tenant: str) -> str:
        """The group's key in the disk and shared tiers: SHA-256 of its frames' size, times and pixels
        (its xxh3 hash keys only RAM), with the video grid settings (Registries.durable_key)."""
        frames = video.frames[FRAME_FACTOR * g:FRAME_FACTOR * (g + 1)].contiguous()
        times = video.timestamps[FRAME_FACTOR * g:FRAME_FACTOR * (g + 1)]
        head = f"{tuple(frames.shape)}|{tuple(times)!r}|".encode()
        return self.registries.durable_key("video", content_digest(head + frames.numpy().tobytes()), tenant)

    # ---- durable records (mmkv/store/durable_registry.py) ----------------------------------------------
    def _persist(self, video_id: str, reg: RegisteredVideo, tenant: str) -> None:
        """The upload's record: its sampled frames (what its hashes and positions come from),
        compressed without loss, and the fields that place them."""
        tiers = self.registries.tiers
        if tiers is None:
            return
        v = reg.video
        meta = {"shape": list(v.frames.shape), "timestamps": list(v.timestamps), "sample_fps": v.sample_fps,
                "width": v.width, "height": v.height, "duration_s": v.duration_s, "source_bytes": v.source_bytes}
        tiers.registry.put("video", tenant, video_id, meta, zlib.compress(v.frames.contiguous().numpy().tobytes(), 1))

    def adopt(self, rec, param: str | None = None) -> RegisteredVideo | None:
        """A recorded upload registered again, counted in the video store at its frames' bytes;
        VideoStoreFullError when the store has no room (the upload exists: not an unknown video);
        None (a warning) for a record whose frames no longer hash to its id."""
        m = rec.meta
        need = torch.Size(m["shape"]).numel()
        if self.store_bytes + need > self.store_budget:
            raise VideoStoreFullError(f"the video store holds {self.store_bytes} of {self.store_budget} bytes; the "
                                      f"stored upload {rec.id} needs {need} more: delete videos first", param=param)
        inflate = zlib.decompressobj()
        raw = inflate.decompress(rec.blob, need)
        if len(raw) != need or not inflate.eof:
            log.warning("stored video %s does not hold the frames its record names; not restored", rec.id)
            return None
        frames = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(m["shape"])
        video = with_hashes(DecodedVideo(frames, tuple(m["timestamps"]), m["sample_fps"], m["width"], m["height"],
                                         m["duration_s"], m["source_bytes"]))
        if video_id_for(video.content_hash) != rec.id:
            log.warning("stored video %s hashes to another id; not restored", rec.id)
            return None
        reg = self.videos[(rec.tenant, rec.id)] = RegisteredVideo(video, uploaded=True)
        self.store_bytes += reg.nbytes
        return reg

    def encode(self, ref: VideoGroupRef) -> ImageFeatures:
        """The vision tower on one group (its attention never crosses groups, so this equals the
        group's rows of the whole video's encoding)."""
        frames = ref.video.video.frames[FRAME_FACTOR * ref.index:FRAME_FACTOR * (ref.index + 1)]
        pixel_values, grid = self.adapter.preprocess_video(frames)
        self.registries.vision_tower_runs += 1
        return self.adapter.encode_image(pixel_values, grid)

    def precompile(self, ref: VideoGroupRef, key: str) -> CachedChunk:
        video = ref.video.video
        token_ids, pad_offset = self.group_tokens(video, ref.index)
        features = self.encode(ref)
        grid = self.group_grid(video)
        ids = torch.cat((self.anchor_ids, token_ids))
        positions = self.adapter.positions(ids, [VisualGrid(self.adapter.video_token_id, grid)])
        cache = self.adapter.new_cache()
        self.adapter.forward(ids, positions, cache, features)
        a = self.anchor_ids.numel()
        layers = cache.layers[: self.adapter.num_layers]
        return CachedChunk(key=key, kind="video", token_ids=token_ids, position_ids=positions[:, a:].clone(),
                           keys=tuple(layer.keys[0, :, a:].clone() for layer in layers),
                           values=tuple(layer.values[0, :, a:].clone() for layer in layers),
                           features=features, grid_thw=grid, pad_offset=pad_offset)

    # ---- introspection -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        kept = sum(r.nbytes for r in self.videos.values() if r.uploaded)
        kept += sum(s.reserved for s in self.streams.values())
        assert kept == self.store_bytes, f"video store tracks {self.store_bytes}, holds {kept}"
        for s in self.streams.values():
            assert s.nbytes <= s.reserved, f"stream {s.video_id} holds {s.nbytes} bytes, reserved {s.reserved}"


def prepare_error(exc: MMKVError, param: str) -> MMKVError:
    """`exc` reworded to name the message part it came from."""
    return type(exc)(f"{param}: {exc.message}", param=param)
