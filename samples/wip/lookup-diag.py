"""lookup-diag.py MODEL: does a checkpoint read a text field from its context? (session 53)

30 single questions each of field_value, policy_value and field_gate (seeds diag-<type>-<i>): right answers,
the most common answers, and for the two lookups how many answers are a value of the asked field; then 10 of
each of the nine image types. Results: samples/README.md, "Why the proxy's text gates do not move"."""
import collections, random, sys
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository root, for vqa_eval
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor
from vqa_eval import dataset as D, episodes as E
N = 30
torch.set_num_threads(1)
proc = AutoProcessor.from_pretrained(sys.argv[1], local_files_only=True)
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], local_files_only=True).eval()


def episodes(t: str, n: int) -> list:
    return [E.build(random.Random(f"diag-{t}-{i}"), t, level=1.0, before=0) for i in range(n)]


for t in ("field_value", "policy_value", "field_gate"):
    eps = episodes(t, N)
    got = [E.ask(model, proc, ep) for ep in eps]
    print(t, f"{sum(g == ep.answer for g, ep in zip(got, eps))}/{N}", "answers:", collections.Counter(got).most_common(6))
    if t != "field_gate":
        print("  same field's values:", sum(g in E.FIELDS[ep.gate["field"]] for g, ep in zip(got, eps)), f"/{N}")
    if t == "field_value":  # what such a conversation looks like
        for msg in eps[0].messages:
            print("   ", msg["role"], [c.get("text", "<img>") for c in msg["content"]])
image = [ep for t in D.TYPES for ep in episodes(t, 10)]
print("nine image types", f"{sum(E.ask(model, proc, ep) == ep.answer for ep in image)}/{len(image)}")
