"""Screens of a pruned head's dropped rows, compared on the parent's held-out positions: what each reads per step,
how many rows it opens per position, and whether its bound ever fails (every bound is checked against exact products).

    python -m scripts.levers.vocab.screens gemma3-270m-v32k-tail                  # results/vocab/<base>/screens-<keep>.json
    python -m scripts.levers.vocab.screens smollm2-v16k-tail --positions 300

A screen bounds every dropped logit w_j . h from above, cheaply; a row whose bound reaches the best kept logit m is
"opened" (its exact logit is computed from the BF16 row), every other one cannot be the argmax. The serving screen
(scripts.levers.vocab.tail) is the first method; the others are the cheaper reads one could serve instead:

- int8-row: int8 rows, one scale per row, h exact (the weight-only kernel): |e_j| |h| + rounding slack (tail.py);
- int5-g32-l1: the served low-bit screen (tail_lowbit.py): 5-bit rows (-15..15), one fp16 scale per 32 values, h
  rounded to int8 per 32 values, bound per group sum_g s_g (|h_g|_1 / 2 + 15 |h_g - h^_g|_1), or the row's
  Cauchy-Schwarz bound where smaller (tail.lowbit_screen), on the same C kernel as served;
- int4-g32-l1: the same with 4-bit rows (-7..7), on the same kernel;
- int4-row / int4-g32: 4-bit rows, one scale per row / per 32 values, bound a_j + |e_j| |h| (Cauchy-Schwarz on the
  row's quantization error, |e_j| stored per row);
- lowrank-r: the top-r right singular vectors V of the dropped rows, each row's r coordinates U_j = w_j V^T and the
  norm of its residual, bound U_j . (V h) + |w_j - U_j V| |h - V^T V h| (the residual lies outside span V);
- cluster-K: k-means over the dropped rows, per cluster a centre c and a radius r, bound c . h + r |h| for every row
  of the cluster (a cluster is opened whole);
- prompt-ids: not a bound; how many dropped argmaxes are tokens already in the sequence (the ids a request could add
  to its kept set), and how many positions would still open a row under int8-row if they were kept.

Reads per step are the bytes each screen reads for one decode step (its dense part; opened rows come on top, counted
per position). Exact products of every dropped row at every position decide the violations, which must be 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.levers.vocab.keep import VocabError

METHODS = ("int8-row", "int5-g32-l1", "int4-g32-l1", "int4-row", "int4-g32", "lowrank-32", "lowrank-128",
           "cluster-1024")
CHUNK = 128  # positions per exact product (a [positions, dropped] float32 matrix each)


def quantize_groups(rows, bits: int, group: int | None):
    """Symmetric rounding to `bits`, one scale per row (group None) or per `group` values: the dequantized rows."""
    import torch

    lv = 2 ** (bits - 1) - 1
    g = rows if group is None else rows.reshape(rows.shape[0], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / lv).clamp(min=1e-12)
    return (torch.round(g / scale).clamp(-lv, lv) * scale).reshape(rows.shape)


def nearest(rows, centres):
    """Index of each row's nearest centre (squared Euclidean distance)."""
    return ((centres * centres).sum(1) - 2 * rows @ centres.T).argmin(1)


def kmeans(rows, k: int, iters: int = 8, seed: int = 0):
    """(centres [k, d], assignment [n]) of plain k-means (Lloyd), seeded with k distinct rows; a cluster left empty
    moves to the origin (its radius is then 0: no row is assigned to it)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    centres = rows[torch.randperm(rows.shape[0], generator=gen)[:k]].clone()
    for _ in range(iters):
        assign = nearest(rows, centres)
        sums = torch.zeros_like(centres).index_add_(0, assign, rows)
        centres = sums / torch.bincount(assign, minlength=k).clamp(min=1)[:, None].float()
    return centres, nearest(rows, centres)


def prepare(method: str, rows, tail_screen=None) -> dict:
    """What `method` keeps of the dropped rows (float32 [n, d]) and the bytes it reads per step (tail_screen: the
    int8-row or low-bit screen as tail.build() / tail.lowbit_data() build them)."""
    import torch

    n, d = rows.shape
    if method == "int8-row":
        return {"screen": tail_screen, "bytes": n * d + n * 2}
    if method.endswith("-l1"):
        return {"screen": tail_screen, "bytes": tail_screen["bytes"]}
    if method.startswith("int4"):
        group = 32 if method.endswith("g32") else None
        deq = quantize_groups(rows, 4, group)
        scales = n * (d // group if group else 1)
        return {"deq": deq, "err": (rows - deq).norm(dim=1), "bytes": n * d // 2 + scales * 2 + n * 4}
    if method.startswith("lowrank"):
        r = int(method.split("-")[1])
        _, _, vt = torch.linalg.svd(rows, full_matrices=False)
        v = vt[:r].contiguous()
        u = rows @ v.T
        return {"v": v, "u": u, "rho": (rows - u @ v).norm(dim=1), "bytes": n * r * 2 + n * 4 + r * d * 4}
    if method.startswith("cluster"):
        k = int(method.split("-")[1])
        centres, assign = kmeans(rows, k)
        radius = torch.zeros(k).scatter_reduce_(0, assign, (rows - centres[assign]).norm(dim=1), "amax",
                                                include_self=False)
        return {"centres": centres, "assign": assign, "radius": radius, "bytes": k * d * 2 + k * 4 + n * 4}
    raise VocabError(f"unknown screen {method!r}: the screens are {', '.join(METHODS)}")


def upper_bounds(method: str, prep: dict, h):
    """Every dropped row's upper bound on its logit at each position, float32 [positions, n]."""
    from scripts.levers.vocab import tail

    hf = h.float()
    hn = hf.norm(dim=1, keepdim=True)
    if method == "int8-row" or method.endswith("-l1"):
        a, bound = tail.approx_and_bound(h, prep["screen"])
        return a + bound
    if method.startswith("int4"):
        return hf @ prep["deq"].T + hn * prep["err"]
    if method.startswith("lowrank"):
        hs = hf @ prep["v"].T
        perp = ((hn[:, 0] ** 2 - (hs * hs).sum(1)).clamp(min=0).sqrt())[:, None]
        return hs @ prep["u"].T + perp * prep["rho"]
    if method.startswith("cluster"):
        per_cluster = hf @ prep["centres"].T + hn * prep["radius"]
        return per_cluster[:, prep["assign"]]
    raise VocabError(f"unknown screen {method!r}")


