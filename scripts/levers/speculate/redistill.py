"""Distill a one-layer EAGLE-3 draft head against a target variant (self-distillation); vLLM serves it natively.

    python -m scripts.levers.speculate.redistill smollm2-bf16-eagle4                  # `make redistill VARIANT=…`
    python -m scripts.levers.speculate.redistill smollm2-bf16-eagle4 --budget tiny    # minutes on two CPU cores (tests, CI)
    python -m scripts.levers.speculate.redistill smollm2-int8sq-eagle4 --base-url http://127.0.0.1:8000   # target already served

The target is the variant's PARENT, frozen and served as it is (a quantized target stays quantized): its server
answers the prompt set (REDISTILL_PROMPTS, default spec-v1-train; spec-v2 is BIG-bench at scale, built by
`python -m scripts.levers.speculate.prompts --scale` and pinned by REDISTILL_PROMPT_SHA256) greedily plus
REDISTILL_SAMPLES sampled answers per prompt (its own responses, not a dataset's). Those answers (token ids) are
cached in .cache/redistill/<hash>/responses.json, so a rerun with the same target and prompts reuses them and a
failed training keeps them (`--generate-only` stops there). Training runs transformers on the target's checkpoint
over each drawn batch to take the hidden states EAGLE-3 reads (three auxiliary layers, vLLM's default ids, and the
last layer before the final norm): computed as batches are drawn, kept in memory for later passes up to
REDISTILL_FEATURE_CACHE_MB, never written to disk, and no `datasets` object (its fingerprinting failed under the GPU
machine's Python 3.12). Training runs in BF16 on CUDA and on a CPU with native BF16, FP32 elsewhere
(hardware.training_dtype). The prompt set's split column keeps validation
answers to source families never trained on (without one, one prompt in ten); REDISTILL_MAX_TRAIN_TOKENS keeps the
first N training response tokens of a fixed order (nested subsets for a learning curve). The draft vocabulary is the
REDISTILL_DRAFT_VOCAB most frequent tokens of the training answers (the coverage of several sizes is measured and
kept). REDISTILL_INIT=<head folder> goes on training an earlier head of the same answers (its weights, a fresh
optimizer and schedule; refused when its shapes or draft vocabulary differ): a later GPU lease continues where one
ended. With REDISTILL_DRAFT_VOCAB=init the head keeps REDISTILL_INIT's draft vocabulary instead, so a head goes on
training against another target of the same tokenizer (a quantized sibling's own answers and hidden states).
REDISTILL_SNAPSHOT_EVERY=<seconds> writes the head as it stands to <out>.snapshot that often while it trains
(PROVENANCE says "snapshot": true and the steps so far; removed once the head is written): a run that fails or a
machine that is lost keeps the last one, and REDISTILL_INIT goes on from it. Launched by `python -m
torch.distributed.run --nproc-per-node N -m …` it trains one head data-parallel in N processes (gradients averaged
through gloo, rank 0 writes), once the answers are cached. The model, loss, vocabulary mapping, collation and
checkpoint format are speculators' (Eagle3DraftModel, the format vLLM loads with {"method": "eagle3"}); the loop is
this script's, because speculators' Trainer moves everything to an accelerator device and fails on a CPU-only
torch. The head is written to a temp folder and renamed, with PROVENANCE.json: target variant and model, prompt set
and its hash, answers' hash, token counts per split, steps, passes, loss and accuracy curve, validation accuracy,
draft-vocabulary coverage, seconds.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.hardware import training_dtype
from scripts.common.loadgen import PromptSetError, greedy_ids, load_prompts
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, head_dir, load_variant, missing_model, parse_overrides
from scripts.serve.launch import variant_server

TRAIN_PROMPTS = paths.EVAL / "prompts" / "spec-v1-train.jsonl"
# budget -> (prompts, max response tokens, optimizer steps); `full` is what the variant's REDISTILL_* keys say
# (tiny also takes no sampled responses: REDISTILL_SAMPLES is for `full`)
BUDGETS = {"tiny": (24, 48, 30), "full": (None, 128, None)}
DEFAULTS = {"REDISTILL_DRAFT_VOCAB": "auto", "REDISTILL_STEPS": "400", "REDISTILL_TTT_STEPS": "3",
            "REDISTILL_LR": "1e-3", "REDISTILL_SEED": "0", "REDISTILL_SAMPLES": "0", "REDISTILL_TEMPERATURE": "0.8",
            "REDISTILL_PACK_TOKENS": "512", "REDISTILL_LAYERS": "1", "REDISTILL_MAX_TRAIN_TOKENS": "",
            "REDISTILL_MAX_SECONDS": "", "REDISTILL_ATTN": "", "REDISTILL_LOSS": "", "REDISTILL_EVAL_EVERY": "0",
            "REDISTILL_EVAL_PACKS": "8", "REDISTILL_INIT": "", "REDISTILL_FEATURE_CACHE_MB": "2048",
            "REDISTILL_SNAPSHOT_EVERY": ""}
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
# REDISTILL_DRAFT_VOCAB=auto: the smallest COVERAGE_SIZES entry covering this share of the target's response tokens
# (a token outside the draft vocabulary can never be proposed, so this caps acceptance per position)
AUTO_COVERAGE = 0.98
VAL_FRACTION = 0.1
# a head's weights are written in shards of at most this size: files git takes (the before-stop check flags 20 MB)
MAX_SHARD_BYTES = 19_000_000


class RedistillError(RuntimeError):
    pass


def aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 auxiliary layers (2, n/2, n-3): layer id L is the output of decoder layer L-1."""
    return [2, num_layers // 2, num_layers - 3]


def target_responses(target, rows: list[dict], max_tokens: int, cfg: dict, base_url: str | None, port: int,
                     concurrency: int) -> list[dict]:
    """The target's own answers: the greedy one and cfg["samples"] sampled at cfg["temperature"] per prompt (more
    of the target's distribution for the same prompts); prompt ids (chat template applied by the server), response
    ids, and the prompt's split (train | val) and group."""
    split = splits_of(rows)
    with variant_server(target, base_url=base_url, port=port, purpose="redistill") as (url, _):
        seqs = greedy_ids(url, target.served_name, rows, max_tokens, concurrency=concurrency,
                          samples=cfg["samples"], temperature=cfg["temperature"], seed=cfg["seed"])
    return [{"id": s["id"], "sample": s["sample"], "split": split[s["id"]][0], "group": split[s["id"]][1],
             "prompt_ids": s["prompt_ids"], "ids": s["ids"]} for s in seqs]


def splits_of(rows: list[dict]) -> dict[str, tuple[str, str]]:
    """prompt id -> (split, group): the set's own split column where it names a `val` split (spec-v2), else by id."""
    own = any(r.get("split") == "val" for r in rows)
    return {r["id"]: (r["split"] if own else split_of(r["id"]), r.get("group", "")) for r in rows}


def split_of(prompt_id: str) -> str:
    """A prompt set without a validation split (spec-v1-train): one prompt in ten is validation, by its id's hash."""
    return "val" if hashlib.sha256(prompt_id.encode()).digest()[0] < round(256 * VAL_FRACTION) else "train"


def select(seqs: list[dict], split: str, max_tokens: int | None) -> list[dict]:
    """The sequences of one split in a fixed pseudo-random order (sha256 of id and sample), cut once their response
    tokens reach max_tokens: the nested subsets a learning curve trains on."""
    out, total = [], 0
    for s in sorted((s for s in seqs if s.get("split", "train") == split),
                    key=lambda s: hashlib.sha256(f"{s['id']}/{s.get('sample', 0)}".encode()).digest()):
        if max_tokens is not None and total >= max_tokens:
            break
        if s["ids"]:
            out.append(s)
            total += len(s["ids"])
    return out


class Features:
    """The target's hidden states for EAGLE-3, computed as batches are drawn (nothing written to disk: 27k prompts
    with three answers each would be ~80 GB of [seq, 4, hidden] states): three auxiliary layers and the last layer
    before the final norm, in the sample layout of speculators' datasets ([seq, 3*hidden] and [seq, hidden])."""

    def __init__(self, model_dir: str, device: str, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device, dtype).eval()
        self.layers = aux_layer_ids(self.model.config.num_hidden_layers)
        self.captured = {}
        self.model.model.layers[-1].register_forward_hook(
            lambda _m, _i, o: self.captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))

    def samples(self, seqs: list[dict], max_len: int) -> list[dict]:
        """One sample per sequence (prompt + response, cut to max_len): the target run over padded batches of
        similar lengths (sub_batches), each no larger than max_len tokens padded."""
        ids = [(s["prompt_ids"] + s["ids"])[:max_len] for s in seqs]
        out = [None] * len(seqs)
        for group in sub_batches([len(x) for x in ids], max_len):
            for i, sample in zip(group, self.run([seqs[i] for i in group], [ids[i] for i in group]), strict=True):
                out[i] = sample
        return out

    def run(self, seqs: list[dict], ids: list[list[int]]) -> list[dict]:
        import torch

        width = max(len(x) for x in ids)
        batch = torch.zeros(len(ids), width, dtype=torch.long)
        attn = torch.zeros(len(ids), width, dtype=torch.long)
        for i, x in enumerate(ids):
            batch[i, :len(x)] = torch.tensor(x)
            attn[i, :len(x)] = 1
        with torch.no_grad():
            hs = self.model(batch.to(self.device), attention_mask=attn.to(self.device), output_hidden_states=True,
                            logits_to_keep=1).hidden_states
        out = []
        for i, (s, x) in enumerate(zip(seqs, ids, strict=True)):
            n = len(x)
            mask = torch.zeros(n, dtype=torch.long)
            mask[min(len(s["prompt_ids"]), n):] = 1
            out.append({"hidden_states": torch.cat([hs[layer][i, :n] for layer in self.layers], dim=-1),
                        "input_ids": torch.tensor(x, device=self.device),
                        # a copy, not a view: a kept sample must not hold its whole padded batch alive
                        "verifier_last_hidden_states": self.captured["last"][i, :n].clone(),
                        "loss_mask": mask.to(self.device),
                        "lengths": torch.tensor([n], dtype=torch.long),
                        "position_ids": torch.arange(n, dtype=torch.long, device=self.device)})
        return out


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


