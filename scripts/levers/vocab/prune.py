"""Vocabulary pruning of the output layer: a checkpoint whose lm_head keeps PRUNE_KEEP rows, served with an id remap.

    python -m scripts.levers.vocab.prune gemma3-270m-v32k        # `make prune-vocab VARIANT=gemma3-270m-v32k`

Reads PARENT's checkpoint (never modified) and results/vocab/<BASE>/keep-<PRUNE_KEEP>.json (scripts.levers.vocab.analyze),
checks the keep list against PARENT's tokenizer (same fingerprint, every special / chat-template / single-byte token
kept, ids in range), and writes MODEL (a temp directory, verified, renamed into place):
  - every tensor of PARENT unchanged, the input embedding whole (every input text tokenizes and embeds as before);
  - lm_head.weight = PARENT's output rows (its lm_head, or the tied embedding) for the kept ids, in ascending id order,
    BF16 as they were: the output layer is untied;
  - vocab_map.json (kept ids, full vocabulary size, the keep list's hash) and config.json naming the architecture
    PrunedVocab<Base> with a `vocab_pruning` block, which scripts.levers.vocab.plugin serves in vLLM: logits for the
    kept rows, scattered to their original ids (-inf elsewhere). Tokenizer files are copied unchanged.
With PRUNE_TAIL=1 (a tied parent only) config.json's vocab_pruning also asks for the exact tail fallback
(scripts.levers.vocab.tail): the plugin screens the dropped rows with a 4-bit copy it derives at load; nothing is
fitted or stored. Here the screen is built and its bound checked once, timed beside the head, and (for an unquantized
parent, which transformers runs on a CPU) run on the parent's own held-out positions (scripts.levers.vocab.tail.report).
It also times, on this machine, the output layer a decode step runs: the full head vs the kept rows plus the scatter,
at batch 1 and 8 (the scatter's cost per step), and writes it with the provenance to PROVENANCE.json and to
experiments/<variant>/prune_<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, copy_side_files, verify
from scripts.common.hardware import hardware
from scripts.common.records import git_state, now_utc, versions
from scripts.common.variants import VariantError, load_variant, missing_model
from scripts.data.bigbench import BigBenchError
from scripts.levers.vocab import tail
from scripts.levers.vocab.keep import ID_MAP, PLUGIN_BASES, PLUGIN_PREFIX, VocabError, load_keep_list


def output_rows_name(names: set[str], tied: bool) -> str:
    """The tensor holding the output layer's rows: lm_head.weight, or the embedding it is tied to."""
    if "lm_head.weight" in names and not tied:
        return "lm_head.weight"
    for name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        if name in names:
            return name
    raise VocabError("found neither lm_head.weight nor model.embed_tokens.weight")


def load_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise VocabError(f"{paths.shown(model_dir)} has no .safetensors files")
    return tensors


def _median_us(fn, repeat: int) -> float:
    import statistics

    for _ in range(10):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)


def time_head(rows, kept_ids, batches=(1, 8), repeat: int = 200) -> dict:
    """Median microseconds of one decode step's output layer: full head vs kept rows vs kept rows + scatter."""
    import torch

    pruned = rows[kept_ids].contiguous()
    idx = torch.tensor(kept_ids, dtype=torch.long)
    vocab = rows.shape[0]

    def scatter(logits):
        return logits.new_full((logits.shape[0], vocab), float("-inf")).index_copy_(1, idx, logits)

    out = {"unit": f"microseconds (median of {repeat})", "threads": torch.get_num_threads()}
    for b in batches:
        h = torch.randn(b, rows.shape[1], dtype=rows.dtype)
        logits = h @ pruned.T
        out[f"batch_{b}"] = {
            "full_head": _median_us(lambda h=h: h @ rows.T, repeat),
            "kept_head": _median_us(lambda h=h: h @ pruned.T, repeat),
            "scatter_only": _median_us(lambda logits=logits: scatter(logits), repeat),
            "kept_head_and_scatter": _median_us(lambda h=h: scatter(h @ pruned.T), repeat),
        }
    return out


# repeats of the screen's timing at most: a kernel this CPU runs in software takes ~0.3 s a call (oneDNN int8 on AVX2)
SCREEN_REPEAT_MAX = 20


