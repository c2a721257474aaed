"""Train a LoRA adapter on a variant's BF16 parent with PEFT, watching held-out perplexity.

    python -m scripts.levers.lora.train smollm2-lora-a        # `make train-lora VARIANT=smollm2-lora-a`
    python -m scripts.levers.lora.train smollm2-lora3         # every missing adapter a multi-adapter variant serves

The variant's LORA_* keys (scripts/levers/lora/adapters.py) say what to train: PARENT's weights (BF16; a quantized parent is
refused: train and merge in BF16, then quantize), rank, alpha, target modules, the text (LORA_DATA, default the
offline cpython-docs corpus after parity's evaluated 40 %) and which contiguous part of it (LORA_SPLIT=k/n: adapters
on different parts learn different domains). The part's last LORA_HELDOUT_FRACTION is held out.

Perplexity is measured before training, every LORA_EVAL_EVERY steps and at the end, on the held-out tail of the
domain and on general text (the start of cpython-docs, which no adapter trains on). The seed's guard against a
degenerate model: when the domain perplexity rises more than LORA_MAX_RISE above its best, training stops and the best
adapter is kept (and the card says so); after training the adapted model answers three chat prompts greedily, and an
empty or one-token-repeated answer fails the run with nothing written. Deterministic: seeded shuffling, seeded init.

Writes LORA_ADAPTER (temp folder, renamed into place): PEFT's adapter_config.json + adapter_model.safetensors, and
lora_card.json (base model and its config hash, rank, alpha, targets, data name/hash/tokens, steps, curve, answers,
timings, versions, git, hardware); the same card as experiments/<variant>/train_lora_<time>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.hardware import hardware, training_dtype
from scripts.common.records import git_state, now_utc, versions, write_record
from scripts.common.variants import VariantError, list_variants, load_variant, missing_model, parse_overrides
from scripts.levers.lora import adapters as lora

PROMPTS = ("What is the capital of France?", "Explain what a Python list is in one sentence.",
           "Write a short greeting.")


def chunks(ids: list[int], seq_len: int) -> list[list[int]]:
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def perplexity(model, rows: list[list[int]], batch: int, bf16: bool) -> float:
    import torch

    model.eval()
    nll, n = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(rows), batch):
            x = torch.tensor(rows[i:i + batch])
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1), reduction="sum")
            nll, n = nll + loss.item(), n + x[:, 1:].numel()
    model.train()
    return math.exp(nll / n)


def degenerate(text: str, ids: list[int]) -> str | None:
    """Why an answer shows a broken model: empty, or one token repeated throughout."""
    if not text.strip():
        return "empty answer"
    if len(ids) >= 8 and len(set(ids)) == 1:
        return f"one token repeated: {text[:40]!r}"
    return None


def answers(model, tok, max_new_tokens: int = 32) -> list[dict]:
    import torch

    model.eval()
    out = []
    for prompt in PROMPTS:
        msgs = [{"role": "user", "content": prompt}]
        x = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            y = model.generate(**x, max_new_tokens=max_new_tokens, do_sample=False)
        new = y[0, x["input_ids"].shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        out.append({"prompt": prompt, "answer": text, "problem": degenerate(text, new)})
    model.train()
    return out


def train(name: str, overrides: dict[str, str] | None = None, record_dir: Path | None = None) -> dict:
    """Train `name`'s adapter; its card (also written as a record under record_dir, default the variant's folder)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    variant = load_variant(name, overrides=overrides)
    s = lora.settings(variant)
    parent = load_variant(variant.resolved["PARENT"]) if variant.resolved.get("PARENT") else None
    if parent is None:
        raise lora.LoraError(f"{name}: no PARENT (the BF16 variant the adapter is trained on)")
    base_dir = Path(parent.model)
    if not (base_dir / "config.json").exists():
        raise lora.LoraError(missing_model(parent))
    if lora.quantized(base_dir):
        raise lora.LoraError(f"{parent.name} is quantized: train on its BF16 parent, merge (make merge-lora), then "
                             "quantize the merged model")
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    data_name, ids = lora.training_tokens(s.data, s.split, tok)
    cut = int(len(ids) * (1 - s.heldout_fraction))
    train_rows, held = chunks(ids[:cut], s.seq_len), chunks(ids[cut:], s.seq_len)[: s.heldout_chunks]
    general = chunks(tok(lora.general_text(), add_special_tokens=False)["input_ids"], s.seq_len)[: s.heldout_chunks]
    if len(train_rows) < s.batch or not held:
        raise lora.LoraError(f"{data_name}: {len(ids)} tokens are too few for LORA_SEQ_LEN={s.seq_len} x "
                             f"LORA_BATCH={s.batch} with a held-out tail")
    # BF16 autocast where the CPU has native BF16, else FP32 (the BF16 weights upcast): see training_dtype
    dtype = training_dtype()
    bf16 = dtype == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    if not bf16:
        model = model.float()
    lora.check_targets(model, s.targets, s.rank)
    model = get_peft_model(model, LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout,
                                             target_modules=list(s.targets), task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr, weight_decay=0.0)
    warmup = max(1, s.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) *
                                              max(0.0, (s.steps - i) / max(1, s.steps - warmup)) ** 0.5)

    def measure(step: int, loss: float | None) -> dict:
        point = {"step": step, "train_loss": loss, "heldout_ppl": round(perplexity(model, held, s.batch, bf16), 4),
                 "general_ppl": round(perplexity(model, general, s.batch, bf16), 4)}
        tqdm.write(f"  step {step}: held-out ppl {point['heldout_ppl']}, general ppl {point['general_ppl']}"
                   + (f", train loss {loss:.4f}" if loss is not None else ""))
        return point

    t0 = time.monotonic()
    curve = [measure(0, None)]
    best = (curve[0]["heldout_ppl"], 0, {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k})
    order, stopped, losses = [], None, []
    model.train()
    bar = tqdm(range(1, s.steps + 1), desc=f"train {name}", unit="step")
    for step in bar:
        if not order:
            order = list(range(len(train_rows)))
            random.shuffle(order)
        x = torch.tensor([train_rows[order.pop()] for _ in range(min(s.batch, len(order) or s.batch))])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % s.eval_every == 0 or step == s.steps:
            point = measure(step, sum(losses) / len(losses))
            losses = []
            curve.append(point)
            if point["heldout_ppl"] < best[0]:
                best = (point["heldout_ppl"], step, {k: v.detach().clone() for k, v in model.state_dict().items()
                                                     if "lora_" in k})
            elif point["heldout_ppl"] > best[0] * (1 + s.max_rise):
                stopped = (f"held-out perplexity rose from {best[0]} (step {best[1]}) to {point['heldout_ppl']} "
                           f"(step {step}): stopped, the step-{best[1]} adapter kept")
                tqdm.write(f"  {stopped}")
                break
    bar.close()
    train_s = time.monotonic() - t0
    model.load_state_dict(best[2], strict=False)
    said = answers(model, tok)
    problems = [f"{a['prompt']!r}: {a['problem']}" for a in said if a["problem"]]
    if problems:
        raise lora.LoraError(f"the adapted model stopped answering ({'; '.join(problems)}): nothing written; "
                             "lower LORA_LR or LORA_STEPS")
    card = {"kind": "lora-adapter", "variant": name, "base_variant": parent.name, "base_model": paths.shown(base_dir),
            "base_config_sha256": lora.config_sha256(base_dir), "rank": s.rank, "alpha": s.alpha,
            "dropout": s.dropout, "targets": list(s.targets), "trainable_params": trainable,
            "data": {"name": data_name, "tokens": len(ids), "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
                     "train_tokens": cut, "train_chunks": len(train_rows), "heldout_tokens": len(held) * s.seq_len,
                     "general_tokens": len(general) * s.seq_len, "seq_len": s.seq_len},
            "optimizer": {"name": "AdamW", "lr": s.lr, "warmup_steps": warmup, "batch": s.batch, "seed": s.seed},
            "compute_dtype": dtype,
            "steps_requested": s.steps, "steps_run": curve[-1]["step"], "kept_step": best[1], "stopped_early": stopped,
            "curve": curve, "heldout_ppl": {"base": curve[0]["heldout_ppl"], "adapted": best[0]},
            "general_ppl": {"base": curve[0]["general_ppl"],
                            "adapted": next(p["general_ppl"] for p in curve if p["step"] == best[1])},
            "answers": said, "train_s": round(train_s, 1), "command": ["python", "-m", "scripts.levers.lora.train", name],
            "git": git_state(), "versions": versions() | {"peft": _version("peft")}, "hardware": hardware(),
            "finished_at": now_utc().isoformat(timespec="seconds")}
    with paths.staged(s.adapter) as tmp:
        model.save_pretrained(tmp)
        (tmp / lora.CARD).write_text(json.dumps(card, indent=1) + "\n")
    record = write_record(card, record_dir or variant.path, "train_lora")
    print(f"wrote {paths.shown(s.adapter)}: held-out ppl {card['heldout_ppl']['base']} -> {best[0]} "
          f"(general {card['general_ppl']['base']} -> {card['general_ppl']['adapted']}) in {train_s:.0f} s; "
          f"record {paths.shown(record)}")
    return card


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def adapters_to_train(name: str) -> list[str]:
    """The variants whose adapters `name` needs: itself (LORA_ADAPTER), or for a multi-adapter variant the declaring
    variant of every adapter it serves that is missing."""
    variant = load_variant(name)
    if variant.resolved.get("LORA_ADAPTER"):
        return [name]
    served = lora.served_adapters(variant)
    if not served:
        raise lora.LoraError(f"{name} declares no adapter (LORA_ADAPTER) and serves none (SERVE_LORA_MODULES)")
    owners = {}
    for other in list_variants():
        path = load_variant(other).resolved.get("LORA_ADAPTER")
        if path:
            owners.setdefault(path, other)
    out = []
    for adapter, path in served.items():
        if path not in owners:
            raise lora.LoraError(f"{name}: adapter {adapter}={path}: no variant declares LORA_ADAPTER={path}")
        if not all((paths.ROOT / path / f).exists() for f in (*lora.ADAPTER_FILES, lora.CARD)):
            out.append(owners[path])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", nargs="?", help="a variant with LORA_ADAPTER, or one serving adapters")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key "
                   "(e.g. LORA_STEPS=5 LORA_ADAPTER=weights/lora/try: a short trial beside the real adapter)")
    args = p.parse_args(argv)
    if not args.variant:
        print("error: which variant? make train-lora VARIANT=<variant with LORA_ADAPTER>", file=sys.stderr)
        return 2
    try:
        todo = adapters_to_train(args.variant)
        if not todo:
            print(f"every adapter {args.variant} serves is trained")
        for name in todo:
            train(name, parse_overrides(args.set))
    except (VariantError, lora.LoraError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