def sub_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped by length so each group's padded batch (its size times its longest) fits `budget` tokens: the
    target runs over a pack's sequences as padded batches, and one long prompt among short ones multiplied a
    pack's cost (prompts of spec-v2 run from 20 to 4,000 tokens)."""
    groups, cur = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + ([cur] if cur else [])


class FeatureCache:
    """Samples of the target's hidden states kept across passes (split, index) up to a byte budget; the rest are
    computed again when drawn. A small budget's whole data fits, so the target runs once per answer."""

    def __init__(self, feats: Features, sets: dict[str, list[dict]], max_len: int, budget_bytes: int):
        self.feats, self.sets, self.max_len, self.left, self.kept = feats, sets, max_len, budget_bytes, {}

    def samples(self, split: str, group: list[int]) -> list[dict]:
        missing = [i for i in group if (split, i) not in self.kept]
        fresh = dict(zip(missing, self.feats.samples([self.sets[split][i] for i in missing], self.max_len),
                         strict=True)) if missing else {}
        for i, sample in fresh.items():
            size = sum(t.numel() * t.element_size() for t in sample.values())
            if size <= self.left:
                self.kept[(split, i)], self.left = sample, self.left - size
        return [fresh[i] if i in fresh else self.kept[(split, i)] for i in group]


