"""`mmkv selftest`: does this install, on this machine, device and dtype, compute with cached KV what
the model computes? Five checks on the user's own checkpoint, each a measured error against the
dtype's tolerance and a PASS / FAIL:

- splice: a turn spliced from cached image and skill KV (seam 0 and 1) against the block-masked
  oracle (mmkv.request.oracle), one masked forward of the model over the same prompt;
- rotation: an image's cached keys re-rotated to new positions against the keys the model computes
  at those positions (every layer in float32; the first layer in the half types, whose deeper keys
  also carry the model's own rounding, which expert routing can amplify: a token sent to another
  expert. The splice check covers the deeper layers end to end);
- batched: rows decoded together in one left-padded batch (the scheduler's `DecodeBatch`) against
  each prompt decoded alone, the same tokens fed to both;
- image and skill round trips: registered once, asked twice; every ask splices the cached KV (no
  vision tower run), the second also reads the prompt's prefix from the cache, and both first
  next-token logits stay within the tolerance of the oracle.

Errors are relative: max |got - want| / max(1, max |want|) over the logits (keys for the rotation),
so one tolerance holds for a tiny model and a 30B one. Tolerances (`TOLERANCES`) come from what the
tests measure: float32 is exact up to summation order (measured below 1e-6, 2e-5 for keys moved by
1000 positions; the tests' bound 1e-4, and 4 * position * 2^-24 for the keys); the half types round
the KV once more on the cached path than on the direct one (measured up to 1.6e-2 in bfloat16 and
1.8e-3 in float16 on the bundled and real-shape checkpoints of every family, on CPU; bounds about 3x
that). A check that raises fails with the exception as its detail; the others still run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from PIL import Image, ImageDraw

from mmkv.engine import Engine
from mmkv.kv.rerotate import reposition_keys
from mmkv.request.oracle import block_masked_logits
from mmkv.request.scheduler import DecodeBatch
from mmkv.request.splice import prefill_spliced

# Relative to the logit (key) scale; see the module docstring for where each comes from.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 6e-3}
# The model's own rope angles are float32 position * inv_freq: ~position * 2^-24 rad of rounding,
# so keys moved far compare to 4 * position * 2^-24 in float32 (tests/test_rerotate.py's bound).
ANGLE_ROUNDING = 4 * 2**-24
ROTATION_DELTAS = (37, 1000)
DECODE_STEPS = 4
SKILL_TEXT = ("You answer questions about pictures. Name the shapes you see and their colours, count "
              "them when asked, and answer in one short sentence. When unsure, say so.")


@dataclass(frozen=True)
class Measure:
    """What one check measured: its error, the bound it must stay within, what it ran, and whether
    the rest of what it requires held (a round trip must reuse the cache)."""

    error: float
    tolerance: float
    detail: str
    ok: bool = True


@dataclass
class Check:
    name: str
    title: str
    error: float | None  # None: the check raised before it measured
    tolerance: float
    passed: bool
    detail: str


@dataclass
class Report:
    model: str
    family: str
    device: str
    dtype: str
    load_s: float
    total_s: float
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|), in float32 on the CPU."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A small drawing (a rectangle and a circle on grey) that differs by `seed`."""
    img = Image.new("RGB", (width, height), (120 + 17 * seed % 60, 128, 136))
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 8, height // 8, width // 2, height // 2], fill=(200, 40 * seed % 255, 30))
    draw.ellipse([width // 2, height // 2, width - 8, height - 8], fill=(20, 90, 220 - 30 * seed % 200))
    return img


class SelfTest:
    """The five checks on one engine; `run` returns the report."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.adapter = engine.adapter
        self.tolerance = TOLERANCES[self.adapter.dtype]

    def run(self) -> list[Check]:
        checks = [
            ("splice", "splice vs block-masked oracle", self.splice),
            ("rotation", "re-rotated keys vs keys at target", self.rotation),
            ("batched", "batched vs single decoding", self.batched),
            ("image", "image round trip through the cache", self.image_round_trip),
            ("skill", "skill round trip through the cache", self.skill_round_trip),
        ]
        return [self._measure(name, title, fn) for name, title, fn in checks]

    def _measure(self, name: str, title: str, fn: Callable[[], Measure]) -> Check:
        try:
            m = fn()
        except Exception as exc:  # noqa: BLE001  a check that raises fails; the others still run
            return Check(name, title, None, self.tolerance, False, f"raised {type(exc).__name__}: {exc}")
        return Check(name, title, m.error, m.tolerance, m.ok and m.error <= m.tolerance, m.detail)

    # ---- the checks -------------------------------------------------------------------------
    def splice(self) -> Measure:
        engine = self.engine
        skill = engine.add_skill("selftest-splice", SKILL_TEXT)
        msgs = [{"role": "system", "content": [{"type": "skill", "skill_id": skill}]},
                {"role": "user", "content": [{"type": "text", "text": "Look at this one"}, picture(280, 200, 1),
                                             {"type": "text", "text": "and this one"}, picture(200, 252, 2),
                                             {"type": "text", "text": "Which shapes are in both?"}]}]
        plan = engine.splice_plan(msgs)

        def spliced(seam: int, rotate: bool = True) -> torch.Tensor:
            return prefill_spliced(self.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                   rotate=rotate).logits

        oracles = [block_masked_logits(self.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                       engine.anchor_ids) for seam in (0, 1)]
        worst = max(relative_error(spliced(seam), oracle) for seam, oracle in enumerate(oracles))
        control = relative_error(spliced(0, rotate=False), oracles[0])  # how far a wrong rotation lands
        return Measure(worst, self.tolerance, f"seams 0 and 1; 2 images + 1 skill, {plan.input_ids.numel()} "
                                              f"tokens; unrotated control {control:.1e}")

    def rotation(self) -> Measure:
        ad = self.adapter
        pixels, grid = ad.preprocess_image(picture(224, 168, 3))
        features = ad.encode_image(pixels, grid)
        exact = ad.dtype == torch.float32
        layers = ad.num_layers if exact else 1  # see the module docstring
        source_pos, source = self._image_keys(grid, features, 10)
        worst, top = 0.0, 0
        for delta in ROTATION_DELTAS:
            target_pos, target = self._image_keys(grid, features, 10 + delta)
            for k, direct in zip(source[:layers], target[:layers]):
                worst = max(worst, relative_error(reposition_keys(k, source_pos, target_pos, ad.rope), direct))
            top = max(top, int(target_pos.max()))
        # float32 keys: exact but for the model's own angle rounding; half types: the dtype's bound
        tolerance = max(1e-5, ANGLE_ROUNDING * top) if exact else self.tolerance
        detail = (f"an image's {source_pos.shape[1]} tokens moved by {' and '.join(map(str, ROTATION_DELTAS))}; "
                  f"{'every layer' if exact else 'the first layer'} of {ad.num_layers}")
        return Measure(worst, tolerance, detail)

    def batched(self) -> Measure:
        engine = self.engine
        image = engine.add_image(picture(168, 140, 4))
        prompts = [
            [{"role": "user", "content": "Say something about a red square."}],
            [{"role": "system", "content": "Be brief. " * 12}, {"role": "user", "content": "Count to three."}],
            [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": image}},
                                          {"type": "text", "text": "What is in the picture?"}]}],
        ]
        alone = [self._decode_alone(m) for m in prompts]
        runs = [engine.start(m, max_new_tokens=DECODE_STEPS + 1) for m in prompts]
        batch = DecodeBatch(self.adapter)
        for run in runs:
            run.prefill()
            batch.add(run.cache)
        worst = 0.0
        for step in range(DECODE_STEPS):
            fed = [tokens[step] for tokens, _ in alone]
            logits = batch.step(fed, [run.stream.first_position + step for run in runs])
            worst = max(worst, *(relative_error(row, want[step]) for row, (_, want) in zip(logits, alone)))
        return Measure(worst, self.tolerance, f"{len(prompts)} rows (left padding {sorted(batch.pad)}), "
                                              f"{DECODE_STEPS} steps, the same tokens fed")

    def image_round_trip(self) -> Measure:
        image = self.engine.add_image(picture(252, 196, 5))
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Here is a picture:"},  # moves it: rotated
                                             {"type": "image_file", "image_file": {"file_id": image}},
                                             {"type": "text", "text": "What colour is the circle?"}]}]
        return self._round_trip(msgs, "image_tokens_reused")

    def skill_round_trip(self) -> Measure:
        skill = self.engine.add_skill("selftest-round-trip", SKILL_TEXT + " Start with the largest shape.")
        msgs = [{"role": "system", "content": [{"type": "skill", "skill_id": skill}]},
                {"role": "user", "content": "How many shapes are there?"}]
        return self._round_trip(msgs, "skill_tokens_reused")

    # ---- helpers -------------------------------------------------------------------------------
    def _round_trip(self, msgs: list, reused_field: str) -> Measure:
        """Ask twice: each ask splices the cached chunk, the second also reads the prefix cache;
        both first logits against the oracle."""
        engine = self.engine
        plan = engine.splice_plan(msgs)
        oracle = block_masked_logits(self.adapter, plan.input_ids, plan.positions, plan.placements,
                                     engine.settings.seam_tokens, engine.anchor_ids)[0]
        asks = [engine.generate(msgs, max_new_tokens=2) for _ in range(2)]
        error = max(relative_error(ask.first_logits, oracle) for ask in asks)
        first, second = asks
        reused = all(getattr(ask, reused_field) > 0 and ask.vision_tower_runs == 0 for ask in asks) \
            and second.prefix_tokens_reused > first.prefix_tokens_reused
        detail = (f"{getattr(first, reused_field)} chunk tokens spliced; 2nd ask: "
                  f"{second.usage.cached_tokens} of {second.usage.prompt_tokens} prompt tokens cached")
        if not reused:
            detail += " (expected: chunk spliced in both asks, the 2nd reading more prefix)"
        return Measure(error, self.tolerance, detail, reused)

    def _image_keys(self, grid, features, shift: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The image span prefilled after the engine's anchor with every position shifted by
        `shift`: its positions [3, n] and each layer's keys [kv_heads, n, head_dim]."""
        ad = self.adapter
        anchor = self.engine.anchor_ids
        ids = torch.cat((anchor, ad.image_span_ids(grid)))
        pos = ad.native_positions(ids, [grid]) + shift
        cache = ad.new_cache()
        ad.forward(ids, pos, cache, features)
        a = anchor.numel()
        return pos[:, a:], [layer.keys[0, :, a:] for layer in cache.layers]

    def _decode_alone(self, msgs: list) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding of one prompt by itself (tokens only the processor places masked out):
        the tokens fed at each step and the logits each step gave."""
        engine = self.engine
        run = engine.start(msgs, max_new_tokens=DECODE_STEPS + 1)
        run.prefill()
        logits = run.first_logits
        tokens, steps = [], []
        for step in range(DECODE_STEPS):
            masked = logits.float().clone()
            masked[engine.banned_ids] = float("-inf")
            tokens.append(int(masked.argmax()))
            position = torch.full((3, 1), run.stream.first_position + step, dtype=torch.long)
            logits = self.adapter.forward(torch.tensor([tokens[-1]]), position, run.cache)[0]
            steps.append(logits)
        return tokens, steps


def run_selftest(model: str | None = None, device: str | None = None, dtype: str | None = None) -> Report:
    """Load `model` (a local dir or a hub id in the local cache; None: the bundled model) RAM-only
    and run the checks."""
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    try:
        checks = SelfTest(engine).run()
    finally:
        engine.close()
    ad = engine.adapter
    return Report(engine.model_id, ad.family, str(ad.device), str(ad.dtype).removeprefix("torch."),
                  round(load_s, 2), round(time.perf_counter() - t0, 2), checks)


def format_report(report: Report) -> str:
    """The PASS / FAIL table."""
    lines = [f"mmkv selftest: {report.model} ({report.family}) on {report.device}, {report.dtype}",
             "errors: max |got - want| / max(1, max |want|)", "",
             f"{'check':<38}{'error':>9}  {'tolerance':>9}  result  detail"]
    for c in report.checks:
        error = "-" if c.error is None else f"{c.error:.1e}"
        lines.append(f"{c.title:<38}{error:>9}  {c.tolerance:>9.1e}  {'PASS' if c.passed else 'FAIL':<6}  {c.detail}")
    failed = [c.name for c in report.checks if not c.passed]
    verdict = "PASS" if not failed else f"FAIL ({', '.join(failed)})"
    lines += ["", f"{verdict}: {len(report.checks) - len(failed)} of {len(report.checks)} checks passed in "
                  f"{report.total_s:.1f} s (model loaded in {report.load_s:.1f} s)"]
    return "\n".join(lines)
