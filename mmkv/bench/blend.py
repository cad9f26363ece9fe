"""`mmkv bench --modes blend`: the fidelity dial's speed side. For an image or a skill of a given
size, the TTFT of one turn whose chunk is spliced with a share r of its tokens recomputed in
context (`blend`, mmkv.request.blend), per selector, against the full recompute and the plain
splice (r = 0), interleaved. Each call puts a new line of text before the chunk, so the prefix
cache never holds the chunk's blended KV from an earlier round: every round blends the whole chunk."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from mmkv.bench.run import HISTORY, Arm, Sample, Table, _picture, _skill, finish, first_token, interleave

DEFAULT_RATIOS = (0.0, 0.05, 0.1, 0.2, 0.4, 1.0)


def _image_turn(engine, tokens: int) -> tuple[Callable[[int], list], str, str]:
    tenant = f"image-{tokens}"
    image_id = engine.add_image(_picture(engine, tokens), tenant=tenant)

    def messages(k: int) -> list:
        return HISTORY + [{"role": "user", "content": [
            {"type": "text", "text": f"turn {k} : look again at"},
            {"type": "image_file", "image_file": {"file_id": image_id}},
            {"type": "text", "text": "what is in it ?"}]}]
    return messages, tenant, f"image, {tokens} tokens"


def _skill_turn(engine, tokens: int) -> tuple[Callable[[int], list], str, str]:
    skill_id, tenant = _skill(engine, tokens)

    def messages(k: int) -> list:
        return [{"role": "system", "content": [{"type": "text", "text": f"user {k} prefers short answers .\n"},
                                               {"type": "skill", "skill_id": skill_id}]},
                {"role": "user", "content": "which tool finds documents ?"}]
    return messages, tenant, f"skill, {tokens} tokens"


def _arm(engine, name: str, messages: Callable[[int], list], tenant: str, probe: list[float], **kwargs) -> Arm:
    rounds = itertools.count(1)

    def run() -> Sample:
        r, cpu_s, after_s = first_token(engine, messages(next(rounds)), tenant=tenant, **kwargs)
        if r.blend is not None:
            probe.append(r.blend.probe_ms)
        return Sample(r.ttft_s, cpu_s, r.lm_tokens_computed, r.usage.prompt_tokens, after_s)
    return Arm(name, run)


def bench_blend(engine, kind: str, tokens: int, repeats: int, ratios=DEFAULT_RATIOS,
                selects=("deviation", "stride")) -> Table:
    """One table: full recompute, then each (selector, r), interleaved; r = 0 and 1 once."""
    messages, tenant, case = (_image_turn if kind == "image" else _skill_turn)(engine, tokens)
    probes: dict[str, list[float]] = {}
    arms = [_arm(engine, "full recompute", messages, tenant, [], reuse=False)]
    for select in selects:
        for r in ratios:
            if r in (0.0, 1.0) and select != selects[0]:
                continue
            name = "mmkv splice (r = 0)" if r == 0 else f"blend r = {r:g}" + ("" if r == 1 else f", {select}")
            probes[name] = []
            arms.append(_arm(engine, name, messages, tenant, probes[name], blend=r, blend_select=select))
    rows = interleave(arms, repeats)
    n = engine.prompt_ids(messages(0), tenant=tenant).numel()
    table = finish(Table("blend", case, n, rows), "full recompute", None)
    table.notes = {"probe_ms_median": {k: round(sorted(v)[len(v) // 2], 1) for k, v in probes.items() if v and max(v)}}
    return table


def format_blend(t: dict) -> str:
    probes = t["notes"].get("probe_ms_median", {})
    lines = [f"### blend: {t['case']} (prompt {t['prompt_tokens']} tokens)",
             "| arm | ms | CPU ms | speed-up vs full | TTFT / full (CPU) | LM tokens computed | probe ms |",
             "|---|---|---|---|---|---|---|"]
    full = t["rows"][0]["cpu_ms"]
    lines += [f"| {r['arm']} | {r['ms']:.1f} | {r['cpu_ms']:.1f} | {r['speedup_vs_full']:.2f}x | "
              f"{r['cpu_ms'] / full:.2f} | {r['computed_tokens']} | {probes.get(r['arm'], '-')} |" for r in t["rows"]]
    return "\n".join(lines) + "\n"