def draft_layer_config(vcfg, layers: int):
    """The head's decoder layer as a Llama layer of the target's sizes. A Llama target's config is taken whole; of
    another (Gemma 3) its sizes and the full-attention layers' rotary settings, with SiLU: the head is a Llama layer
    (vLLM's EAGLE-3 Llama layer supports SiLU only), and the target's per-layer-type rope, sliding windows and
    activation are not a Llama layer's."""
    from transformers import LlamaConfig

    if vcfg.model_type == "llama":
        out = LlamaConfig(**{k: v for k, v in vcfg.to_dict().items()
                             if k not in ("architectures", "dtype", "_name_or_path", "quantization_config")})
    else:
        rope = getattr(vcfg, "rope_parameters", None) or {}
        out = LlamaConfig(hidden_size=vcfg.hidden_size, intermediate_size=vcfg.intermediate_size,
                          num_attention_heads=vcfg.num_attention_heads, num_key_value_heads=vcfg.num_key_value_heads,
                          head_dim=vcfg.head_dim, rms_norm_eps=vcfg.rms_norm_eps, vocab_size=vcfg.vocab_size,
                          max_position_embeddings=vcfg.max_position_embeddings,
                          hidden_act="silu",
                          rope_parameters=dict(rope.get("full_attention", rope)) or None)
    out.num_hidden_layers, out.tie_word_embeddings = layers, False
    return out


def implementation(device: str, cfg: dict) -> tuple[str, str]:
    """(draft attention, loss implementation): flex attention with block masks (speculators' GPU path) on CUDA, dense
    SDPA masks on a CPU (no Triton there); the eager loss on both (speculators 0.9's fused Triton loss failed in
    its backward kernel on the H100 under torch 2.11). REDISTILL_ATTN and REDISTILL_LOSS force either."""
    attn = cfg.get("attn") or ("simple_flex_attention" if device == "cuda" else "sdpa")
    return attn, cfg.get("loss") or "eager"


