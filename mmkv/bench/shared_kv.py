"""`mmkv bench-concurrency --mode shared`: N requests about one long policy decoding together,
the batch's KV held once per shared prefix against every row whole, through the scheduler."""

from __future__ import annotations

import statistics
import time

from mmkv.request.scheduler import Scheduler

POLICY_SENTENCE = "policy : refunds within thirty days , receipts required , no exceptions for sale items . "


def _ask(policy: str, i: int) -> list[dict]:
    return [{"role": "system", "content": policy}, {"role": "user", "content": f"case {i} : may I return it ?"}]


def _policy(engine, tokens: int) -> str:
    unit = len(engine.adapter.tokenizer(POLICY_SENTENCE)["input_ids"])
    return POLICY_SENTENCE * max(tokens // unit, 1)


def _run(engine, policy: str, rows: int, tokens: int, share: bool) -> dict:
    """All `rows` requests submitted at once; the batch's peak KV bytes and rows, sampled each
    millisecond, and completion tokens/s over the whole run."""
    banned = {t: -100.0 for t in engine.stop_ids}
    scheduler = Scheduler(engine, max_batch=rows, share_kv=share).start()
    try:
        start = time.perf_counter()
        futures = [scheduler.submit(_ask(policy, i), max_new_tokens=tokens, logit_bias=banned) for i in range(rows)]
        peak = {"decode_batch_kv_bytes": 0, "decode_batch_rows": 0, "decode_batch_shared_tokens": 0}
        while not all(f.done() for f in futures):
            seen = scheduler.batch_stats
            if seen["decode_batch_kv_bytes"] > peak["decode_batch_kv_bytes"]:
                peak = dict(seen)
            time.sleep(0.001)
        results = [f.result() for f in futures]
        wall = time.perf_counter() - start
    finally:
        scheduler.stop()
    produced = sum(len(r.token_ids) for r in results)
    return {"rows": rows, "share": share, "peak_bytes": peak["decode_batch_kv_bytes"],
            "peak_rows": peak["decode_batch_rows"], "shared_tokens": peak["decode_batch_shared_tokens"],
            "tokens_per_s": produced / wall}


def shared_table(engine, prefix_tokens: int, row_counts: tuple[int, ...], tokens: int, rounds: int) -> list[str]:
    """One row per (rows, arm): peak batch KV against one request's, shared tokens, tokens/s."""
    policy = _policy(engine, prefix_tokens)
    engine.generate(_ask(policy, -1), max_new_tokens=1)  # the policy is in the prefix cache, as a popular one is
    one = _run(engine, policy, 1, tokens, share=False)["peak_bytes"]
    lines = ["| requests | batch KV | rows at peak | peak KV (MiB) | x one request's | tokens held once | "
             "completion tok/s | tok/s shared / whole |", "|---|---|---|---|---|---|---|---|"]
    for rows in row_counts:
        runs = {arm: [] for arm in ("whole", "shared")}
        for _ in range(rounds):  # arms alternate within each round
            for arm in runs:
                runs[arm].append(_run(engine, policy, rows, tokens, share=arm == "shared"))
        speed = {arm: statistics.median(r["tokens_per_s"] for r in rs) for arm, rs in runs.items()}
        for arm, rs in runs.items():
            peak = max(r["peak_bytes"] for r in rs)
            ratio = f"{speed['shared'] / speed['whole']:.2f}x" if arm == "shared" else ""
            top = max(rs, key=lambda r: r["peak_bytes"])
            lines.append(f"| {rows} | {arm} | {top['peak_rows']} | {peak / 2**20:.1f} | {peak / one:.2f}x | "
                         f"{max(r['shared_tokens'] for r in rs)} | {speed[arm]:.1f} | {ratio} |")
    lines.append(f"\none request alone holds {one / 2**20:.1f} MiB at its peak ({prefix_tokens}-token policy, "
                 f"{tokens} completion tokens).")
    return lines
