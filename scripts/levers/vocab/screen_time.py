"""What exactness costs per decode step on one device: the exact tail's pieces timed alone, at 1 and 8 positions.

    python -m scripts.levers.vocab.screen_time gemma3-270m-v32k-tail                  # the parent's own rows, this CPU
    python -m scripts.levers.vocab.screen_time --shape 248320x2560 --keep 65536 --device cuda --name qwen35-4b-proxy
                                                  # random rows of the Qwen3.5-4B output layer's shape (speed only)

Per step, a pruned head with the exact tail (scripts.levers.vocab.tail) computes the kept logits (a BF16 product with
the kept rows), screens every dropped row (one int8 product and a threshold pass) and recomputes the rows the screen
opens from BF16. Each piece is timed here on its own, beside the full output layer it replaces:

- full: h @ W^T over every row (the parent's head), BF16;
- pruned: h @ W_kept^T (the pruned head alone, not exact);
- products:<kernel>: the screen's product alone (tail.products(): every dropped row's approximate logit), per kernel
  of tail.KERNELS that runs on the device;
- screen:<kernel>: tail.screen() with a threshold no row reaches (its dense part: the product and the pass);
- screen:int4-g32-l1: the same for the 5-bit kernel's 4-bit layout (not served: the screens study's comparison);
- recompute:<n>: the exact BF16 logits of n dropped rows (index_select + product), for the rows a screen opens.

So a step of the exact head costs pruned + screen + recompute(rows opened); the rows opened per position are the
screen study's (scripts.levers.vocab.screens, on the parent's held-out positions). Each piece reports its median and
minimum over `--iters` timed calls after warm-up (CUDA events on a GPU), the bytes its dense part reads and the rate
that makes, beside the device's own copy bandwidth measured in the same run. Random rows (--shape) time the kernels
only: the rows they would open mean nothing and are not reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.levers.vocab.keep import VocabError

POSITIONS = (1, 8)
RECOMPUTE = (16, 1024)
COPY_BYTES = 1 << 28  # 256 MiB: past every cache of the CPUs met


def timer(device: str, iters: int, warmup: int):
    """fn -> (median s, min s) over `iters` calls after `warmup`."""
    import torch

    def run(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2], times[0]

    return run


def copy_bandwidth(device: str, run) -> dict:
    """(read + written) bytes per second of one large copy on the device, timed as the pieces are."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    med, _ = run(lambda: dst.copy_(src))
    return {"bytes_per_s": 2 * COPY_BYTES / med, "buffer_bytes": COPY_BYTES,
            "method": "torch copy_ of one buffer, (read + write) bytes / median time"}


def available_kernels(device: str) -> list[str]:
    """The screen kernels that run on this device (oneDNN's needs vLLM's CPU build and 8-bit dot products, the 5-bit
    screen a C compiler)."""
    from scripts.common.hardware import INT8_DOT_FLAGS, cpu_model_and_flags
    from scripts.levers.vocab import tail, tail_lowbit

    if device != "cpu":
        return tail.exact_kernels(device=device)
    out = [tail.WEIGHT_ONLY]
    try:
        tail_lowbit.library()
        out.insert(0, tail.INT5)
    except (tail_lowbit.LowbitError, OSError):
        pass
    if any(f in cpu_model_and_flags()[1] for f in INT8_DOT_FLAGS):
        out.append(tail.INT_MM)
        try:
            from vllm import _custom_ops as ops

            if getattr(ops, "_supports_onednn", False):
                out.insert(0, tail.ONEDNN)
        except ImportError:
            pass
    return out


def time_pieces(matrix, kept_ids, kernels, positions=POSITIONS, recompute=RECOMPUTE, iters: int = 50,
                warmup: int = 5, seed: int = 0) -> dict:
    """The pieces' times on matrix's device ([vocab, hidden] BF16), and the copy bandwidth measured beside them."""
    import torch

    from scripts.levers.vocab import tail

    device = matrix.device.type
    run = timer(device, iters, warmup)
    vocab, hidden = matrix.shape
    kept_idx = torch.as_tensor(kept_ids, dtype=torch.long, device=matrix.device)
    kept = matrix.index_select(0, kept_idx).contiguous()
    screens = {k: tail.build(matrix, kept_ids, kernel=k) for k in kernels}
    n_dropped = vocab - len(kept_idx)
    study = {}  # the 5-bit kernel's 4-bit layout, which the screens study compares (scripts.levers.vocab.screens)
    if tail.INT5 in screens:
        five = screens[tail.INT5]
        study["int4-g32-l1"] = tail.lowbit_data(matrix[five["dropped"]].float(), five["dropped"], bits=4)
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def add(piece, p, fn, nbytes, **extra):
        med, low = run(fn)
        rows.append({"piece": piece, "positions": p, "median_ms": round(med * 1e3, 4), "min_ms": round(low * 1e3, 4),
                     "bytes": nbytes, "gb_per_s": round(nbytes / med / 1e9, 2), **extra})

    for p in positions:
        h = (torch.randn(p, hidden, generator=gen) * 4).to(device=matrix.device, dtype=matrix.dtype)
        never = torch.full((p,), float("inf"), device=matrix.device)  # no row reaches it: the screen's dense part
        with torch.inference_mode():
            add("full", p, lambda h=h: h @ matrix.T, vocab * hidden * 2)
            add("pruned", p, lambda h=h: h @ kept.T, len(kept_idx) * hidden * 2)
            for k, s in screens.items():
                nbytes = s.get("bytes", n_dropped * (hidden + 4))  # the 5-bit screen counts its own
                add(f"products:{k}", p, lambda h=h, s=s: tail.products(h, s), nbytes)
                add(f"screen:{k}", p, lambda h=h, s=s, t=never: tail.screen(h, s, t), nbytes)
            for name, s in study.items():  # its dense part as the served screen runs it (tail.lowbit_screen)
                add(f"screen:{name}", p, lambda h=h, s=s, t=never: tail.lowbit_screen(h, s, t), s["bytes"])
            for n in recompute:
                ids = screens[kernels[0]]["dropped"][:n]
                add(f"recompute:{n}", p, lambda h=h, ids=ids: h @ matrix.index_select(0, ids).T, n * hidden * 2)
    return {"device": device, "vocab": vocab, "hidden": hidden, "kept": len(kept_idx), "dropped": n_dropped,
            "kernels": list(kernels), "iters": iters, "warmup": warmup, "threads": torch.get_num_threads(),
            "copy_bandwidth": copy_bandwidth(device, run), "pieces": rows}