def train(target_dir: str, hidden: int, sets: dict[str, list[dict]], freq: Counter, cfg: dict, steps: int, seed: int,
          snapshot=None, vocab_map=None):
    """speculators' Eagle3DraftModel trained on the target's answers (sets: train, val) for `steps` optimizer steps or
    cfg["max_seconds"], whichever ends first (the cosine schedule follows whichever is further along). Every
    cfg["eval_every"] steps the accuracy on the first cfg["eval_packs"] validation packs joins the curve (with the
    response tokens trained on so far): the curve shows whether the head is still learning. Every
    cfg["snapshot_every"] seconds snapshot(model, curve, steps taken, passes started) is called. Returns (model, curve,
    validation accuracy per draft position on the whole validation split, passes started, steps taken). With N
    data-parallel ranks (cfg["ranks"]) each step trains on N packs; the curve's loss and accuracy are rank 0's pack,
    and a rank above 0 returns no validation accuracy."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.utils import GEMMA_STYLE_FINAL_NORM_MODEL_TYPES
    from speculators.train.data import CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from tqdm import tqdm
    from transformers import AutoConfig

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    attn, loss_impl = implementation(device, cfg)
    vcfg = AutoConfig.from_pretrained(target_dir)
    # vocab_map: REDISTILL_DRAFT_VOCAB=init's (d2t, t2d), else the most frequent tokens of these answers
    d2t, t2d = vocab_map or build_vocab_mappings_from_distribution(dict(freq), cfg["draft_vocab"], vcfg.vocab_size)
    layer_cfg = draft_layer_config(vcfg, cfg["layers"])
    ttt, max_len = cfg["ttt_steps"], cfg["pack_tokens"]
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=target_dir,
        target_layer_ids=aux_layer_ids(vcfg.num_hidden_layers), draft_vocab_size=cfg["draft_vocab"],
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=ttt, draft_attn_impl=attn)
    if vcfg.model_type in GEMMA_STYLE_FINAL_NORM_MODEL_TYPES:
        # the frozen copy of the target's final norm is a Llama one (x * w) loaded with Gemma's weight, whose gain is
        # 1 + w: the target logits the head is distilled against need the 1
        with torch.no_grad():
            model.verifier_norm.weight += 1
    if cfg.get("init"):  # PROVENANCE's settings keep what the head started from
        cfg["warm_start"] = warm_start(model, Path(cfg["init"]))
    collate = CollateFn(max_len=max_len, hidden_size=hidden, num_target_layers=3, dtype=torch.float32,
                        preprocess=shift_batch)
    # BF16 on CUDA and where the CPU has native BF16, else FP32: on a two-core AVX2 CPU a tiny-budget step took 47 s
    # with BF16 and 12 s in FP32, both while a compile shared the cores (the target's BF16 weights upcast, so its
    # hidden states differ from the served model's by BF16 rounding only); PROVENANCE's settings say which
    cfg["compute_dtype"] = training_dtype(device)
    bf16 = cfg["compute_dtype"] == "bfloat16"
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    loss_cfg = resolve_loss_config("kl_div", loss_impl)
    feats = Features(target_dir, device, torch.bfloat16 if bf16 else torch.float32)
    cache = FeatureCache(feats, sets, max_len, cfg["feature_cache_mb"] << 20)
    model.to(device, None if bf16 else torch.float32)
    print(f"training on {device} in {cfg['compute_dtype']}: draft attention {attn}, {loss_impl} loss, {max_len} "
          f"tokens a pack", flush=True)

    def batches(split: str, rng: random.Random) -> list[list[int]]:
        lengths = [min(len(s["prompt_ids"]) + len(s["ids"]), max_len) for s in sets[split]]
        order = list(range(len(lengths)))
        rng.shuffle(order)
        return pack(lengths, order, max_len)

    def run(split: str, group: list[int]):
        b = collate(cache.samples(split, group))
        # BF16 autocast where compute_dtype says so (speculators' own trainer autocasts on CUDA only; on a CPU with
        # AMX or AVX512-BF16 it is several times faster than FP32)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            return model(**{k: b[k].to(device) for k in keys}, ttt_steps=ttt, loss_config=loss_cfg)

    def accuracies(*metrics) -> list[float]:  # per draft position, pooled over the given batches' metrics
        return [sum(float(m[f"cond_acc_{j}_sum"]) for m in metrics) /
                max(sum(float(m[f"cond_acc_{j}_total"]) for m in metrics), 1.0) for j in range(ttt)]

    def validate(packs: list[list[int]]) -> list[float]:
        model.eval()
        with torch.no_grad():
            metrics = [run("val", group)[2] for group in packs]
        model.train()
        return accuracies(*metrics)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"])
    t0, limit, elapsed = time.monotonic(), cfg.get("max_seconds") or math.inf, 0.0
    world, rank = ranks()

    def progress(s: int) -> float:  # of the step budget or of the time budget, whichever is further along
        return min(1.0, max(s / steps, elapsed / limit))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * progress(s))))
    val_packs = batches("val", random.Random(seed))
    probe = val_packs[:cfg["eval_packs"]]
    rng, queue, curve, epochs, done, seen = random.Random(seed), [], [], 0, 0, 0
    last_snapshot = time.monotonic()
    model.train()
    bar = tqdm(range(steps), desc="train", unit="step", mininterval=10, disable=rank > 0)
    for step in bar:
        if elapsed > limit:
            curve.append({"step": step, "stopped": f"time budget of {limit:.0f} s spent"})
            break
        if len(queue) < world:  # every rank draws the same packs (one seed) and trains on its own one of each `world`;
            # a pass's last packs, fewer than `world`, are left out
            queue, epochs = batches("train", rng), epochs + 1
            if len(queue) < world:
                raise RedistillError(f"one pass makes {len(queue)} packs of {max_len} tokens, fewer than the {world} "
                                     "data-parallel ranks: use fewer ranks or a smaller REDISTILL_PACK_TOKENS")
        groups = [queue.pop() for _ in range(world)]
        _, loss, metrics = run("train", groups[rank])
        if not torch.isfinite(loss):
            raise RedistillError(f"loss is {loss.item()} at step {step}: lower REDISTILL_LR")
        opt.zero_grad()
        loss.backward()
        # the ranks' mean gradient; rank 0's clock is every rank's, so schedule and time budget agree
        elapsed = average_gradients(params, time.monotonic() - t0, world) if world > 1 else time.monotonic() - t0
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        done += 1
        seen += sum(len(sets["train"][i]["ids"]) for group in groups for i in group)
        evaluate = bool(cfg["eval_every"] and step and step % cfg["eval_every"] == 0 and rank == 0)
        if step % 20 == 0 or step == steps - 1 or evaluate:
            acc = accuracies(metrics)
            point = {"step": step, "seconds": round(time.monotonic() - t0, 1), "response_tokens": seen,
                     "loss": round(loss.item(), 4), "acc": [round(a, 4) for a in acc]}
            if evaluate:
                point["val_acc"] = [round(a, 4) for a in validate(probe)]
                print(f"step {step}: {seen:,} response tokens, validation accuracy {point['val_acc']}", flush=True)
            curve.append(point)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc[0]:.2f}")
        if snapshot and cfg["snapshot_every"] and time.monotonic() - last_snapshot >= cfg["snapshot_every"]:
            snapshot(model, curve, done, epochs)
            last_snapshot = time.monotonic()
    if world > 1:
        import torch.distributed as dist

        same_weights(params)
        dist.destroy_process_group()
        if rank > 0:
            return model, curve, None, epochs, done
    return model, curve, validate(val_packs), epochs, done


def ranks() -> tuple[int, int]:
    """(world size, rank) of a data-parallel run launched by `python -m torch.distributed.run --nproc-per-node N -m
    scripts.levers.speculate.redistill …` (RANKS=N in scripts/gpu/device.sh); (1, 0) otherwise. The ranks share one
    device: the loop is bound by each process's host work, not by the GPU (results/spec-scale-20261125d/README.md)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def average_gradients(params: list, seconds: float, world: int) -> float:
    """All-reduce the gradients (their mean lands in every rank's .grad) through gloo on the host, since NCCL refuses
    two ranks on one GPU; rank 0's `seconds` travels in the same buffer and is returned on every rank."""
    import torch
    import torch.distributed as dist

    rank = ranks()[1]
    flat = torch.cat([p.grad.reshape(-1).float() for p in params]).cpu()
    flat = torch.cat([flat / world, torch.tensor([seconds if rank == 0 else 0.0])])
    dist.all_reduce(flat)
    i = 0
    for p in params:
        p.grad.copy_(flat[i:i + p.numel()].view_as(p.grad))
        i += p.numel()
    return float(flat[-1])


