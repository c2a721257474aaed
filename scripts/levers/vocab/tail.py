"""The exact tail fallback of a pruned output vocabulary: a one-row estimator that says when a dropped token could win.

    make prune-vocab VARIANT=gemma3-270m-v32k-tail [REFIT_TAIL=1]    # prune.py calls estimator()

A pruned head (scripts.levers.vocab.prune) computes logits for the kept rows only; a dropped token can then never be
chosen, even where the parent would choose it. With PRUNE_TAIL=1 the checkpoint also carries `vocab_tail/estimator.safetensors`:
one row over the features the serving step already has, [hidden state (after the final norm), max kept logit,
logsumexp of the kept logits, 1], trained to predict the largest dropped logit (`max_dropped`), or the log of the
probability mass on dropped ids (`tail_mass`, as adaptive softmax's tail cluster scores it). The serving plugin reads
the kept rows on every step, evaluates the row, and where

    max_dropped:  estimate + margin >= max kept logit
    tail_mass:    estimate + margin >= log p(best kept token)      (p computed with the estimated tail mass)

it computes that position's full row from the whole output matrix, which stays in memory (the tied input embedding),
so the greedy choice there is the parent's exactly. The fitted row is kept, like the keep lists, in
results/vocab/<base>/tail-<parent>-<N>.safetensors with its report (.json) and committed: `make prune-vocab` reuses
it when its keep list and output rows match, so a fresh clone builds the variant without the fit's data or minutes. The margin is fitted on held-out positions: the smallest that
flags every held-out position whose parent argmax is a dropped id, plus SAFETY_NATS. Both targets are fitted; the one
that reads the full row least often at that recall is kept.

Positions (teacher-forced through the parent with transformers, on this machine):
  fit       BIG-bench calibration text (scripts.data.bigbench_corpus) and the parent's own greedy answers to the
            calibration prompts (results/vocab/<base>/answers/, written by scripts.levers.vocab.analyze);
  margin    BIG-bench held-out tasks' text and the parent's answers to their prompts;
  check     the parent's answers to spec-v1-eval (never used to fit or to set the margin).
The file records the keep list's SHA-256 and the SHA-256 of the full output rows it was fitted on; the plugin refuses
it for another checkpoint or keep list, naming both hashes.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from scripts.common import paths
from scripts.levers.vocab.keep import VocabError, vocab_dir

TAIL_FILE = "vocab_tail/estimator.safetensors"  # (a folder: vLLM loads every top-level *.safetensors as weights)
TARGETS = ("max_dropped", "tail_mass")
SAFETY_NATS = 0.5
RIDGE = 1e-3


class TailError(VocabError):
    """A tail estimator that is missing, malformed or fitted for something else; the message is one line."""


def rows_sha256(rows) -> str:
    """SHA-256 of an output matrix's bytes as stored (BF16 rows, vocabulary order)."""
    import torch

    return hashlib.sha256(rows.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def kept_stats(kept_logits):
    """(max, logsumexp) of each row of kept logits, float32."""
    k = kept_logits.float()
    return k.max(-1).values, k.logsumexp(-1)


def estimate(hidden, kept_logits, weight, bias):
    """The row's estimate per position: weight . [hidden, max kept, logsumexp kept] + bias (float32)."""
    import torch

    mx, lse = kept_stats(kept_logits)
    x = torch.cat([hidden.float(), mx[:, None], lse[:, None]], dim=1)
    return x @ weight.float() + bias.float()


def gap(est, max_kept, lse_kept, target: str):
    """Per position, the margin it takes to flag it: the full row is read where gap <= margin."""
    import torch

    if target == "max_dropped":
        return max_kept - est
    q = est.clamp(max=-1e-4)  # a log tail mass is < 0
    return max_kept - lse_kept + torch.log1p(-torch.exp(q)) - q  # log p(best kept) - log tail mass


def flags(hidden, kept_logits, weight, bias, target: str, margin: float):
    """Positions whose full row must be read (bool per position)."""
    mx, lse = kept_stats(kept_logits)
    return gap(estimate(hidden, kept_logits, weight, bias), mx, lse, target) <= margin


def read(path: Path) -> tuple[dict, dict]:
    """(tensors, metadata) of a safetensors file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118 - safe_open is not iterable


def load(model_dir: Path, keep_list_sha256: str) -> dict:
    """The checkpoint's tail estimator, checked against its keep list (the output rows are checked by the plugin)."""
    path = Path(model_dir) / TAIL_FILE
    if not path.exists():
        raise TailError(f"{path} is missing: this checkpoint's vocab_pruning names a tail fallback, and it does not "
                        f"serve pruned-only without it (rebuild with `make prune-vocab`)")
    tensors, meta = read(path)
    if set(tensors) != {"weight", "bias"} or meta.get("target") not in TARGETS or "margin" not in meta:
        raise TailError(f"{path}: not a tail estimator (needs weight, bias, target, margin)")
    if meta.get("keep_list_sha256") != keep_list_sha256:
        raise TailError(f"{path} was fitted for keep list {meta.get('keep_list_sha256', '?')[:12]}, this checkpoint "
                        f"keeps {keep_list_sha256[:12]}")
    return {"weight": tensors["weight"], "bias": tensors["bias"], "target": meta["target"],
            "margin": float(meta["margin"]), "rows_sha256": meta.get("rows_sha256", ""), "path": path}


def check_rows(tail: dict, rows) -> None:
    """Refuse an estimator fitted on other output rows than the ones the fallback would read."""
    have = rows_sha256(rows)
    if have != tail["rows_sha256"]:
        raise TailError(f"{tail['path']} was fitted on output rows {tail['rows_sha256'][:12]}, the model's full "
                        f"output matrix is {have[:12]}")


# ---------------------------------------------------------------------------------------------------------- fit
def sequences(tok, base: str, max_positions: dict[str, int], chunk: int = 256) -> dict[str, list[tuple[list, int]]]:
    """Per set, (token ids, first scored position) pairs: text chunks and prompt + answer (scored from the answer)."""
    from scripts.data import bigbench_corpus
    from scripts.levers.vocab.analyze import read_answers

    out: dict[str, list[tuple[list, int]]] = {}
    for part in ("calibration", "held_out"):
        pairs, _ = bigbench_corpus.texts(part, 2_000)
        seqs, n = [], 0
        for ids in tok([t for _, t in pairs], add_special_tokens=False)["input_ids"]:
            if len(ids) < 8 or n >= max_positions[f"text/{part}"]:
                continue
            seqs.append((ids[:chunk], 1))
            n += len(ids[:chunk]) - 1
        out[f"text/{part}"] = seqs
    answers = vocab_dir(base) / "answers"
    for name, glob in (("answers/calibration", "bigbench-calibration-*"), ("answers/held_out", "bigbench-held_out-*"),
                       ("generations/held_out", "spec-v1-eval.jsonl-*")):
        files = sorted(answers.glob(glob + ".json.gz"))
        if not files:
            raise TailError(f"no {paths.shown(answers)}/{glob}.json.gz: run `make analyze-vocab` first")
        seqs, n = [], 0
        for a in read_answers(files[-1]):
            if n >= max_positions.get(name, 10 ** 9) or not a["ids"]:
                continue
            seqs.append((a["prompt_ids"] + a["ids"], len(a["prompt_ids"])))
            n += len(a["ids"])
        out[name] = seqs
    return out


def positions(model, rows, kept_mask, seqs: list[tuple[list, int]]) -> dict:
    """Hidden states and the kept / dropped logit statistics at every scored position of these sequences."""
    import torch

    hs, cols = [], {k: [] for k in ("max_kept", "lse_kept", "max_dropped", "lse_dropped")}
    w = rows.float()
    with torch.inference_mode():
        for ids, start in seqs:
            h = model.model(torch.tensor([ids])).last_hidden_state[0, start - 1:-1]
            z = h.float() @ w.T
            kz, dz = z[:, kept_mask], z[:, ~kept_mask]
            hs.append(h.float())
            cols["max_kept"].append(kz.max(-1).values)
            cols["lse_kept"].append(kz.logsumexp(-1))
            cols["max_dropped"].append(dz.max(-1).values)
            cols["lse_dropped"].append(dz.logsumexp(-1))
    return {"hidden": torch.cat(hs), **{k: torch.cat(v) for k, v in cols.items()}}


def target_of(p: dict, target: str):
    import torch

    if target == "max_dropped":
        return p["max_dropped"]
    return p["lse_dropped"] - torch.logaddexp(p["lse_kept"], p["lse_dropped"])


def ridge(p: dict, target: str):
    import torch

    x = torch.cat([features(p), torch.ones(len(p["hidden"]), 1)], 1).double()
    y = target_of(p, target).double()
    a = x.T @ x + RIDGE * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
    sol = torch.linalg.solve(a, x.T @ y)
    return sol[:-1].float(), sol[-1:].float()


def gaps(p: dict, weight, bias, target: str):
    x = features(p)
    return gap(x @ weight + bias, p["max_kept"], p["lse_kept"], target)


def features(p: dict):
    import torch

    return torch.cat([p["hidden"], p["max_kept"][:, None], p["lse_kept"][:, None]], 1)


def flag_rate(p: dict, weight, bias, target: str, margin: float) -> dict:
    """How often the full row is read, and whether every dropped-argmax position is among them."""
    flagged = gaps(p, weight, bias, target) <= margin
    wins = p["max_dropped"] > p["max_kept"]
    n, w, fw = len(flagged), int(wins.sum()), int((flagged & wins).sum())
    return {"positions": n, "argmax_dropped": w, "argmax_coverage": round(1 - w / n, 6),
            "full_row_reads": int(flagged.sum()), "full_row_rate": round(int(flagged.sum()) / n, 6),
            "dropped_argmax_flagged": fw, "recall": round(fw / w, 6) if w else None}


def estimator_path(base: str, parent: str, n: int) -> Path:
    """Where a fitted estimator is kept (committed, like the keep lists): per base, parent checkpoint and N."""
    return vocab_dir(base) / f"tail-{parent}-{n}.safetensors"


def estimator(parent_dir: Path, base: str, parent: str, kept: list[int], keep_list_sha256: str, rows_name: str,
              rows, refit: bool = False) -> tuple[dict, dict]:
    """The committed estimator for this parent and keep list (checked: same keep list, same output rows), or a new
    fit written there (with its report beside it) when there is none, it is stale, or refit is asked."""
    from safetensors.torch import save_file

    path = estimator_path(base, parent, len(kept))
    report_path = path.with_suffix(".json")
    if path.exists() and report_path.exists() and not refit:
        tensors, meta = read(path)
        if meta.get("keep_list_sha256") == keep_list_sha256 and meta.get("rows_sha256") == rows_sha256(rows):
            return {"tensors": tensors, "metadata": meta}, json.loads(report_path.read_text())
        print(f"{paths.shown(path)} was fitted for another keep list or checkpoint: refitting")
    file, report = fit(parent_dir, base, kept, keep_list_sha256, rows_name)
    report = {"parent": parent, "estimator": paths.shown(path), **report}
    for out, write in ((path, lambda t: save_file(file["tensors"], t, metadata=file["metadata"])),
                       (report_path, lambda t: t.write_text(json.dumps(report, indent=1) + "\n"))):
        tmp = out.with_name(f".{out.name}.tmp")
        write(tmp)
        tmp.rename(out)
    return file, report


def fit(parent_dir: Path, base: str, kept: list[int], keep_list_sha256: str, rows_name: str,
        max_positions: int = 40_000) -> tuple[dict, dict]:
    """(tensors and metadata for TAIL_FILE, report). Reads the parent (never written) with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(parent_dir)
    model = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.bfloat16).eval()
    rows = model.get_output_embeddings().weight.detach()
    vocab = rows.shape[0]
    kept_mask = torch.zeros(vocab, dtype=torch.bool)
    kept_mask[torch.tensor(kept)] = True
    budget = {"text/calibration": max_positions // 2, "answers/calibration": max_positions // 2,
              "text/held_out": max_positions // 4, "answers/held_out": max_positions // 4}
    sets = {name: positions(model, rows, kept_mask, seqs) for name, seqs in sequences(tok, base, budget).items()}
    cat = {k: torch.cat([sets["text/calibration"][k], sets["answers/calibration"][k]]) for k in sets["text/calibration"]}
    held = {k: torch.cat([sets["text/held_out"][k], sets["answers/held_out"][k]]) for k in cat}
    candidates = {}
    for target in TARGETS:
        weight, bias = ridge(cat, target)
        need = gaps(held, weight, bias, target)[held["max_dropped"] > held["max_kept"]]
        margin = (float(need.max()) if len(need) else 0.0) + SAFETY_NATS
        candidates[target] = {
            "weight": weight, "bias": bias, "margin": margin,
            "per_set": {name: flag_rate(p, weight, bias, target, margin) for name, p in sets.items()}}
    best = min(TARGETS, key=lambda t: candidates[t]["per_set"]["text/held_out"]["full_row_rate"]
               + candidates[t]["per_set"]["answers/held_out"]["full_row_rate"])
    c = candidates[best]
    meta = {"target": best, "margin": f"{c['margin']:.6f}", "keep_list_sha256": keep_list_sha256,
            "rows_sha256": rows_sha256(rows), "rows_from": rows_name, "safety_nats": str(SAFETY_NATS)}
    report = {"target": best, "margin": round(c["margin"], 4), "safety_nats": SAFETY_NATS, "ridge": RIDGE,
              "rows_sha256": meta["rows_sha256"], "threads": torch.get_num_threads(),
              "candidates": {t: {"margin": round(v["margin"], 4), "per_set": v["per_set"]}
                             for t, v in candidates.items()},
              "sets": {"fit": ["text/calibration", "answers/calibration"],
                       "margin": ["text/held_out", "answers/held_out"], "check": ["generations/held_out"]},
              "seconds": round(time.monotonic() - t0, 1)}
    return {"tensors": {"weight": c["weight"].contiguous(), "bias": c["bias"].contiguous()}, "metadata": meta}, report