def random_head(shape: str, keep: int, device: str, seed: int = 0):
    """Random BF16 rows of `shape` (VOCABxHIDDEN) on the device and `keep` kept ids drawn from them (speed only)."""
    import torch

    try:
        vocab, hidden = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise VocabError(f"--shape {shape!r}: give VOCABxHIDDEN, e.g. 248320x2560") from None
    if not 0 < keep < vocab:
        raise VocabError(f"--keep {keep}: must lie between 0 and the vocabulary ({vocab})")
    gen = torch.Generator().manual_seed(seed)
    matrix = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16).to(device)
    return matrix, torch.randperm(vocab, generator=gen)[:keep].sort().values.tolist()


def variant_head(name: str):
    """(the parent's output matrix, BF16 on the CPU; kept ids; the parent's name; the base) of a pruned variant."""
    import torch

    from scripts.levers.vocab.keep import load_keep_list, pruned_and_parent

    v, keep_n, parent = pruned_and_parent(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(parent.model)
    model = AutoModelForCausalLM.from_pretrained(parent.model, dtype=torch.bfloat16)
    matrix = model.get_output_embeddings().weight.detach().contiguous()
    keep = load_keep_list(v.resolved["BASE"], keep_n, tok, matrix.shape[0])
    return matrix, keep["kept_ids"], parent.name, v.resolved["BASE"]


def markdown(result: dict, title: str) -> str:
    bw = result["copy_bandwidth"]["bytes_per_s"] / 1e9
    lines = [f"# Exact tail pieces per step: {title}", "",
             f"{result['device']}, {result['threads']} threads; {result['vocab']:,} rows of {result['hidden']} "
             f"({result['kept']:,} kept, {result['dropped']:,} dropped); median of {result['iters']} calls; copy "
             f"bandwidth {bw:.1f} GB/s (read + write)", "",
             "| piece | positions | median ms | min ms | MB read | GB/s | % of copy bandwidth |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["pieces"]:
        lines.append(f"| {r['piece']} | {r['positions']} | {r['median_ms']} | {r['min_ms']} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['gb_per_s']} | {100 * r['gb_per_s'] / bw:.0f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", nargs="?", help="a pruned variant: its parent's own rows and keep list (CPU)")
    p.add_argument("--shape", help="random rows instead: VOCABxHIDDEN (speed only)")
    p.add_argument("--keep", type=int, help="with --shape: kept rows")
    p.add_argument("--name", help="with --shape: the base whose shape it is (names the output)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kernels", help="screen kernels (default: every one that runs on the device)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, help="JSON here (default results/vocab/<base>/screen-time-<keep>-<device>-"
                                            "<date>.json; .md beside)")
    return p


def main(argv: list[str] | None = None) -> int:
    import datetime as dt

    from scripts.common.hardware import hardware
    from scripts.common.records import git_state, versions
    from scripts.common.variants import VariantError
    from scripts.levers.vocab import tail

    args = build_parser().parse_args(argv)
    try:
        if bool(args.variant) == bool(args.shape):
            raise VocabError("name a pruned variant, or give --shape VOCABxHIDDEN --keep N --name BASE instead")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise VocabError("--device cuda: torch sees no CUDA device here")
        if args.shape:
            if not (args.keep and args.name):
                raise VocabError("--shape needs --keep N and --name BASE")
            matrix, kept_ids = random_head(args.shape, args.keep, args.device)
            source, base = {"rows": f"random N(0, 0.02^2), BF16, shape {args.shape} of {args.name}'s output layer "
                            "(speed only)"}, args.name
        else:
            if args.device != "cpu":
                raise VocabError("a variant's own rows are timed on the CPU; give --shape for another device")
            matrix, kept_ids, parent, base = variant_head(args.variant)
            source = {"rows": f"{parent}'s output layer", "variant": args.variant}
        kernels = args.kernels.split(",") if args.kernels else available_kernels(args.device)
        if bad := sorted(set(kernels) - set(tail.KERNELS)):
            raise VocabError(f"--kernels: unknown {bad}; the screen's kernels are {', '.join(tail.KERNELS)}")
        result = time_pieces(matrix, kept_ids, kernels, iters=args.iters)
    except (VocabError, VariantError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from scripts.levers.vocab.keep import vocab_dir

    title = args.variant or f"{args.name} shape, random rows"
    record = {"source": source, "command": ["python", "-m", "scripts.levers.vocab.screen_time",
                                            *(argv if argv is not None else sys.argv[1:])],
              "git": git_state(), "versions": versions(), "hardware": hardware(), **result}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or vocab_dir(base) / f"screen-time-{result['kept']}-{args.device}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    paths.write_text_atomic(out, json.dumps(record, indent=1) + "\n")
    paths.write_text_atomic(out.with_suffix(".md"), markdown(result, title))
    print(markdown(result, title))
    print(f"wrote {paths.shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
