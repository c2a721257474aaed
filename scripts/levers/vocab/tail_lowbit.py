"""The exact tail's low-bit screen on a CPU ("int5-g32" in tail.KERNELS): 5-bit rows, 0.69 bytes a value against the
int8 screen's 1.0 (Gemma 3's dropped rows: 101 MB against 147.7), bound per group of 32 values, in one C kernel
(tail_lowbit.c) built for this CPU at first use.

Every dropped row is stored as values q in -L..L (L = 15 for 5 bits, 7 for 4) with one fp16 scale s per 32 values,
rounded up so that |w/s| <= L and no value is clipped. Per step each position's h is rounded to int8 with one scale t
per group of 32 (x = round(h/t), delta = h - t x), and the kernel computes, for every row at once, the approximate
logit and its bound

    est   = sum_g s_g t_g (q_g . x_g)                       (integer dot products: exact)
    bound = sum_g s_g (1/2 |h_g|_1 + L |delta_g|_1 + rounding)

since w . h - est = sum_g (w_g - s_g q_g) . h_g + s_g q_g . delta_g, |w - s q| <= s/2 value by value and |q| <= L:
an L1 bound per group (Hoelder). tail.lowbit_screen() keeps a row only where the row's Cauchy-Schwarz bound (the int8
screen's, on these rows) reaches the threshold too. Why 5 bits and not 4: on Gemma 3's 2,240 held-out positions
(results/vocab/gemma3-270m/screens-32768.md) the 4-bit screen reads 82.6 MB a step but opens 3,241 rows a position on
average and 61,927 at p99 (a quarter of the rows, where the whole matrix must be read), the 5-bit one 100.9 MB and
36 rows (833 at p99). The 4-bit layout stays for that study.

The kernel (AVX-512 VNNI; AVX2 with vpmaddubsw, whose 16-bit pair sums cannot saturate here: 2 x 30 x 127 = 7620;
plain C elsewhere) reads each block of 16 rows once for up to 8 positions and writes the estimates and the pass
flags (and, on request, the bounds) as arrays, or, on a served step (serve()), the estimates straight into the
step's logits at the rows' ids and the list of passing (position, row) pairs. It runs on the OpenMP threads torch
already has (linked to torch's own libgomp where torch ships one), and is compiled with the system C compiler (`cc`,
as torch.compile needs one for vLLM's CPU backend) with -march=native into .cache/tail-lowbit/, keyed by the source,
the compiler and this CPU's flags. No compiler: tail.fastest() leaves this kernel out with that line and serves an
int8 one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from scripts.common import paths

SOURCE = Path(__file__).with_name("tail_lowbit.c")
GROUP, MAX_POSITIONS, BLOCK, BITS = 32, 8, 16, 5
MAX_PAIRS = 1 << 16  # passing (position, row) pairs a served call lists; past it the caller reads the whole matrix
LEVELS = {4: 7, 5: 15}  # q in -L..L
WEIGHT_SLACK = 2.0 ** -10  # |w - s q| <= s/2 up to the float32 rounding of w/s (relative)
SUM_SLACK = 2.0 ** -10  # the float32 sums of the bound itself (relative to the bound)
MARCH = "native"  # the code path follows the compiler's target (the tests build the others too)
_LIB = None


class LowbitError(RuntimeError):
    """The low-bit screen cannot run here; the message is one line."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise LowbitError("no C compiler (cc) to build the low-bit screen; install gcc (the int8 screens need none)")
    return cc


def _torch_gomp() -> Path | None:
    import torch

    found = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    return found[0] if found else None


def library_path() -> Path:
    """The kernel built for this CPU (built now if it is not in .cache/tail-lowbit/), written atomically."""
    from scripts.common.hardware import all_cpu_flags

    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError) as e:
        raise LowbitError(f"`{cc} --version` failed ({type(e).__name__}): the low-bit screen needs a C "
                          f"compiler") from None
    gomp = _torch_gomp()
    key = hashlib.sha256("\n".join([SOURCE.read_text(), cc, version, MARCH, str(gomp),
                                   " ".join(sorted(all_cpu_flags()))]).encode()).hexdigest()[:16]
    out = paths.CACHE / "tail-lowbit" / f"tail_lowbit-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    obj, tmp = out.with_suffix(f".{os.getpid()}.o"), out.with_suffix(f".{os.getpid()}.tmp")
    flags = ["-O3", f"-march={MARCH}", "-fopenmp", "-fPIC", "-std=c11"]
    # torch's own libgomp where it ships one: the kernel's parallel loops then share torch's (and vLLM's) threads
    link = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
    try:
        for cmd in ([cc, *flags, "-c", str(SOURCE), "-o", str(obj)], [cc, "-shared", str(obj), *link, "-o", str(tmp)]):
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                first = (done.stderr.strip().splitlines() or ["no output"])[0]
                raise LowbitError(f"`{' '.join(cmd)}` failed: {first}")
        os.replace(tmp, out)
    finally:
        obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def library():
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(library_path()))
        lib.lab_lowbit_screen.restype = ctypes.c_int
        lib.lab_lowbit_screen.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                                          *[ctypes.c_void_p] * 5, ctypes.c_int, *[ctypes.c_void_p] * 4, ctypes.c_int,
                                          ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_long, ctypes.c_void_p]
        lib.lab_lowbit_isa.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def isa() -> str:
    return {2: "avx512-vnni", 1: "avx2", 0: "c"}[library().lab_lowbit_isa()]


