"""lookup-diag.py MODEL: does a checkpoint read a text field from its context? (session 53)

30 single questions each of field_value, policy_value and field_gate (seeds diag-<type>-<i>): right answers,
the most common answers, and how many answers are a value of the asked field; then 10 of each of the nine
image types. Results: samples/README.md, "Why the proxy's text gates do not move"."""
import random, sys, collections, torch
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
from transformers import AutoModelForImageTextToText, AutoProcessor
from vqa_eval import episodes as E
torch.set_num_threads(1)
m = sys.argv[1]
proc = AutoProcessor.from_pretrained(m, local_files_only=True)
model = AutoModelForImageTextToText.from_pretrained(m, local_files_only=True).eval()
for t in ("field_value", "policy_value", "field_gate"):
    rows = []
    for i in range(30):
        ep = E.build(random.Random(f"diag-{t}-{i}"), t, level=1.0, before=0)
        got = E.ask(model, proc, ep)
        rows.append((ep.answer, got, ep.gate.get("field")))
    hits = sum(a == g for a, g, _ in rows)
    print(t, f"{hits}/30", "answers:", collections.Counter(g for _, g, _ in rows).most_common(6))
    print("  same field's values:", sum(g in E.FIELDS[f] for a, g, f in rows), "/30")
    if t == "field_value":
        ep = E.build(random.Random(f"diag-{t}-0"), t, level=1.0, before=0)
        for msg in ep.messages: print("   ", msg["role"], [c.get("text", "<img>") for c in msg["content"]])
from mmkv.vqa_eval import dataset as D
hits = 0; n = 0
for t in D.TYPES:
    for i in range(10):
        ep = E.build(random.Random(f"diag-{t}-{i}"), t, level=1.0, before=0)
        hits += E.ask(model, proc, ep) == ep.answer; n += 1
print("nine image types", f"{hits}/{n}")
