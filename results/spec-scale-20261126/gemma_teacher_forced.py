"""Diagnostic of the seventh round: the Gemma head's accuracy per draft position, teacher-forced with redistill's
own features (the target in transformers), on (a) 32 of its own validation answers and (b) the parent's greedy
continuations of spec-v1-eval's first 8 prompts (transformers, 64 tokens). redistill.train runs one step at lr 0 from
the committed head (REDISTILL_INIT: its draft vocabulary is checked against the answers'), then validates.

    PYTHONPATH=. python results/spec-scale-20261126/gemma_teacher_forced.py   # ~25 min on two cores
"""

import json
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.common.variants import load_variant
from scripts.levers.speculate import redistill as R

head = Path("weights/gemma3-270m-ceagle-head")  # make weights VARIANT=gemma3-270m-ceagle4 installs it
target = "weights/gemma-3-270m"
d = R.import_answers(Path("results/spec-scale-20261126/gemma-answers.npz"))
cached = json.loads((d / "responses.json").read_text())
rows = [json.loads(line) for line in Path(".cache/prompts/spec-v3.jsonl").read_text().splitlines()]
known = R.splits_of(rows)
seqs = [{**s, "split": s.get("split") or known[s["id"]][0]} for s in cached["seqs"]]
train = [s for s in seqs if s["split"] == "train"]
val = [s for s in seqs if s["split"] == "val"]
freq = Counter(t for s in train for t in s["ids"])
print("train", len(train), "val", len(val), flush=True)

tok = AutoTokenizer.from_pretrained(target)
m = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
ev = [json.loads(line) for line in Path("eval/prompts/spec-v1-eval.jsonl").read_text().splitlines()][:8]
gen = []
for r in ev:
    text = tok.bos_token + "\n\n".join(x["content"] for x in r["messages"])
    p = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = m.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    ids = out[0, len(p) :].tolist()
    gen.append({"id": r["id"], "prompt_ids": p, "ids": ids, "split": "val"})
    print(r["id"], repr(tok.decode(ids)[:160]), flush=True)
del m

cfg = R.settings_of(load_variant("gemma3-270m-ceagle4"))
cfg.update(init=str(head), lr=0.0, ranks=1, max_seconds=None, eval_every=0, snapshot_every=None, feature_cache_mb=4000)
for name, vset in (("own validation answers (32)", val[:32]), ("spec-v1-eval continuations (8 x 64 tokens)", gen)):
    _, _, acc, _, _ = R.train(target, 640, {"train": train[:64], "val": vset}, freq, cfg, 1, 0)
    print(f"== {name}: teacher-forced accuracy per position {[round(a, 3) for a in acc]}", flush=True)