def hidden_stats(h, gaps: list) -> dict:
    """Why a norm-times-residual bound is loose or tight here: the size of h and how spread it is (the energy its 128
    largest coordinates hold; |h| outside the top 128 principal directions fitted on the first half of the positions,
    measured on the second), and the gap between the best kept logit and a dropped logit (quantiles of a sample)."""
    import torch

    hn2 = (h * h).sum(1)
    top = (h * h).sort(1, descending=True).values[:, :128].sum(1) / hn2
    half = len(h) // 2
    _, _, vt = torch.linalg.svd(h[:half], full_matrices=False)
    rest = h[half:] - (h[half:] @ vt[:128].T) @ vt[:128]
    g = torch.cat(gaps)
    g = g[torch.randperm(len(g), generator=torch.Generator().manual_seed(0))[:1_000_000]]
    qs = (0.0001, 0.001, 0.01, 0.1, 0.5)
    return {"norm_mean": round(float(hn2.sqrt().mean()), 2), "top128_coordinate_energy_mean": round(float(top.mean()), 3),
            "norm_outside_top128_pcs_mean": round(float(rest.norm(dim=1).mean()), 2),
            "gap_quantiles": {str(q): round(float(v), 2) for q, v in zip(qs, torch.quantile(g, torch.tensor(qs)), strict=True)}}


