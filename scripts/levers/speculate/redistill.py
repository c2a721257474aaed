"""Distill a one-layer EAGLE-3 draft head against a target variant (self-distillation); vLLM serves it natively.

    python -m scripts.levers.speculate.redistill smollm2-bf16-eagle4                  # `make redistill VARIANT=…`
    python -m scripts.levers.speculate.redistill smollm2-bf16-eagle4 --budget tiny    # minutes on two CPU cores (tests, CI)
    python -m scripts.levers.speculate.redistill smollm2-int8sq-eagle4 --base-url http://127.0.0.1:8000   # target already served

The target is the variant's PARENT, frozen and served as it is (a quantized target stays quantized): its server
answers the training split of the speculation prompt set greedily (its own responses, not a dataset's), then
transformers runs the target's checkpoint over prompt + response to take the hidden states EAGLE-3 reads (three
auxiliary layers, vLLM's default ids, and the last layer before the final norm). The draft vocabulary is the
REDISTILL_DRAFT_VOCAB most frequent tokens of those responses (the coverage of several sizes is measured and kept).
The model, loss, vocabulary mapping and checkpoint format are speculators' (Eagle3DraftModel, the format vLLM loads
with {"method": "eagle3"}); the loop is this script's, because speculators' Trainer moves everything to an
accelerator device and fails on a CPU-only torch. Data is cached under .cache/redistill/<hash> (a rerun with the same
target and prompts reuses it); the head is written to a temp folder and renamed, with PROVENANCE.json: target variant
and model, data hash, steps, loss and accuracy curve, draft-vocabulary coverage, seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.loadgen import PromptSetError, greedy_ids, load_prompts
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, head_dir, load_variant, parse_overrides
from scripts.serve.launch import variant_server

TRAIN_PROMPTS = paths.EVAL / "prompts" / "spec-v1-train.jsonl"
# budget -> (prompts, max response tokens, optimizer steps); `full` is what the variant's REDISTILL_* keys say
# (tiny also takes no sampled responses: REDISTILL_SAMPLES is for `full`)
BUDGETS = {"tiny": (24, 48, 60), "full": (None, 128, None)}
DEFAULTS = {"REDISTILL_DRAFT_VOCAB": "auto", "REDISTILL_STEPS": "400", "REDISTILL_TTT_STEPS": "3",
            "REDISTILL_LR": "1e-3", "REDISTILL_SEED": "0", "REDISTILL_SAMPLES": "0", "REDISTILL_TEMPERATURE": "0.8"}
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
# REDISTILL_DRAFT_VOCAB=auto: the smallest COVERAGE_SIZES entry covering this share of the target's response tokens
# (a token outside the draft vocabulary can never be proposed, so this caps acceptance per position)
AUTO_COVERAGE = 0.98
PACK_TOKENS = 512  # tokens per optimizer step (sequences packed up to this length)
VAL_FRACTION = 0.1


class RedistillError(RuntimeError):
    pass


def aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 auxiliary layers (2, n/2, n-3): layer id L is the output of decoder layer L-1."""
    return [2, num_layers // 2, num_layers - 3]


def target_responses(target, rows: list[dict], max_tokens: int, cfg: dict, base_url: str | None, port: int) -> list[dict]:
    """The target's own answers: the greedy one and cfg["samples"] sampled at cfg["temperature"] per prompt (more
    of the target's distribution for the same prompts); prompt ids (chat template applied by the server) and
    response ids."""
    with variant_server(target, base_url=base_url, port=port, purpose="redistill") as (url, _):
        return greedy_ids(url, target.served_name, rows, max_tokens,
                          concurrency=target.max_num_seqs,
                          samples=cfg["samples"], temperature=cfg["temperature"], seed=cfg["seed"])


def write_hidden_states(model_dir: str, seqs: list[dict], out: Path) -> Counter:
    """speculators' offline layout: a datasets folder (input_ids, loss_mask, seq_len) and hidden_states/hs_<i>
    .safetensors holding [seq, 4, hidden] (three auxiliary layers, then the last layer before the final norm)."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    layers = aux_layer_ids(model.config.num_hidden_layers)
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    (out / "hidden_states").mkdir(parents=True)
    rows, freq = {"input_ids": [], "loss_mask": [], "seq_len": []}, Counter()
    try:
        for i, s in enumerate(tqdm(seqs, desc="hidden states", unit="seq")):
            ids = torch.tensor([s["prompt_ids"] + s["ids"]])
            with torch.no_grad():
                hs = model(ids.to(device), output_hidden_states=True).hidden_states
            stack = torch.stack([hs[layer][0] for layer in layers] + [captured["last"][0]], dim=1).cpu()
            mask = torch.zeros(ids.shape[1], dtype=torch.long)
            mask[len(s["prompt_ids"]):] = 1
            save_file({"token_ids": ids[0], "hidden_states": stack.to(torch.bfloat16).contiguous()},
                      str(out / "hidden_states" / f"hs_{i}.safetensors"))
            rows["input_ids"].append(ids[0].tolist())
            rows["loss_mask"].append(mask.tolist())
            rows["seq_len"].append(ids.shape[1])
            freq.update(s["ids"])
    finally:
        hook.remove()
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    return freq


def coverage(freq: Counter, sizes=COVERAGE_SIZES) -> dict[str, float]:
    """Share of response-token occurrences the N most frequent tokens cover."""
    total = sum(freq.values())
    counts = [c for _, c in freq.most_common()]
    return {str(n): sum(counts[:n]) / total for n in sizes}


def pack(lengths: list[int], order: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of `order` grouped so each group's total length fits `budget` (a longer one alone)."""
    groups, cur, used = [], [], 0
    for i in order:
        if cur and used + lengths[i] > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    return groups + ([cur] if cur else [])


def train(target_dir: str, hidden: int, data: Path, freq: Counter, cfg: dict, steps: int, seed: int):
    """speculators' Eagle3DraftModel trained on the cached data; returns (model, curve, validation accuracy)."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tqdm import tqdm
    from transformers import AutoConfig, LlamaConfig

    torch.manual_seed(seed)
    vcfg = AutoConfig.from_pretrained(target_dir)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), cfg["draft_vocab"], vcfg.vocab_size)
    layer_cfg = LlamaConfig(**{k: v for k, v in vcfg.to_dict().items()
                               if k not in ("architectures", "dtype", "_name_or_path", "quantization_config")})
    layer_cfg.num_hidden_layers, layer_cfg.tie_word_embeddings = 1, False
    ttt = cfg["ttt_steps"]
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=target_dir,
        target_layer_ids=aux_layer_ids(vcfg.num_hidden_layers), draft_vocab_size=cfg["draft_vocab"],
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=ttt, draft_attn_impl="sdpa")
    sets = {split: ArrowDataset(max_len=PACK_TOKENS, datapath=data, on_missing="raise", split=split,
                                train_ratio=1 - VAL_FRACTION, hidden_states_dtype=torch.float32)
            for split in ("train", "val")}
    collate = CollateFn(max_len=PACK_TOKENS, hidden_size=hidden, num_target_layers=3, dtype=torch.float32,
                        preprocess=shift_batch)
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    loss_cfg = resolve_loss_config("kl_div", "eager")  # the fused loss needs Triton

    def batches(split: str, rng: random.Random) -> list[list[int]]:
        ds = sets[split]
        lengths = [int(x) for x in ds.data["seq_len"]]
        order = list(range(len(lengths)))
        rng.shuffle(order)
        return pack(lengths, order, PACK_TOKENS)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)

    def run(split: str, group: list[int]):
        b = collate([sets[split][i] for i in group])
        # BF16 autocast on either device (speculators' own trainer autocasts on CUDA only; on a CPU with AMX or
        # AVX512-BF16 it is several times faster than FP32)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            return model(**{k: b[k].to(device) for k in keys}, ttt_steps=ttt, loss_config=loss_cfg)

    def accuracies(metrics) -> list[float]:
        return [float(metrics[f"cond_acc_{j}_sum"]) / max(float(metrics[f"cond_acc_{j}_total"]), 1.0)
                for j in range(ttt)]

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng, queue, curve = random.Random(seed), [], []
    model.train()
    bar = tqdm(range(steps), desc="train", unit="step")
    for step in bar:
        if not queue:
            queue = batches("train", rng)
        _, loss, metrics = run("train", queue.pop())
        if not torch.isfinite(loss):
            raise RedistillError(f"loss is {loss.item()} at step {step}: lower REDISTILL_LR")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == steps - 1:
            acc = accuracies(metrics)
            curve.append({"step": step, "loss": round(loss.item(), 4), "acc": [round(a, 4) for a in acc]})
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc[0]:.2f}")
    model.eval()
    sums = [0.0] * ttt
    totals = [0.0] * ttt
    with torch.no_grad():
        for group in batches("val", random.Random(seed)):
            _, _, metrics = run("val", group)
            for j in range(ttt):
                sums[j] += float(metrics[f"cond_acc_{j}_sum"])
                totals[j] += float(metrics[f"cond_acc_{j}_total"])
    return model, curve, [s / max(t, 1.0) for s, t in zip(sums, totals, strict=True)]


def cached_data(target, rows: list[dict], info: dict, max_tokens: int, cfg: dict, base_url: str | None,
                port: int) -> Path:
    """.cache/redistill/<hash of target, prompts, length, sampling>: responses + hidden states, built once (temp
    dir, rename)."""
    sampling = [cfg["samples"], cfg["temperature"], cfg["seed"]] if cfg["samples"] else []
    key = hashlib.sha256(json.dumps([target.name, target.resolved["MODEL"], info["prompt_set_sha256"], len(rows),
                                     max_tokens, *sampling]).encode()).hexdigest()[:16]
    data = paths.CACHE / "redistill" / key
    if (data / "responses.json").exists():
        print(f"reusing {paths.shown(data)}")
        return data
    seqs = target_responses(target, rows, max_tokens, cfg, base_url, port)
    data.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=data.parent))
    try:
        freq = write_hidden_states(target.model, seqs, tmp / "data")
        (tmp / "data" / "responses.json").write_text(json.dumps({"seqs": seqs, "freq": freq}))
        shutil.rmtree(data, ignore_errors=True)
        (tmp / "data").rename(data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"cached {len(seqs)} responses and hidden states in {paths.shown(data)}")
    return data


def drop_frozen_embedding(model, head: Path) -> None:
    """Remove the head's input embedding from the checkpoint when training kept it frozen: it is then the target's
    own, and vLLM shares the target's embedding with a head that has none (llm_base_proposer._maybe_share_embeddings),
    which it also does when the two are equal. The SmolLM2 head shrinks from 72 MB to ~15 MB."""
    from safetensors.torch import load_file, save_file

    if model.embed_tokens.weight.requires_grad:
        return
    for shard in head.glob("*.safetensors"):
        tensors = load_file(shard)
        if tensors.pop("embed_tokens.weight", None) is not None:
            save_file(tensors, str(shard), metadata={"format": "pt"})


def settings_of(variant) -> dict:
    r = {**DEFAULTS, **{k: v for k, v in variant.resolved.items() if k.startswith("REDISTILL_")}}
    try:
        vocab = r["REDISTILL_DRAFT_VOCAB"]
        return {"draft_vocab": vocab if vocab == "auto" else int(vocab), "steps": int(r["REDISTILL_STEPS"]),
                "ttt_steps": int(r["REDISTILL_TTT_STEPS"]), "lr": float(r["REDISTILL_LR"]),
                "seed": int(r["REDISTILL_SEED"]), "samples": int(r["REDISTILL_SAMPLES"]),
                "temperature": float(r["REDISTILL_TEMPERATURE"])}
    except ValueError as e:
        raise RedistillError(f"{variant.path / 'config.env'}: a REDISTILL_* value is not a number ({e})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a speculative variant whose SERVE_SPECULATIVE_CONFIG names the head to write")
    p.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    p.add_argument("--prompts", type=Path, default=TRAIN_PROMPTS)
    p.add_argument("--steps", type=int, help="optimizer steps (default: the budget's, else REDISTILL_STEPS)")
    p.add_argument("--base-url", help="the target's running server (default: start it)")
    p.add_argument("--port", type=int, default=8127)
    p.add_argument("--out", type=Path, help="write the head here instead of the variant's head folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        out = args.out or head_dir(variant)
        if out is None:
            raise RedistillError(f"{variant.name}: SERVE_SPECULATIVE_CONFIG names no eagle3 head under weights/")
        if not variant.resolved.get("PARENT"):
            raise RedistillError(f"{variant.name} has no PARENT: the target to distill from")
        target = load_variant(variant.resolved["PARENT"])
        if not Path(target.model).is_dir():
            raise RedistillError(f"{target.resolved['MODEL']} does not exist: build {target.name} first")
        cfg = settings_of(variant)
        n_prompts, max_tokens, steps = BUDGETS[args.budget]
        if args.budget == "tiny":
            cfg["samples"] = 0
        steps = args.steps or steps or cfg["steps"]
        rows, info = load_prompts(args.prompts, n_prompts)
        data = cached_data(target, rows, info, max_tokens, cfg, args.base_url, args.port)
        cached = json.loads((data / "responses.json").read_text())
        freq = Counter({int(k): v for k, v in cached["freq"].items()})
        from transformers import AutoConfig

        tcfg = AutoConfig.from_pretrained(target.model)
        cov = coverage(freq)
        if cfg["draft_vocab"] == "auto":
            auto = next((n for n in COVERAGE_SIZES if cov[str(n)] >= AUTO_COVERAGE), COVERAGE_SIZES[-1])
            cfg["draft_vocab"] = min(auto, tcfg.vocab_size)
        if cfg["draft_vocab"] > tcfg.vocab_size or cfg["draft_vocab"] < 16:
            raise RedistillError(f"REDISTILL_DRAFT_VOCAB={cfg['draft_vocab']}: must lie in 16..{tcfg.vocab_size}")
        model, curve, val_acc = train(target.model, tcfg.hidden_size, data, freq, cfg, steps, cfg["seed"])
    except (RedistillError, VariantError, PromptSetError, ServerError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.to(torch.bfloat16).save_pretrained(tmp)
        drop_frozen_embedding(model, tmp)
        data_sha = hashlib.sha256((data / "responses.json").read_bytes()).hexdigest()
        (tmp / "PROVENANCE.json").write_text(json.dumps({
            "lever": "redistill_mtp (EAGLE-3 via speculators)", "variant": variant.name, "target": target.name,
            "target_model": target.resolved["MODEL"], "target_hidden_size": tcfg.hidden_size,
            "target_vocab_size": tcfg.vocab_size, "aux_layer_ids": aux_layer_ids(tcfg.num_hidden_layers),
            "prompts": info, "budget": args.budget, "responses": len(cached["seqs"]), "max_tokens": max_tokens,
            "response_tokens": sum(freq.values()), "data_sha256": data_sha, "settings": cfg, "steps": steps,
            "pack_tokens": PACK_TOKENS, "curve": curve, "val_cond_acc": [round(a, 4) for a in val_acc],
            "draft_vocab_coverage": cov, "seconds": round(time.monotonic() - t0, 1)}, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"validation accuracy per draft position {[round(a, 3) for a in val_acc]}; "
          f"draft vocab {cfg['draft_vocab']} covers {coverage(freq, (cfg['draft_vocab'],))[str(cfg['draft_vocab'])]:.1%}")
    print(f"wrote {paths.shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
