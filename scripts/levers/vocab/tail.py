"""The exact tail fallback of a pruned output vocabulary: a 4-bit screen of the dropped rows with a proven error bound.

    make prune-vocab VARIANT=gemma3-270m-v32k-tail      # PRUNE_TAIL=1 in config.env; nothing is fitted

A pruned head (scripts.levers.vocab.prune) computes logits for the kept rows only, so a dropped token can never be
chosen, even where the parent would choose it. With PRUNE_TAIL=1 the serving plugin also screens every dropped token
on every step, cheaply and without ever missing one that could win:

  1. at load, the dropped rows of the full output matrix (the tied input embedding, which the model keeps anyway) are
     quantized to 4 bits in groups of GROUP columns (asymmetric, BF16 scale and zero point: the layout of torch's CPU
     int4 kernel), and each row's quantization error e_j = w_j - deq(w_j) is measured as a norm;
  2. per step, one int4 product gives every dropped logit approximately: a_j = h . deq(w_j);
  3. by Cauchy-Schwarz the exact logit h . w_j lies within
         bound_j = |h_b| (|e_j| + ARITH |w_j|) + |h - h_b| |w_j| + ARITH |a_j|
     of a_j (h_b: the hidden state in BF16 as the kernel reads it; ARITH covers BF16 rounding of the kernel's output
     and its dequantized weights; |e_j| + ARITH |w_j| is kept per row as its slack);
  4. a dropped row with a_j + bound_j below the best kept logit cannot be the argmax; every other one ("screened in")
     gets its exact logit from its BF16 row. Where more than FULL_FRACTION of the dropped rows are screened in at one
     step, or the step has more than SCREEN_MAX_POSITIONS positions, it reads the whole matrix instead.

The served row is then: kept logits exact, screened-in dropped logits exact, every other dropped logit within its
bound of the parent's (not -inf: sampling sees the tail as the parent does, up to 4-bit error). The greedy choice is
the parent's at every position by construction, not by a margin fitted on data; what remains is the BF16 rounding any
change of kernel has (near-ties, scripts/measure/identity.py). Nothing is fitted or stored: the screen is derived at
load from the very rows the model serves, so it cannot belong to another checkpoint or keep list; build() checks the
bound against exact products before the model serves, and refuses to serve if it does not hold.

This replaces the one-row estimator of the best dropped logit (measured 2026-11-24 at commit cf09158: its error spanned
~10 nats, so to miss no dropped argmax it read the full row at 70-96 % of positions, 0.76x BF16 on Gemma 3 270M).
"""

from __future__ import annotations

from scripts.levers.vocab.keep import VocabError

METHOD = "int4-screen"
GROUP = 32  # columns per quantization group (the hidden size must be a multiple)
ARITH = 2.0 ** -7  # relative slack for BF16 rounding in the kernel (its output and its dequantized weights)
FULL_FRACTION = 0.25  # more dropped rows than this share screened in at one step: one product with the whole matrix
# more positions than this in one step (a prefill asking for prompt log-probabilities, a large batch): the whole matrix
# at once, which costs less there (the CPU int4 kernel's time grows with every position; a BF16 product's hardly does)
SCREEN_MAX_POSITIONS = 8
PACK_ROWS = 64  # the kernel's packing wants a row count that is a multiple of this: zero rows pad it
CHECK_VECTORS = 8  # random hidden states build() checks the bound on


class TailError(VocabError):
    """A tail fallback that cannot serve exactly; the message is one line."""


def config() -> dict:
    """The `tail` entry of a pruned checkpoint's vocab_pruning block."""
    return {"method": METHOD, "group_size": GROUP}


def check_config(entry, where: str) -> None:
    if not isinstance(entry, dict) or entry.get("method") != METHOD or entry.get("group_size") != GROUP:
        raise TailError(f"{where}: vocab_pruning.tail is {entry!r}; this plugin serves {config()} (rebuild with "
                        f"`make prune-vocab`)")