def study(parent_dir, base: str, kept_ids, max_positions: int, methods=METHODS) -> dict:
    """Every method on the held-out positions of tail.held_out_sequences (the prune record's), checked exactly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.levers.vocab import tail

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(parent_dir)
    model = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.bfloat16).eval()
    full = model.get_output_embeddings().weight.detach()
    kept = torch.as_tensor(kept_ids, dtype=torch.long)
    hs, seen = [], []
    with torch.inference_mode():
        for seqs in tail.held_out_sequences(tok, base, max_positions).values():
            for ids, start in seqs:
                hs.append(model.model(torch.tensor([ids])).last_hidden_state[0, start - 1:-1])
                seen += [set(ids[:p + 1]) for p in range(start - 1, len(ids) - 1)]
    h_all = torch.cat(hs)
    screen = tail.build(full, kept_ids, kernel=tail.WEIGHT_ONLY)
    dropped = screen["dropped"]
    rows = full[dropped].float()
    served = {"int8-row": screen}
    for m, bits in (("int5-g32-l1", 5), ("int4-g32-l1", 4)):
        if m in methods:
            served[m] = tail.lowbit_data(rows, dropped, bits)
    preps = {m: prepare(m, rows, served.get(m)) for m in methods}
    stats = {m: {"opened": [], "violations": 0} for m in methods}
    wins, in_seq, still_open, gaps = 0, 0, 0, []
    with torch.inference_mode():
        for i in range(0, len(h_all), CHUNK):
            h = h_all[i:i + CHUNK]
            best = (h @ full[kept].T).float().max(-1).values  # the best kept logit as served (BF16)
            exact = h.float() @ rows.T
            top = exact.max(-1)
            won = top.values > best
            gaps.append((best[:, None] - exact)[:, ::97].flatten())  # a fixed sample of the rows' gaps
            wins += int(won.sum())
            for p in won.nonzero().squeeze(1).tolist():
                in_seq += int(int(dropped[top.indices[p]]) in seen[i + p])
            for m in methods:
                opened = upper_bounds(m, preps[m], h) >= best[:, None]
                stats[m]["violations"] += int(((exact >= best[:, None]) & ~opened).sum())
                stats[m]["opened"].append(opened.sum(1))
                if m == "int8-row":  # positions that would still open a row with the sequence's ids kept
                    for p in range(len(h)):
                        ids = torch.as_tensor(sorted(seen[i + p]), dtype=torch.long)
                        still_open += int(opened[p][~torch.isin(dropped, ids)].any())
    out = {"positions": len(h_all), "dropped_rows": len(dropped), "hidden": full.shape[1],
           "argmax_dropped": wins, "methods": {}}
    for m in methods:
        c = torch.cat(stats[m]["opened"]).float()
        out["methods"][m] = {"reads_per_step_bytes": int(preps[m]["bytes"]),
                             "positions_opened_rate": round(float((c > 0).float().mean()), 4),
                             "rows_opened_per_position": {"mean": round(float(c.mean()), 1),
                                                          "p99": float(c.quantile(0.99)), "max": int(c.max())},
                             "violations": stats[m]["violations"]}
    out["hidden_state"] = hidden_stats(h_all.float(), gaps)
    out["prompt_ids"] = {"argmax_dropped_in_sequence": in_seq, "argmax_dropped": wins,
                         "positions_still_opened_int8_row": still_open}
    out["bf16_dropped_rows_bytes"] = int(rows.numel() * 2)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def markdown(result: dict, variant: str) -> str:
    lines = [f"# Screens of {variant}'s dropped rows on the parent's held-out positions", "",
             f"{result['positions']} positions, {result['dropped_rows']:,} dropped rows of {result['hidden']} values "
             f"(BF16: {result['bf16_dropped_rows_bytes'] / 1e6:.1f} MB); the parent's argmax is dropped at "
             f"{result['argmax_dropped']} positions.", "",
             "| screen | reads per step MB | positions opened | rows opened per position (mean / p99 / max) | violations |",
             "| --- | --- | --- | --- | --- |"]
    for m, s in result["methods"].items():
        r = s["rows_opened_per_position"]
        lines.append(f"| {m} | {s['reads_per_step_bytes'] / 1e6:.1f} | {s['positions_opened_rate']:.3f} | "
                     f"{r['mean']:.1f} / {r['p99']:.0f} / {r['max']} | {s['violations']} |")
    hs = result["hidden_state"]
    lines += ["", f"Hidden state: |h| {hs['norm_mean']} on average; its 128 largest coordinates hold "
              f"{hs['top128_coordinate_energy_mean']:.0%} of |h|²; outside its top 128 principal directions |h| is "
              f"{hs['norm_outside_top128_pcs_mean']}. Gap (best kept logit - dropped logit) quantiles: "
              + ", ".join(f"{q}: {v}" for q, v in hs["gap_quantiles"].items()) + "."]
    p = result["prompt_ids"]
    lines += ["", f"Prompt ids: {p['argmax_dropped_in_sequence']} of {p['argmax_dropped']} dropped argmaxes are tokens "
              f"already in the sequence; with them kept, int8-row would still open a row at "
              f"{p['positions_still_opened_int8_row']} positions.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a pruned variant (PRUNE_KEEP in its config.env)")
    p.add_argument("--positions", type=int, default=700, help="held-out positions per set (default %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", type=Path, help="JSON here (default results/vocab/<base>/screens-<keep>.json; .md beside)")
    return p


def main(argv: list[str] | None = None) -> int:
    from scripts.common.hardware import hardware
    from scripts.common.records import git_state, versions
    from scripts.common.variants import VariantError
    from scripts.data.bigbench import BigBenchError
    from scripts.levers.vocab.keep import load_keep_list, pruned_and_parent, vocab_dir

    args = build_parser().parse_args(argv)
    try:
        v, keep_n, parent = pruned_and_parent(args.variant)
        methods = [m for m in args.methods.split(",") if m]
        if bad := sorted(set(methods) - set(METHODS)):
            raise VocabError(f"--methods: unknown {bad}; the screens are {', '.join(METHODS)}")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(parent.model)
        base = v.resolved["BASE"]
        vocab = json.loads(Path(parent.model, "config.json").read_text()).get("vocab_size") or len(tok)
        keep = load_keep_list(base, keep_n, tok, vocab)
        result = study(parent.model, base, keep["kept_ids"], args.positions, methods)
    except (VocabError, VariantError, BigBenchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    record = {"variant": v.name, "parent": parent.name, "keep_list": keep["path"], "keep_sha256": keep["sha256"],
              "command": ["python", "-m", "scripts.levers.vocab.screens", *(argv if argv is not None else sys.argv[1:])],
              "git": git_state(), "versions": versions(), "hardware": hardware(), **result}
    out = paths.write_text_atomic(args.out or vocab_dir(base) / f"screens-{keep_n}.json",
                                  json.dumps(record, indent=1) + "\n")
    paths.write_text_atomic(out.with_suffix(".md"), markdown(result, v.name))
    print(markdown(result, v.name))
    print(f"wrote {paths.shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