def same_weights(params: list) -> None:
    """Refuse a data-parallel run whose ranks ended with different weights (different initial weights, or a step
    that is not deterministic across processes)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([sum(float(p.detach().double().sum()) for p in params)], dtype=torch.float64)
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if float(low) != float(high):
        raise RedistillError(f"the data-parallel ranks ended with different weights ({float(low)} vs {float(high)})")


def sampling_of(cfg: dict) -> list:
    return [cfg["samples"], cfg["temperature"], cfg["seed"]] if cfg["samples"] else []


def answers_dir(target, info: dict, n_rows: int, max_tokens: int, cfg: dict) -> Path:
    """.cache/redistill/<hash of target, prompts, length, sampling>: one folder per generation."""
    key = hashlib.sha256(json.dumps([target.name, target.resolved["MODEL"], info["prompt_set_sha256"], n_rows,
                                     max_tokens, *sampling_of(cfg)]).encode()).hexdigest()[:16]
    return paths.CACHE / "redistill" / key


def cached_data(target, rows: list[dict], info: dict, max_tokens: int, cfg: dict, base_url: str | None,
                port: int, concurrency: int) -> Path:
    """.cache/redistill/<hash of target, prompts, length, sampling>/responses.json: the target's answers (token
    ids), generated once (temp file, rename); a rerun with the same target and prompts reuses them."""
    data, sampling = answers_dir(target, info, len(rows), max_tokens, cfg), sampling_of(cfg)
    if (data / "responses.json").exists():
        print(f"reusing {paths.shown(data)}")
        return data
    t0 = time.monotonic()
    seqs = target_responses(target, rows, max_tokens, cfg, base_url, port, concurrency)
    freq = Counter(t for s in seqs if s["split"] == "train" for t in s["ids"])
    data.mkdir(parents=True, exist_ok=True)
    tmp = data / ".responses.json.tmp"
    tmp.write_text(json.dumps({"prompts": info, "target": target.name, "max_tokens": max_tokens,
                               "sampling": sampling, "seconds": round(time.monotonic() - t0, 1),
                               "seqs": seqs, "freq": freq}))
    tmp.rename(data / "responses.json")
    print(f"cached {len(seqs):,} responses ({sum(len(s['ids']) for s in seqs):,} tokens) in {paths.shown(data)} "
          f"after {time.monotonic() - t0:.0f} s")
    return data


def export_answers(data: Path, out: Path) -> None:
    """The cached answers as one compressed array file (token ids as uint16 where the vocabulary allows, each
    prompt's ids once: ~10x smaller than responses.json): what the GPU machine sends back, and what `--answers`
    unpacks on another machine."""
    import numpy as np

    cached = json.loads((data / "responses.json").read_text())
    seqs = cached.pop("seqs")
    prompts = {}
    for s in seqs:
        prompts.setdefault(s["id"], s["prompt_ids"])
    meta = {**cached, "key": data.name, "ids": [s["id"] for s in seqs], "sample": [s["sample"] for s in seqs],
            "split": [s.get("split", "") for s in seqs], "group": [s.get("group", "") for s in seqs], "prompt_order": list(prompts)}
    flat = [t for s in seqs for t in s["ids"]]
    dtype = np.uint16 if max(flat + [t for x in prompts.values() for t in x], default=0) < 2**16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.npz")
    np.savez_compressed(tmp, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                        prompt_lengths=np.array([len(x) for x in prompts.values()], dtype=np.uint32),
                        prompt_ids=np.array([t for x in prompts.values() for t in x], dtype=dtype),
                        lengths=np.array([len(s["ids"]) for s in seqs], dtype=np.uint32),
                        ids=np.array(flat, dtype=dtype))
    tmp.rename(out)
    print(f"wrote {paths.shown(out)}: {len(seqs):,} answers, {out.stat().st_size / 2**20:.1f} MiB")


def import_answers(path: Path, want: Path | None = None) -> Path:
    """Unpack an `export_answers` file into .cache/redistill/<its key>/responses.json (temp file, rename); with
    `want`, a file whose key names another folder (another target, prompt set or sampling) is refused before
    anything is written."""
    import numpy as np

    try:
        z = np.load(path)
        meta = json.loads(z["meta"].tobytes())
        plen, pids, lens, ids = (z[k].tolist() for k in ("prompt_lengths", "prompt_ids", "lengths", "ids"))
    except (OSError, KeyError, ValueError) as e:
        raise RedistillError(f"{path}: not an answers file written by --export-answers ({e})") from None
    starts = [0]
    for n in plen:
        starts.append(starts[-1] + n)
    prompt = {pid: pids[starts[i]:starts[i + 1]] for i, pid in enumerate(meta.pop("prompt_order"))}
    seqs, at = [], 0
    for i, n in enumerate(lens):
        seqs.append({"id": meta["ids"][i], "sample": meta["sample"][i], "split": meta["split"][i],
                     "group": meta["group"][i], "prompt_ids": prompt[meta["ids"][i]], "ids": ids[at:at + n]})
        at += n
    data = paths.CACHE / "redistill" / meta.pop("key")
    if want is not None and data != want:
        raise RedistillError(f"{path} holds answers for another target, prompt set or sampling ({data.name}, "
                             f"expected {want.name})")
    data.mkdir(parents=True, exist_ok=True)
    for k in ("ids", "sample", "split", "group"):
        meta.pop(k)
    tmp = data / ".responses.json.tmp"
    tmp.write_text(json.dumps({**meta, "seqs": seqs}))
    tmp.rename(data / "responses.json")
    print(f"unpacked {len(seqs):,} answers ({len(ids):,} response tokens) into {paths.shown(data)}")
    return data


def init_vocab(head: Path, vocab_size: int) -> tuple:
    """REDISTILL_DRAFT_VOCAB=init: the draft vocabulary (d2t, t2d) of the head REDISTILL_INIT names, checked against
    the target's vocabulary size."""
    from safetensors import safe_open

    maps = {}
    for shard in sorted(head.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names = set(f.keys())
            maps.update({k: f.get_tensor(k) for k in ("d2t", "t2d") if k in names})
    if set(maps) != {"d2t", "t2d"}:
        raise RedistillError(f"REDISTILL_INIT={head}: no draft vocabulary (d2t, t2d) in its *.safetensors")
    if maps["t2d"].numel() != vocab_size:
        raise RedistillError(f"REDISTILL_INIT={head}: its draft vocabulary maps {maps['t2d'].numel():,} target tokens, "
                             f"this target has {vocab_size:,}")
    return maps["d2t"], maps["t2d"]


def warm_start(model, head: Path) -> dict:
    """Load an earlier head's weights into `model` (REDISTILL_INIT: training goes on from there, with a fresh
    optimizer and schedule). Refused unless it is a head of the same shapes and the same draft vocabulary (d2t, t2d:
    the same training answers and REDISTILL_DRAFT_VOCAB give the same mapping); the input embedding a head leaves
    out stays the target's. Returns what PROVENANCE records of it."""
    from safetensors.torch import load

    try:  # each shard read once: loaded and hashed (in name order) for PROVENANCE
        raws = [f.read_bytes() for f in sorted(head.glob("*.safetensors"))]
        if not raws:
            raise OSError("no *.safetensors")
        weights = {k: t for raw in raws for k, t in load(raw).items()}
        prior = json.loads((head / "PROVENANCE.json").read_text())
    except (OSError, ValueError) as e:
        raise RedistillError(f"REDISTILL_INIT={head}: not a head written by redistill ({e})") from None
    own = model.state_dict()
    for name in ("d2t", "t2d"):
        if name not in weights or weights[name].shape != own[name].shape or not bool((weights[name] == own[name]).all()):
            raise RedistillError(f"REDISTILL_INIT={head}: its draft vocabulary ({name}) differs from this training's "
                                 "(other answers or REDISTILL_DRAFT_VOCAB)")
    wrong = sorted(k for k, t in weights.items() if k not in own or own[k].shape != t.shape)
    missing = sorted(k for k in own if k not in weights and k != "embed_tokens.weight" and not k.startswith("verifier"))
    if wrong or missing:
        raise RedistillError(f"REDISTILL_INIT={head}: tensors that do not fit this head: {(wrong + missing)[:4]}")
    model.load_state_dict({k: t.to(own[k].dtype) for k, t in weights.items()}, strict=False)
    return {"head": str(head), "model_sha256": hashlib.sha256(b"".join(raws)).hexdigest(),
            "steps": prior.get("steps"), "total_steps": prior.get("total_steps", prior.get("steps")),
            "val_cond_acc": prior.get("val_cond_acc"), "data_sha256": prior.get("data_sha256")}


def write_head(model, dest: Path, provenance: dict) -> None:
    """The head in BF16 (the model is converted in place: pass a copy to go on training), without the frozen
    input embedding, and its PROVENANCE.json, written all at once to dest."""
    import torch

    with paths.staged(dest) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        drop_frozen_embedding(model, tmp)
        shard_weights(tmp, MAX_SHARD_BYTES)
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=1))


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