def quantize(rows):
    """(packed int4 rows for the CPU kernel, [groups, rows, 2] BF16 scale and zero, dequantized rows float32)."""
    import torch

    n, k = rows.shape
    g = rows.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo) / scale).clamp(0, 15)
    # the kernel dequantizes (q - 8) * scale + zero with BF16 scale and zero: the error is measured against that
    scale_b, zero_b = scale.bfloat16(), (lo + 8 * scale).bfloat16()
    deq = ((q - 8) * scale_b.float() + zero_b.float()).view(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.view(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([scale_b.squeeze(-1).T, zero_b.squeeze(-1).T], -1).contiguous()
    return packed, scales_zeros, deq


def build(matrix, kept_ids) -> dict:
    """The screen of every row of `matrix` ([vocab, hidden], the full output matrix) not in kept_ids, checked."""
    import torch

    if matrix.device.type != "cpu":
        raise TailError(f"the int4 screen runs on the CPU only (torch's _weight_int4pack_mm_for_cpu); the output "
                        f"matrix is on {matrix.device}")
    vocab, hidden = matrix.shape
    if hidden % GROUP:
        raise TailError(f"hidden size {hidden} is not a multiple of the screen's group of {GROUP}")
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[torch.as_tensor(kept_ids, dtype=torch.long)] = False
    dropped = mask.nonzero().squeeze(1)
    rows = matrix[dropped].float()
    pad = -len(dropped) % PACK_ROWS
    packed, scales_zeros, deq = quantize(torch.cat([rows, rows.new_zeros(pad, hidden)]))
    norm = rows.norm(dim=1)
    slack = (rows - deq[:len(dropped)]).norm(dim=1) + ARITH * norm  # the bound per unit of |h_b|
    s = {"dropped": dropped, "packed": packed, "scales_zeros": scales_zeros, "slack": slack, "norm": norm,
         "max_slack": float(slack.max()), "max_norm": float(norm.max())}
    check_bound(s, matrix)
    return s


def products(h, s):
    """(every dropped row's approximate logit, float32 [positions, dropped]; |h_b| and |h - h_b| per position)."""
    import torch

    hb = h.to(torch.bfloat16)
    a = torch._weight_int4pack_mm_for_cpu(hb, s["packed"], GROUP, s["scales_zeros"])[:, :len(s["dropped"])].float()
    hbf = hb.float()
    return a, hbf.norm(dim=1), (h.float() - hbf).norm(dim=1)


def approx_and_bound(h, s):
    """Every dropped row's approximate logit and the bound on its error, float32 [positions, dropped]."""
    a, hn, hq = products(h, s)
    return a, hn[:, None] * s["slack"] + hq[:, None] * s["norm"] + ARITH * a.abs()


def check_bound(s, matrix, h=None) -> None:
    """Refuse a screen whose bound does not hold on exact products (a kernel whose layout or arithmetic is not the
    one assumed here): random hidden states, scaled like a final norm's output, unless given."""
    import torch

    if h is None:
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(CHECK_VECTORS, matrix.shape[1], generator=gen) * 4
    h = h.to(matrix.dtype)
    a, bound = approx_and_bound(h, s)
    exact = h.float() @ matrix[s["dropped"]].float().T
    worst = float(((exact - a).abs() / bound).max())
    if worst > 1:
        raise TailError(f"the int4 screen's error bound fails on exact products (error {worst:.2f}x the bound): this "
                        f"torch's int4 kernel is not the one the screen assumes")


def screen(h, s, max_kept):
    """(approximate dropped logits, bool [positions, dropped]: rows that could beat the best kept logit).

    A row passes where a + bound >= T (T: the best kept logit less its BF16 rounding). Two passes keep that cheap:
    the largest slack and norm over all rows give one threshold L per position that every passing row's a must reach
    (a + ARITH |a| is increasing in a), and only rows at or above it get their own bound."""
    import torch

    a, hn, hq = products(h, s)
    t = max_kept.float() - ARITH * max_kept.float().abs()
    r = t - hn * s["max_slack"] - hq * s["max_norm"]
    low = torch.where(r >= 0, r / (1 + ARITH), r / (1 - ARITH))
    pos, row = (a >= low[:, None]).nonzero(as_tuple=True)
    av = a[pos, row]
    keep = av + hn[pos] * s["slack"][row] + hq[pos] * s["norm"][row] + ARITH * av.abs() >= t[pos]
    screened_in = torch.zeros_like(a, dtype=torch.bool)
    screened_in[pos[keep], row[keep]] = True
    return a, screened_in


def fill(h, kept_logits, kept_idx, s, matrix, vocab: int):
    """The full row of logits for these hidden states: kept ones as given, dropped ones screened and recomputed where
    they could win. Returns (logits [positions, vocab] in kept_logits' dtype, counters of this step)."""
    mx = kept_logits.float().max(-1).values
    full = kept_logits.new_empty(kept_logits.shape[0], vocab)
    full.index_copy_(1, kept_idx, kept_logits)
    if h.shape[0] > SCREEN_MAX_POSITIONS:
        screened_in, rows, whole = None, s["dropped"], True
    else:
        a, screened_in = screen(h, s, mx)
        full.index_copy_(1, s["dropped"], a.to(full.dtype))
        rows = screened_in.any(0).nonzero().squeeze(1)
        whole = rows.numel() > FULL_FRACTION * len(s["dropped"])
    if whole:
        exact = (h.to(matrix.dtype) @ matrix[:vocab].T)[:, s["dropped"]]
        ids = s["dropped"]
    elif rows.numel():
        ids = s["dropped"][rows]
        exact = h.to(matrix.dtype) @ matrix.index_select(0, ids).T
    else:
        ids, exact = None, None
    if ids is not None:
        full.index_copy_(1, ids, exact.to(full.dtype))
    wins = 0 if exact is None else int((exact.float().max(-1).values > mx).sum())
    counts = {"positions": int(h.shape[0]), "rows_recomputed": 0 if whole else int(rows.numel()),
              "positions_screened_in": int(h.shape[0]) if screened_in is None else int(screened_in.any(1).sum()),
              "whole_matrix_reads": int(whole), "dropped_argmax": wins}
    return full, counts
