#!/bin/bash
# score.sh FAMILY CAND A B : candidate against the bundle on A, At, B, Bt (40/type; 120/text gate)
cd "$(dirname "$0")/../.."  # the repository root
F=$1; C=$2; O=/work/s47/score-$F; mkdir -p $O
for s in $3 $4; do
  .venv/bin/python samples/evaluate_tiny.py --validation 40 --validation-seed $s --model samples/models/$F-tiny --model $C --json $O/$s.json > $O/$s.txt 2>&1
  .venv/bin/python samples/evaluate_tiny.py --validation 120 --validation-seed ${s}t --validation-types field_gate,erratum_gate,field_image_gate --model samples/models/$F-tiny --model $C --json $O/${s}t.json > $O/${s}t.txt 2>&1
done
echo done > $O/DONE