def group_values(rows, bits: int = BITS):
    """(fp16 scale per group of 32 values [n, hidden / 32], values q in -L..L as float32 [n, hidden / 32, 32]) of
    these rows (float32 [n, hidden]): each scale the group's largest |w| / L rounded up in fp16, so no value is clipped
    and |w - s q| <= s / 2 value by value. The CPU kernel's layout (pack()) and the GPU's (tail_triton.pack5()) both
    store these."""
    import torch

    n, d = rows.shape
    if d % GROUP:
        raise LowbitError(f"the low-bit screen needs a hidden size that is a multiple of {GROUP}, not {d}")
    lv = LEVELS[bits]
    g = rows.reshape(n, d // GROUP, GROUP)
    want = (g.abs().amax(-1) / lv).clamp(min=2.0 ** -24)
    if float(want.max()) > 65504:
        raise LowbitError(f"a group's scale {float(want.max()):.4g} does not fit fp16: the low-bit screen cannot "
                          f"store it")
    s16 = want.to(torch.float16)
    s16 = torch.where(s16.float() < want, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    return s16, torch.round(g / s16.float()[..., None]).clamp(-lv, lv)


def pack(rows, bits: int = BITS) -> dict:
    """The kernel's data for these rows (float32 [n, hidden], hidden a multiple of 32): packed values (4 bits, and a
    bit plane for the fifth) and fp16 scales in blocks of 16 rows (tail_lowbit.c's layout), and the bytes a step
    reads."""
    import torch

    n, d = rows.shape
    lv = LEVELS[bits]
    s16, q = group_values(rows, bits)
    pad = -n % BLOCK
    u = (q.to(torch.int16) + lv).to(torch.uint8).reshape(n, d)
    sc = s16
    if pad:
        u = torch.cat([u, u.new_full((pad, d), lv)])
        sc = torch.cat([sc, sc.new_zeros(pad, d // GROUP)])
    nb, groups = (n + pad) // BLOCK, d // GROUP
    u = u.reshape(nb, BLOCK, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # block, group, pair, half, row, value
    nib = u & 0x0F
    parts = [(nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).reshape(nb, groups, 4, 64)]
    if bits == 5:  # bit i of a half's mask: the fifth bit of the value in byte i
        weights = (2 ** torch.arange(8, dtype=torch.int32)).reshape(1, 1, 1, 1, 1, 8)
        planes = ((u >> 4).to(torch.int32).reshape(nb, groups, 4, 2, 8, 8) * weights).sum(-1).to(torch.uint8)
        parts.append(planes.reshape(nb, groups, 4, 16))
    packed = torch.cat(parts, -1).contiguous()
    scales = sc.reshape(nb, BLOCK, groups).permute(0, 2, 1).contiguous().view(torch.int16)
    return {"lb_w": packed.reshape(-1), "lb_s": scales.reshape(-1), "rows": n, "hidden": d, "bits": bits,
            "bytes": packed.numel() + scales.numel() * 2}


def activations(h, bits: int = BITS):
    """(x int8 [m, hidden], t float32 [m, groups], corr int32, beta float32) of tail_lowbit.c for these positions."""
    import torch

    m, d = h.shape
    lv = LEVELS[bits]
    hg = h.float().reshape(m, d // GROUP, GROUP)
    t = (hg.abs().amax(-1) / 127).clamp(min=2.0 ** -100)
    x = torch.round(hg / t[..., None]).clamp(-127, 127)
    delta = hg.double() - x.double() * t.double()[..., None]  # exact: x t has at most 31 significant bits
    rounding = (d // GROUP + 4) * 2.0 ** -23 * lv * t.double() * x.abs().sum(-1).double()
    beta = (0.5 * (1 + WEIGHT_SLACK) * hg.double().abs().sum(-1) + lv * delta.abs().sum(-1) + rounding)
    beta = (beta * (1 + SUM_SLACK)).float()
    beta = torch.nextafter(beta, torch.full_like(beta, float("inf")))  # float32 rounding of beta, upwards
    corr = (lv * x.sum(-1)).to(torch.int32)
    return x.to(torch.int8).reshape(m, d).contiguous(), t.contiguous(), corr.contiguous(), beta.contiguous()


def rounded(h, bits: int = BITS, act=None):
    """h as the kernel multiplies it (float32 [m, hidden]): t x, group by group (act: activations(h), if at hand)."""
    x, t, _, _ = act or activations(h, bits)
    return (x.float().reshape(len(h), -1, GROUP) * t[..., None]).reshape(h.shape)


def _rows(act, i: int, j: int):
    """Positions i..j of activations() (None stays None)."""
    return None if act is None else tuple(a[i:j] for a in act)


def _ptr(a):
    return None if a is None else a.data_ptr()


def _call(h, s: dict, thr, est=None, bound=None, passed=None, out=None, pairs=None, act=None) -> int:
    """The kernel over these positions (at most MAX_POSITIONS); the number of passing pairs where pairs is given."""
    m = h.shape[0]
    x, t, corr, beta = act or activations(h, s["bits"])
    count = ctypes.c_long(0)
    rc = library().lab_lowbit_screen(
        s["lb_w"].data_ptr(), s["lb_s"].data_ptr(), s["rows"], s["hidden"], s["bits"], x.data_ptr(), t.data_ptr(),
        corr.data_ptr(), beta.data_ptr(), thr.data_ptr(), m, _ptr(est), _ptr(bound), _ptr(passed), _ptr(out),
        int(out is not None and out.element_size() == 2), _ptr(s["dropped"]) if out is not None else None,
        out.shape[1] if out is not None else 0, _ptr(pairs[0] if pairs else None), _ptr(pairs[1] if pairs else None),
        0 if pairs is None else len(pairs[1]), ctypes.addressof(count) if pairs is not None else None)
    if rc:
        raise LowbitError(f"the low-bit screen refused {m} positions of {s['hidden']} values")
    return count.value


def run(h, s: dict, thr, want_bound: bool = False, act=None):
    """(est float32 [m, rows], pass bool [m, rows], bound float32 or None) for positions h against thresholds thr
    (float32 [m]); up to MAX_POSITIONS positions a call, more in turns (act: activations(h), if at hand)."""
    import torch

    m, n = h.shape[0], s["rows"]
    est = torch.empty(m, n, dtype=torch.float32)
    passed = torch.empty(m, n, dtype=torch.uint8)
    bound = torch.empty(m, n, dtype=torch.float32) if want_bound else None
    thr = thr.float().contiguous()
    for i in range(0, m, MAX_POSITIONS):
        j = min(m, i + MAX_POSITIONS)
        _call(h[i:j], s, thr[i:j], est[i:j], None if bound is None else bound[i:j], passed[i:j],
              act=_rows(act, i, j))
    return est, passed.view(torch.bool), bound


def serve(h, s: dict, thr, out, max_pairs: int = MAX_PAIRS, act=None):
    """The served step: every row's estimate written into out (the step's logits, [m, vocab] BF16 or float32, at the
    rows' ids s["dropped"]) and the (position, row, estimate) of each row that passes, or None where more than
    max_pairs pass at some call (the caller then reads the whole matrix). act: activations(h), if at hand."""
    import torch

    if out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous():
        raise LowbitError(f"the low-bit screen writes BF16 or float32 logits in one block, not {out.dtype}")
    thr = thr.float().contiguous()
    pos, row, est = [], [], []
    for i in range(0, h.shape[0], MAX_POSITIONS):
        j = min(h.shape[0], i + MAX_POSITIONS)
        pairs = (torch.empty(max_pairs, 2, dtype=torch.int32), torch.empty(max_pairs, dtype=torch.float32))
        count = _call(h[i:j], s, thr[i:j], out=out[i:j], pairs=pairs, act=_rows(act, i, j))
        if count > max_pairs:
            return None
        pos.append(pairs[0][:count, 0].long() + i)
        row.append(pairs[0][:count, 1].long())
        est.append(pairs[1][:count])
    return torch.cat(pos), torch.cat(row), torch.cat(est)


def dequantize(s: dict):
    """The rows as the kernel sees them (float32 [rows, hidden]): s q, unpacked from the kernel's layout."""
    import torch

    n, d, bits = s["rows"], s["hidden"], s["bits"]
    groups = d // GROUP
    b = s["lb_w"].reshape(-1, groups, 4, 80 if bits == 5 else 64)
    nib = b[..., :64].reshape(-1, groups, 4, BLOCK, 4)  # block, group, pair, row, value
    u = torch.stack([nib & 0x0F, nib >> 4], 3).to(torch.int16)  # block, group, pair, half, row, value
    if bits == 5:
        planes = b[..., 64:].reshape(-1, groups, 4, 2, 8, 1).to(torch.int16)
        fifth = (planes >> torch.arange(8, dtype=torch.int16).reshape(1, 1, 1, 1, 1, 8)) & 1
        u = u | (fifth.reshape(u.shape) << 4)
    u = u.permute(0, 4, 1, 2, 3, 5).reshape(-1, d)[:n]
    sc = s["lb_s"].view(torch.float16).reshape(-1, groups, BLOCK).permute(0, 2, 1).reshape(-1, groups)[:n]
    q = u - LEVELS[bits]
    return (q.float().reshape(n, groups, GROUP) * sc.float()[..., None]).reshape(n, d)