def time_screen(rows, kept_ids, repeat: int, batches=(1, 8)) -> dict:
    """The tail screen on every kernel (tail.KERNELS) built from these rows, whether its bound holds on this CPU, and
    one decode step's screen timed per batch size (`kernel`: the fastest exact one, which the plugin serves with)."""
    import torch

    out = {"kernel": tail.kernel_name(), "dropped_rows": rows.shape[0] - len(kept_ids)}
    rows = rows.to(torch.bfloat16)
    for name in tail.KERNELS:
        t = time.monotonic()
        try:
            screen = tail.build(rows, kept_ids, kernel=name, check=False)
        except tail.TailError as e:  # not in this vLLM build
            out[name] = {"refused": str(e)}
            continue
        out[name] = {"build_seconds": round(time.monotonic() - t, 2), "bound": "holds"}
        try:
            tail.check_bound(screen, rows)
        except tail.TailError as e:  # timed all the same: what the refused kernel would cost
            out[name]["bound"] = str(e)
        for b in batches:
            h = torch.randn(b, rows.shape[1], dtype=torch.bfloat16)
            mx = torch.full((b,), float("inf"))  # nothing screened in: the screen's own cost
            out[name][f"batch_{b}"] = _median_us(lambda h=h, mx=mx, screen=screen: tail.screen(h, screen, mx), repeat)
    # the one the plugin serves: the fastest exact kernel (tail.fastest() times them again at load)
    exact = [k for k in tail.exact_kernels() if out.get(k, {}).get("bound") == "holds"]
    if exact:
        out["kernel"] = min(exact, key=lambda k: sum(out[k][f"batch_{b}"] for b in batches))
    return out


