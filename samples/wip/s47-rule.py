"""rule.py DIR A B [count]: session 47's rule (model 0 = the bundle, model 1 = the candidate) on DIR/{A,At,B,Bt}.json.

With `count` (session 52's count rule, s48-rules.md), clauses 1-2 become: count over three styles rises and
plain count is not down; dark down by at most 3. Clause 6 of that rule (fresh-set splice) is scored apart."""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # samples/, for evaluate_tiny
from evaluate_tiny import E, TYPES as IMAGE, same_objects
from paired import p1, row, tally
TEXT = E.TEXT_TYPES
OTHER = [t for t in IMAGE if t != "count"] + ["same_color", "more_shapes"]
G = {k: [0, 0, 0, 0, 0] for k in ("dark", "count3", "count", "text", "describe", "anyorder", "other10", "shadow")}
COUNT_RULE = sys.argv[4:] == ["count"]
if sys.argv[4:] not in ([], ["count"]):
    sys.exit(f"usage: s47-rule.py DIR A B [count] (got {sys.argv[4:]}): no other rule is written")
A, B = sys.argv[2], sys.argv[3]
for s in (A, A + "t", B, B + "t"):
    d = json.load(open(f"{sys.argv[1]}/{s}.json"))
    for t, items in d["items"].items():
        style, _, base = t.rpartition(":")
        keys = []
        if style == "dark": keys.append("dark")
        if style == "shadow": keys.append("shadow")
        if base == "count": keys.append("count3")
        if not style and base == "count": keys.append("count")
        if not style and base in TEXT: keys.append("text")
        if not style and base == "describe": keys.append("describe")
        if not style and base in OTHER: keys.append("other10")
        for it in items:
            a, b = (x == it["label"] for x in it["answers"][:2])
            for k in keys + [f"{s}:{t}"]:
                tally(G.setdefault(k, [0, 0, 0, 0, 0]) if k.startswith(s) else G[k], a, b)
            if base == "describe" and not style:
                tally(G["anyorder"], *(same_objects(x, it["label"]) for x in it["answers"][:2]))
for k, g in G.items():
    if ":" in k and g[1] == g[2] == g[0]: continue
    print(row(k, g))
d, c, t, de, an, o, sh = (G[k] for k in ("dark", "count3", "text", "describe", "anyorder", "other10", "shadow"))
first = ({"1 count3 up, plain count not down": c[3] > c[4] and G["count"][2] >= G["count"][1],
          "2 dark down<=3": d[1] - d[2] <= 3} if COUNT_RULE else
         {"1 dark p<0.1": p1(d[3], d[4]) < 0.1, "2 count3 not down": c[2] >= c[1]})
checks = {**first, "3 text down<=3": t[1] - t[2] <= 3,
          "4 describe>=68, down<=3, anyorder down<=1": de[2] >= 68 and de[1] - de[2] <= 3 and an[1] - an[2] <= 1,
          "5 other10 down<=4, shadow down<=4": o[1] - o[2] <= 4 and sh[1] - sh[2] <= 4}
for k, v in checks.items(): print(k, "PASS" if v else "FAIL")
print("BUNDLE" if all(checks.values()) else "KEEP the bundle")