def shard_weights(head: Path, max_bytes: int) -> None:
    """A model.safetensors over max_bytes split, whole tensors in name order, into model-0000i-of-0000n.safetensors
    and model.safetensors.index.json: the Hugging Face layout that vLLM and transformers load, and files git takes
    (a two-layer SmolLM2 head is 27 MB in one file)."""
    from safetensors.torch import load_file, save_file

    whole = head / "model.safetensors"
    if not whole.exists() or whole.stat().st_size <= max_bytes:
        return
    tensors = load_file(whole)
    nbytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if groups[-1] and size + nbytes[name] > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes[name]
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names}, str(head / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    (head / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=1))
    whole.unlink()


def settings_of(variant) -> dict:
    r = {**DEFAULTS, **{k: v for k, v in variant.resolved.items() if k.startswith("REDISTILL_")}}
    try:
        vocab = r["REDISTILL_DRAFT_VOCAB"]
        cap = r["REDISTILL_MAX_TRAIN_TOKENS"]
        cfg = {"draft_vocab": vocab if vocab in ("auto", "init") else int(vocab), "steps": int(r["REDISTILL_STEPS"]),
               "ttt_steps": int(r["REDISTILL_TTT_STEPS"]), "lr": float(r["REDISTILL_LR"]),
               "seed": int(r["REDISTILL_SEED"]), "samples": int(r["REDISTILL_SAMPLES"]),
               "temperature": float(r["REDISTILL_TEMPERATURE"]), "pack_tokens": int(r["REDISTILL_PACK_TOKENS"]),
               "layers": int(r["REDISTILL_LAYERS"]), "max_train_tokens": int(float(cap)) if cap else None,
               "max_seconds": float(r["REDISTILL_MAX_SECONDS"]) if r["REDISTILL_MAX_SECONDS"] else None,
               "attn": r["REDISTILL_ATTN"], "loss": r["REDISTILL_LOSS"], "eval_every": int(r["REDISTILL_EVAL_EVERY"]),
               "eval_packs": int(r["REDISTILL_EVAL_PACKS"]), "init": r["REDISTILL_INIT"],
               "feature_cache_mb": int(r["REDISTILL_FEATURE_CACHE_MB"]),
               "snapshot_every": float(r["REDISTILL_SNAPSHOT_EVERY"]) if r["REDISTILL_SNAPSHOT_EVERY"] else None}
    except ValueError as e:
        raise RedistillError(f"{variant.path / 'config.env'}: a REDISTILL_* value is not a number ({e})") from None
    if cfg["draft_vocab"] == "init" and not cfg["init"]:
        raise RedistillError(f"{variant.name}: REDISTILL_DRAFT_VOCAB=init needs REDISTILL_INIT=<head folder>")
    if cfg["layers"] < 1 or cfg["pack_tokens"] < 64:
        raise RedistillError(f"{variant.name}: REDISTILL_LAYERS must be >= 1 and REDISTILL_PACK_TOKENS >= 64")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a speculative variant whose SERVE_SPECULATIVE_CONFIG names the head to write")
    p.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    p.add_argument("--prompts", type=Path, help="the prompt set (default: REDISTILL_PROMPTS, else spec-v1-train)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the budget's, else REDISTILL_STEPS)")
    p.add_argument("--base-url", help="the target's running server (default: start it)")
    p.add_argument("--port", type=int, default=8127)
    p.add_argument("--concurrency", type=int, help="requests in flight while the target answers (default: its "
                   "SERVE_MAX_NUM_SEQS; raise that too with --target-set for bulk generation)")
    p.add_argument("--target-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config.env key of the target (PARENT) for the server it starts")
    p.add_argument("--generate-only", action="store_true", help="stop once the target's answers are cached")
    p.add_argument("--export-answers", type=Path, metavar="FILE.npz",
                   help="write the cached answers as one compact file (after generating them if needed) and stop")
    p.add_argument("--answers", type=Path, metavar="FILE.npz",
                   help="unpack answers written by --export-answers (another machine's generation) into the cache")
    p.add_argument("--out", type=Path, help="write the head here instead of the variant's head folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    return p


def prompt_path(variant, given: Path | None) -> Path:
    """--prompts, else the variant's REDISTILL_PROMPTS (relative to the repository), else spec-v1-train."""
    if given:
        return given
    named = variant.resolved.get("REDISTILL_PROMPTS")
    return paths.ROOT / named if named else TRAIN_PROMPTS


def check_prompt_hash(variant, info: dict) -> None:
    """REDISTILL_PROMPT_SHA256 pins the prompt set: a different file (another BIG-bench build) is refused."""
    want = variant.resolved.get("REDISTILL_PROMPT_SHA256")
    if want and want != info["prompt_set_sha256"]:
        raise RedistillError(f"{info['prompt_set']} has sha256 {info['prompt_set_sha256'][:16]}, {variant.name}'s "
                             f"REDISTILL_PROMPT_SHA256 is {want[:16]}: rebuild it (python -m "
                             f"scripts.levers.speculate.prompts --scale) or change the pin")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0, data = time.monotonic(), None
    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        out = args.out or head_dir(variant)
        if out is None:
            raise RedistillError(f"{variant.name}: SERVE_SPECULATIVE_CONFIG names no eagle3 head under weights/")
        snap = Path(out).with_name(Path(out).name + ".snapshot")
        if not variant.resolved.get("PARENT"):
            raise RedistillError(f"{variant.name} has no PARENT: the target to distill from")
        target = load_variant(variant.resolved["PARENT"], overrides=parse_overrides(args.target_set))
        if not Path(target.model).is_dir():
            raise RedistillError(missing_model(target))
        cfg = settings_of(variant)
        n_prompts, max_tokens, steps = BUDGETS[args.budget]
        if args.budget == "tiny":
            cfg["samples"], cfg["max_train_tokens"] = 0, None
        steps = args.steps or steps or cfg["steps"]
        rows, info = load_prompts(prompt_path(variant, args.prompts), n_prompts)
        check_prompt_hash(variant, info)
        cfg["ranks"], rank = ranks()
        want = answers_dir(target, info, len(rows), max_tokens, cfg)
        if cfg["ranks"] > 1 and (args.answers or args.generate_only or args.export_answers
                                 or not (want / "responses.json").exists()):
            raise RedistillError(f"{cfg['ranks']} data-parallel ranks only train: cache the answers first "
                                 "(--generate-only or --answers, in one process)")
        if args.answers:
            import_answers(args.answers, want=want)
        data = cached_data(target, rows, info, max_tokens, cfg, args.base_url, args.port,
                           args.concurrency or target.max_num_seqs)
        if args.export_answers:
            export_answers(data, args.export_answers)
        if args.generate_only or args.export_answers:
            return 0
        cached = json.loads((data / "responses.json").read_text())
        known = splits_of(rows)  # answers cached before the split column existed: the prompt set's split
        seqs = [{**s, "split": s.get("split") or known[s["id"]][0]} for s in cached["seqs"]]
        sets = {"train": select(seqs, "train", cfg["max_train_tokens"]), "val": select(seqs, "val", None)}
        if not sets["val"] or not sets["train"]:
            raise RedistillError(f"{info['prompt_set']}: {len(sets['train'])} training and {len(sets['val'])} "
                                 "validation answers; both splits need some")
        freq = Counter(t for s in sets["train"] for t in s["ids"])
        from transformers import AutoConfig

        tcfg = AutoConfig.from_pretrained(target.model)
        cov = coverage(freq)
        vocab_map = None
        if cfg["draft_vocab"] == "init":  # the earlier head's draft tokens: what they cover of these answers is kept
            vocab_map = init_vocab(Path(cfg["init"]), tcfg.vocab_size)
            cfg["draft_vocab"] = int(vocab_map[0].numel())
            kept = vocab_map[1].nonzero().flatten().tolist()
            cov["init"] = round(sum(freq[t] for t in kept) / max(sum(freq.values()), 1), 4)
        if cfg["draft_vocab"] == "auto":
            auto = next((n for n in COVERAGE_SIZES if cov[str(n)] >= AUTO_COVERAGE), COVERAGE_SIZES[-1])
            cfg["draft_vocab"] = min(auto, tcfg.vocab_size)
        if cfg["draft_vocab"] > tcfg.vocab_size or cfg["draft_vocab"] < 16:
            raise RedistillError(f"REDISTILL_DRAFT_VOCAB={cfg['draft_vocab']}: must lie in 16..{tcfg.vocab_size}")
        train_tokens, packed = sum(freq.values()), sum(len(s["prompt_ids"]) + len(s["ids"]) for s in sets["train"])
        prov = {
            "lever": "redistill_mtp (EAGLE-3 via speculators)", "variant": variant.name, "target": target.name,
            "target_model": target.resolved["MODEL"], "target_hidden_size": tcfg.hidden_size,
            "target_vocab_size": tcfg.vocab_size, "aux_layer_ids": aux_layer_ids(tcfg.num_hidden_layers),
            "prompts": info, "budget": args.budget, "responses": len(cached["seqs"]), "max_tokens": max_tokens,
            "response_tokens": sum(len(s["ids"]) for s in seqs), "train_responses": len(sets["train"]),
            "train_response_tokens": train_tokens, "val_responses": len(sets["val"]),
            "val_response_tokens": sum(len(s["ids"]) for s in sets["val"]),
            "data_sha256": hashlib.sha256((data / "responses.json").read_bytes()).hexdigest(), "settings": cfg}

        def progress(taken: int, curve: list, passes: int) -> dict:
            return {"steps": taken, "total_steps": taken + ((cfg.get("warm_start") or {}).get("total_steps") or 0),
                    "epochs": round(taken * cfg["pack_tokens"] * cfg["ranks"] / max(packed, 1), 2),
                    "passes_started": passes, "curve": curve, "seconds": round(time.monotonic() - t0, 1)}

        def snapshot(model, curve: list, taken: int, passes: int) -> None:
            probe = next((p["val_acc"] for p in reversed(curve) if "val_acc" in p), None)
            try:
                write_head(copy.deepcopy(model), snap, {**prov, "snapshot": True, **progress(taken, curve, passes),
                                                        "probe_val_acc": probe})
            except OSError as e:  # a snapshot is a safety net: training goes on without it
                print(f"warning: no snapshot at step {taken} ({e})", file=sys.stderr, flush=True)
                return
            print(f"snapshot at step {taken}: {paths.shown(snap)}", flush=True)

        if cfg["ranks"] > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")
        model, curve, val_acc, epochs, steps = train(target.model, tcfg.hidden_size, sets, freq, cfg, steps,
                                                     cfg["seed"], snapshot if rank == 0 else None, vocab_map)
        if rank > 0:  # rank 0 writes the head
            return 0
    except (RedistillError, VariantError, PromptSetError, ServerError, CheckpointError) as e:
        kept = f"; its last snapshot is {paths.shown(snap)} (REDISTILL_INIT=)" if data and snap.is_dir() else ""
        print(f"error: {e}{kept}", file=sys.stderr)
        return 2
    except Exception as e:  # a failure while training: the cached answers (and the last snapshot) stay for a retry
        if data is None:
            raise
        kept = f"; its last snapshot is {paths.shown(snap)} (REDISTILL_INIT=)" if snap.is_dir() else ""
        print(f"error: training failed ({type(e).__name__}: {e}); the target's answers stay cached in "
              f"{paths.shown(data)} for a retry{kept}", file=sys.stderr)
        raise
    import torch

    write_head(model, out, {**prov, **progress(steps, curve, epochs), "val_cond_acc": [round(a, 4) for a in val_acc],
                            "draft_vocab_coverage": cov, "device": "cuda" if torch.cuda.is_available() else "cpu"})
    shutil.rmtree(snap, ignore_errors=True)
    covered = cov.get("init", coverage(freq, (cfg["draft_vocab"],))[str(cfg["draft_vocab"])])
    print(f"validation accuracy per draft position {[round(a, 3) for a in val_acc]}; "
          f"draft vocab {cfg['draft_vocab']} covers {covered:.1%}; "
          f"{train_tokens:,} training response tokens")
    print(f"wrote {paths.shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