def prune(variant_name: str, *, force: bool = False, record_dir: Path | None = None, timing_repeat: int = 200,
          tail_positions: int = 2_000, tail_sets=None) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    t0 = time.monotonic()
    var = load_variant(variant_name)
    s = var.resolved
    if not s.get("PRUNE_KEEP"):
        raise VocabError(f"{variant_name} has no PRUNE_KEEP: not a vocabulary-pruned variant")
    if not s.get("PARENT"):
        raise VocabError(f"{variant_name} has no PARENT to prune")
    n = int(s["PRUNE_KEEP"])
    parent = load_variant(s["PARENT"])
    src, dest = Path(parent.model), Path(var.model)
    if not src.is_dir():
        raise VocabError(missing_model(parent))
    if dest.exists() and not force:
        print(f"{paths.shown(dest)} exists; nothing to do (--force rebuilds)")
        return dest
    cfg = json.loads((src / "config.json").read_text())
    if "vocab_pruning" in cfg:
        raise VocabError(f"{parent.name}'s checkpoint is already pruned: prune its unpruned parent instead")
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in PLUGIN_BASES:
        raise VocabError(f"{parent.name} is a {arch}; the serving plugin wraps {', '.join(PLUGIN_BASES)}")
    text_cfg = cfg.get("text_config", cfg)
    vocab_size = text_cfg["vocab_size"]
    tok = AutoTokenizer.from_pretrained(src)
    keep = load_keep_list(s["BASE"], n, tok, vocab_size)
    kept = keep["kept_ids"]

    tensors = load_tensors(src)
    tied = bool(text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    rows_name = output_rows_name(set(tensors), tied)
    rows = tensors[rows_name]
    if rows.dtype not in (torch.bfloat16, torch.float16, torch.float32) or rows.shape[0] != vocab_size:
        raise VocabError(f"{rows_name} is {rows.dtype} {tuple(rows.shape)}: expected a dense float "
                         f"[{vocab_size}, hidden] output layer (a quantized head is not pruned)")
    with_tail = s.get("PRUNE_TAIL", "0") == "1"
    if with_tail and rows_name == "lm_head.weight":
        raise VocabError(f"{parent.name}'s output layer is untied: the tail fallback reads full rows from the input "
                         f"embedding, which then is not the output matrix")
    reported = with_tail and "quantization_config" not in cfg
    if reported:  # its held-out data before any work: a missing set is one line, not a traceback after minutes
        tail.held_out_sources(s["BASE"], tail_sets)
    timing = time_head(rows, kept, repeat=timing_repeat)
    tail_report = None
    if with_tail:
        timing["tail_screen"] = time_screen(rows, kept, repeat=min(timing_repeat, SCREEN_REPEAT_MAX))
        if not reported:
            tail_report = {"skipped": f"{parent.name} is quantized ({cfg['quantization_config'].get('format', '?')}): "
                                      f"transformers cannot run its forward on a CPU; the served engine's counters "
                                      f"report the screen"}
        else:
            tail_report = tail.report(src, s["BASE"], kept, tail_positions, sets=tail_sets)
    tensors["lm_head.weight"] = rows[kept].contiguous()

    with paths.staged(dest) as tmp:
        copy_side_files(src, tmp)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg["architectures"] = [PLUGIN_PREFIX + arch]
        cfg["tie_word_embeddings"] = False
        if "text_config" in cfg:
            cfg["text_config"]["tie_word_embeddings"] = False
        cfg["vocab_pruning"] = {"base_architecture": arch, "kept": n, "vocab_size": vocab_size, "id_map": ID_MAP,
                                "parent": parent.name, "output_rows_from": rows_name}
        if with_tail:
            cfg["vocab_pruning"]["tail"] = tail.config()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / ID_MAP).write_text(json.dumps({"vocab_size": vocab_size, "kept_ids": kept, "keep_list": keep["path"],
                                              "keep_list_sha256": keep["sha256"]}) + "\n")
        provenance = {"lever": "vocabulary pruning (output layer)", "parent": parent.name,
                      "parent_model": parent.resolved["MODEL"], "kept": n, "vocab_size": vocab_size,
                      "keep_list": keep["path"], "keep_list_sha256": keep["sha256"], "output_rows_from": rows_name,
                      "output_layer_bytes": {"parent": rows.numel() * rows.element_size(),
                                             "pruned": n * rows.shape[1] * rows.element_size()},
                      "head_timing_this_machine": timing,
                      "tail_fallback": {**tail.config(), "held_out": tail_report} if with_tail else None,
                      "seconds": round(time.monotonic() - t0, 1)}
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
        verify(tmp, shapes=False)
    record = {"variant": variant_name, "kind": "vocab-prune", "started_at": now_utc().isoformat(timespec="seconds"),
              "command": ["python", "-m", "scripts.levers.vocab.prune", variant_name], "git": git_state(),
              "versions": versions(), "hardware": hardware(), **provenance}
    out = (record_dir or var.path) / f"prune_{now_utc().strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {paths.shown(dest)}: {n:,} of {vocab_size:,} output rows; record {paths.shown(out)}")
    for b in ("batch_1", "batch_8"):
        t = timing[b]
        print(f"  output layer, {b}: full {t['full_head']} us, kept {t['kept_head']} us + scatter "
              f"{t['scatter_only']} us = {t['kept_head_and_scatter']} us")
    if with_tail:
        t = timing["tail_screen"]
        for name in tail.KERNELS:
            k = t[name]
            print(f"  tail screen on {name}{' (served)' if name == t['kernel'] else ''}: " + (
                k["refused"] if "refused" in k else f"batch 1 {k['batch_1']} us, batch 8 {k['batch_8']} us for "
                f"{t['dropped_rows']:,} dropped rows; bound {k['bound']}"))
        for name, r in (tail_report.get("sets") or {}).items():
            print(f"  {name}: argmax dropped at {r['argmax_dropped']} of {r['positions']:,} positions (all screened "
                  f"in: {r['argmax_dropped_screened_in'] == r['argmax_dropped']}); a row screened in at "
                  f"{r['positions_screened_in_rate']:.1%}, {r['rows_screened_in_per_position']['mean']} rows a "
                  f"position; largest error {r['max_error_over_bound']:.2f} of its bound")
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--force", action="store_true", help="rebuild MODEL even if it exists")
    p.add_argument("--timing-repeat", type=int, default=200,
                   help="repeats of the output-layer timing (a 248k x 2560 head on a CPU: fewer keep it to seconds)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prune(args.variant, force=args.force, timing_repeat=args.timing_repeat)
    except (VocabError, VariantError, CheckpointError, BigBenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
