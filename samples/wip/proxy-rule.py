"""proxy-rule.py DIR A: the proxy stages' rule (stages 7 and 8; model 0 = the bundle, model 1 = the candidate)
on DIR/A.json (--validation 40) and DIR/At.json (--validation 120, the three text gates): the six conversation
types on A plus At's text gates, pooled, must rise (one-sided sign test p < 0.05), and the nine single-image
types on A may fall by at most 8.

proxy-rule.py DIR A stage9: stage 9's rule (s48-rules.md): the dark rows on A rise at p < 0.05, the nine image
types fall by at most 8, and the conversation types plus text gates, pooled, fall by at most 10.

proxy-rule.py DIR A stage10: stage 10's rule (s48-rules.md, session 53): At's text gates rise at p < 0.05, the
nine image types fall by at most 8, the dark rows by at most 8, and describe / same_color / more_shapes on A,
pooled, by at most 6."""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # samples/, for evaluate_tiny
from evaluate_tiny import TYPES as IMAGE
from paired import p1, row, tally
CONV = ["describe", "same_color", "more_shapes", "field_gate", "erratum_gate", "field_image_gate"]
G = {k: [0, 0, 0, 0, 0] for k in ("conv", "text_t", "new", "image9", "shadow", "dark", "other3")}
MODE = (sys.argv[3:] or [""])[0]
if sys.argv[4:] or MODE not in ("", "stage9", "stage10"):
    sys.exit(f"usage: proxy-rule.py DIR A [stage9|stage10] (got {sys.argv[3:]}): no other rule is written")
for s in (sys.argv[2], sys.argv[2] + "t"):
    for t, items in json.load(open(f"{sys.argv[1]}/{s}.json"))["items"].items():
        style, _, base = t.rpartition(":")
        keys = [f"{s}:{t}"]
        if style in ("shadow", "dark"): keys.append(style)
        if not style and base in CONV: keys += ["conv" if not s.endswith("t") else "text_t", "new"]
        if not style and base in CONV[:3] and not s.endswith("t"): keys.append("other3")
        if not style and base in IMAGE and not s.endswith("t"): keys.append("image9")
        for it in items:
            a, b = (x == it["label"] for x in it["answers"][:2])
            for k in keys:
                tally(G.setdefault(k, [0, 0, 0, 0, 0]), a, b)
for k, g in G.items():
    print(row(k, g))
new, img, dark = G["new"], G["image9"], G["dark"]
if MODE == "stage10":
    text, other = G["text_t"], G["other3"]
    checks = {"1 text gates (At) up at p < 0.05": p1(text[3], text[4]) < 0.05,
              "2 nine image types down by at most 8": img[1] - img[2] <= 8,
              "3 dark rows down by at most 8": dark[1] - dark[2] <= 8,
              "4 describe / same_color / more_shapes down by at most 6": other[1] - other[2] <= 6}
elif MODE == "stage9":
    checks = {"1 dark rows up at p < 0.05": p1(dark[3], dark[4]) < 0.05,
              "2 nine image types down by at most 8": img[1] - img[2] <= 8,
              "3 conversation types + text gates down by at most 10": new[1] - new[2] <= 10}
else:
    checks = {"1 conversation types + text gates up at p < 0.05": p1(new[3], new[4]) < 0.05,
              "2 nine image types down by at most 8": img[1] - img[2] <= 8}
for k, v in checks.items():
    print(f"{k}:", "PASS" if v else "FAIL")
print("KEEP the candidate" if all(checks.values()) else "KEEP the bundle")
