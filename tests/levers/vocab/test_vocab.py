"""Vocabulary pruning: ranking and coverage (pure logic), keep-list checks, and a pruned variant served by the real
vLLM server through the project's model plugin (slow)."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import sys
from collections import Counter

import pytest

from scripts.levers.vocab import keep as vocab
from scripts.levers.vocab import tail
from scripts.levers.vocab.analyze import coverage_curve, n_for, rank


class FakeToken:
    def __init__(self, content: str, special: bool = True):
        self.content, self.special = content, special


class FakeTokenizer:
    """Byte-fallback vocabulary: <pad> <eos> <bos> <unused0>, 256 byte tokens, then words."""

    chat_template = None

    def __init__(self, words: int = 100):
        self.vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unused0>": 3}
        self.vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
        self.vocab.update({f"w{i}": 260 + i for i in range(words)})
        self.all_special_ids = [0, 1, 2]
        self.added_tokens_decoder = {0: FakeToken("<pad>"), 1: FakeToken("<eos>"), 2: FakeToken("<bos>"),
                                     3: FakeToken("<unused0>")}

    def get_vocab(self):
        return dict(self.vocab)

    def convert_ids_to_tokens(self, ids):
        inv = {v: k for k, v in self.vocab.items()}
        return [inv[i] for i in ids]

    def __len__(self):
        return len(self.vocab)


def test_always_kept_specials_and_bytes_not_unused():
    kept = vocab.always_kept(FakeTokenizer())
    assert kept["special"] == [0, 1, 2]  # <unused0> is a reserved placeholder, not kept for its own sake
    assert len(kept["single_byte"]) == 256 and kept["chat_template"] == []


def test_rank_puts_always_kept_first_then_shares_then_unseen_by_id():
    text = Counter({300: 10, 301: 5})
    gen = Counter({301: 1, 302: 1})  # shares: 301 = 5/15 + 1/2, 300 = 10/15, 302 = 1/2
    r = rank(310, [text, gen], first=[0, 1])
    assert r[:5] == [0, 1, 301, 300, 302]
    assert r[5:] == [t for t in range(310) if t not in (0, 1, 300, 301, 302)]
    assert sorted(r) == list(range(310))


def test_coverage_and_n_for():
    counts = Counter({5: 90, 6: 9, 7: 1})
    assert n_for(counts, 0.9) == 1 and n_for(counts, 0.99) == 2 and n_for(counts, 0.999) == 3
    curve = coverage_curve(counts, [5, 6, 7], [1, 2, 3])
    assert curve == {1: 0.9, 2: 0.99, 3: 1.0}


def write_keep(tmp_path, monkeypatch, tok, ids, n=None, fingerprint=None):
    monkeypatch.setattr(vocab, "vocab_dir", lambda base: tmp_path)
    n = n or len(ids)
    (tmp_path / f"keep-{n}.json").write_text(json.dumps({
        "tokenizer_sha256": fingerprint or vocab.tokenizer_fingerprint(tok), "kept_ids": ids}))
    return n


def test_keep_list_accepted(tmp_path, monkeypatch):
    tok = FakeTokenizer()
    ids = [0, 1, 2, *range(4, 260), 260, 261]
    n = write_keep(tmp_path, monkeypatch, tok, ids)
    assert vocab.load_keep_list("fake", n, tok, len(tok))["kept_ids"] == ids


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"),
    ("tokenizer", "another tokenizer"),
    ("too_big", "larger than the vocabulary"),
    ("duplicates", "distinct"),
    ("special", "lacks 1 always-kept tokens (special"),
    ("byte", "single_byte"),
])
def test_keep_list_refused(tmp_path, monkeypatch, case, message):
    tok = FakeTokenizer()
    ids = [0, 1, 2, *range(4, 260), 260, 261]
    if case == "missing":
        monkeypatch.setattr(vocab, "vocab_dir", lambda base: tmp_path)
        n = 7
    elif case == "tokenizer":
        n = write_keep(tmp_path, monkeypatch, tok, ids, fingerprint="0" * 64)
    elif case == "too_big":
        n = write_keep(tmp_path, monkeypatch, tok, ids, n=len(tok) + 1)
    elif case == "duplicates":
        n = write_keep(tmp_path, monkeypatch, tok, [*ids[:-1], 260])
    elif case == "special":
        n = write_keep(tmp_path, monkeypatch, tok, [i for i in ids if i != 1] + [262])
    else:
        n = write_keep(tmp_path, monkeypatch, tok, [i for i in ids if i != 4] + [262])
    with pytest.raises(vocab.VocabError, match=message.replace("(", r"\(")):
        vocab.load_keep_list("fake", n, tok, len(tok))


def test_plugin_registers_every_base():
    from vllm import ModelRegistry

    from scripts.levers.vocab.plugin import register

    register()
    archs = ModelRegistry.get_supported_archs()
    assert all(vocab.PLUGIN_PREFIX + b in archs for b in vocab.PLUGIN_BASES)


def test_plugin_is_an_installed_entry_point():
    """vLLM finds plugins only through installed entry points (`make install` installs the project editable)."""
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "scripts.levers.vocab.plugin:register" for ep in eps)


# ------------------------------------------------------------------------------------------------ real vLLM (slow)
PRUNED = "smollm2-v16k"
# eager: the plugin computes the logits outside the compiled forward: compiled mode adds a start, not coverage
EAGER = "SERVE_ENFORCE_EAGER=1"  # compiled only in the session server, where TEST_ENFORCE_EAGER is 0 (tests/conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])  # SIGKILL: the conversion's test (tests/weights)
def test_pruning_killed_midway_leaves_the_old_checkpoint_or_none(embedded_weights, sig):
    """prune-vocab stopped while it writes: weights/<variant> is untouched (or still absent)."""
    from scripts.common import paths
    from tests.conftest import assert_killed_cleanly, kill_midway

    dest = paths.WEIGHTS / PRUNED
    before = dest.stat().st_mtime if dest.exists() else None
    rc, out = kill_midway([sys.executable, "-m", "scripts.levers.vocab.prune", PRUNED, "--force"], dest, sig)
    assert_killed_cleanly(rc, sig, dest, before, out)


def test_pruned_only_logits_put_the_kept_rows_at_their_ids_and_drop_the_rest():
    """The pruned-only head (no tail entry): kept logits at their original ids, -inf elsewhere, so greedy picks the
    best kept id where the parent's argmax is dropped. (The real server's pruned head is checked through the tail
    variant below, which adds only the screen to the same model class.)"""
    import torch

    from scripts.levers.vocab.plugin import scatter_kept

    kept = torch.tensor([0, 3, 5])
    full = scatter_kept(torch.tensor([[1.0, 4.0, 2.0], [0.5, -1.0, 0.25]]), kept, 7)
    assert full.shape == (2, 7) and full[:, [1, 2, 4, 6]].isinf().all() and (full[:, [1, 2, 4, 6]] < 0).all()
    assert full[0, 3] == 4.0 and full.argmax(-1).tolist() == [3, 0]


TAIL = "smollm2-v16k-tail"


@pytest.fixture(scope="module")
def tail_server(embedded_weights, tmp_path_factory):
    """The tail-fallback variant, built and served (the plugin derives its int8 screen at load); its counters are
    written to tail.json (set like any server setting: the variant's config.env names its own path)."""
    from scripts.levers.vocab.plugin import STATS_ENV
    from scripts.levers.vocab.prune import prune
    from tests.conftest import serve

    # the build's report on the committed held-out answers (held-out BIG-bench text needs `make datasets`, which
    # `make test` does not run); its head timings 5 calls each (nothing here reads them)
    prune(TAIL, record_dir=tmp_path_factory.mktemp("prune-tail-record"), tail_positions=128,
          tail_sets=("answers/held_out", "generations/held_out"), timing_repeat=5)
    d = tmp_path_factory.mktemp("serve-tail")
    with serve(TAIL, d, [f"ENV_{STATS_ENV}={d / 'tail.json'}", EAGER]) as s:
        yield s, d / "tail.json"


def dropped_argmax_prompt(model, tok, kept: set[int]) -> tuple[list[int], int]:
    """A prompt whose parent argmax is a dropped id: a dropped word repeated, which the parent goes on copying."""
    import torch

    words = [i for i in range(len(tok)) if i not in kept and tok.decode([i]).strip().isalpha()
             and len(tok.decode([i]).strip()) >= 5 and tok.decode([i]).startswith(" ")]
    for t in words[:300]:
        ids = tok(f"Repeat the word:{tok.decode([t]) * 6}", add_special_tokens=False).input_ids
        with torch.no_grad():
            best = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if best not in kept:
            return ids, best
    raise AssertionError("no dropped-argmax prompt among 300 dropped words")


@pytest.mark.slow
def test_tail_fallback_greedy_output_is_the_parents(tail_server, hf_reference):
    """Served through the plugin, the tail-fallback variant picks the parent's argmax at every position (up to a BF16
    near-tie), including a position whose argmax is a dropped id, and its counters show that position and a screen
    that recomputes a few rows, not the whole matrix."""
    from scripts.common import paths
    from scripts.common.loadgen import openai_client
    from tests.conftest import assert_parents_greedy

    server, stats = tail_server
    model, tok = hf_reference
    kept = set(json.loads((paths.WEIGHTS / TAIL / vocab.ID_MAP).read_text())["kept_ids"])
    client = openai_client(server.base_url)
    prompt_ids, dropped = dropped_argmax_prompt(model, tok, kept)
    r = client.completions.create(model=TAIL, prompt=prompt_ids, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True}).model_dump()
    cases = [(prompt_ids, r["choices"][0]["token_ids"])]
    assert cases[0][1][0] == dropped, f"served {tok.decode(cases[0][1][:1])!r}, parent's argmax {tok.decode([dropped])!r}"
    for p in ["Write a haiku about the sea.", "Explain what a hash table is in two sentences.",
              "Translate 'good morning' into French and German."]:
        r = client.chat.completions.create(model=TAIL, messages=[{"role": "user", "content": p}], max_tokens=40,
                                           temperature=0, extra_body={"return_token_ids": True}).model_dump()
        cases.append((r["prompt_token_ids"], r["choices"][0]["token_ids"]))
    assert_parents_greedy(model, tok, cases)
    held_out = json.loads((paths.WEIGHTS / TAIL / "PROVENANCE.json").read_text())["tail_fallback"]["held_out"]
    for name, r in held_out["sets"].items():  # the build's own check on the parent's held-out positions
        assert r["argmax_dropped_screened_in"] == r["argmax_dropped"] and r["max_error_over_bound"] <= 1, name
    counts = json.loads(stats.read_text())
    assert counts["method"] == tail.METHOD and counts["positions"] > 0 and counts["dropped_argmax"] >= 1
    # served on the fastest of the kernels this CPU computes exactly (oneDNN needs VNNI or AMX), each one timed
    exact = tail.exact_kernels()
    assert counts["kernel"] in exact and set(counts["kernels_timed_us"] or {counts["kernel"]: 0}) == set(exact)
    timed = counts["kernels_timed_us"] or {}
    assert all(sum(t.values()) >= sum(timed[counts["kernel"]].values()) for t in timed.values() if "refused" not in t)
    assert "refused" not in timed.get(tail.INT5, {}), timed  # the 5-bit screen built, checked and timed in the server
    # the 5-bit screen, where it is the fastest at load, serves the first steps (the dropped-argmax prompt's among them)
    assert counts["kernel"] != tail.INT5 or counts[f"calls:{tail.INT5}"] >= tail.ONLINE_TRIALS, counts
    assert counts["rows_recomputed"] > 0 and counts["whole_matrix_reads"] < counts["calls"]


@pytest.mark.slow
def test_pruned_accepts_any_input_text(tail_server, hf_reference):
    """Text made of rare and dropped tokens is accepted and tokenized exactly as the parent tokenizes it (a pruned
    checkpoint's input side: its embedding keeps every row)."""
    from scripts.common import paths
    from scripts.common.loadgen import openai_client

    _, tok = hf_reference
    kept = set(json.loads((paths.WEIGHTS / TAIL / vocab.ID_MAP).read_text())["kept_ids"])
    dropped = [i for i in range(len(tok)) if i not in kept and i not in tok.all_special_ids]
    rng = random.Random(0)
    client = openai_client(tail_server[0].base_url)
    for _ in range(3):
        text = tok.decode(rng.sample(dropped, 24))
        r = client.completions.create(model=TAIL, prompt=text, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens == len(tok(text).input_ids)
        assert r.usage.completion_tokens > 0
    r = client.completions.create(model=TAIL, prompt=rng.sample(dropped, 16), max_tokens=4, temperature=0)
    assert r.usage.completion_tokens > 0


def test_parity_of_a_pruned_checkpoint_on_a_tiny_model(tmp_path):
    """eval_parity's pruned path on a 2-layer random Llama: KL over kept ids ~0, argmax coverage and dropped mass
    as computed directly from the reference's distribution, NLL only where the gold id is kept."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from scripts.measure.parity import per_token_transformers

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    ref, var = tmp_path / "ref", tmp_path / "var"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(ref)
    tensors = load_file(ref / "model.safetensors")
    kept = sorted(random.Random(1).sample(range(300), 200))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][kept].contiguous()
    var.mkdir()
    save_file(tensors, var / "model.safetensors")
    c = json.loads((ref / "config.json").read_text())
    c.update(tie_word_embeddings=False, vocab_pruning={"id_map": vocab.ID_MAP, "kept": 200})
    (var / "config.json").write_text(json.dumps(c))
    (var / vocab.ID_MAP).write_text(json.dumps({"vocab_size": 300, "kept_ids": kept}))
    chunk = [random.Random(2).randrange(300) for _ in range(64)]
    kld, agree, nll_r, nll_v, stats = next(per_token_transformers(str(ref), str(var), [chunk]))
    assert len(kld) == 32 and max(kld) < 1e-3
    assert stats["argmax_kept"] == agree  # the variant's argmax is the reference's wherever that is kept
    gold_kept = [t in set(kept) for t in chunk[32:]]
    assert stats["gold_kept"] == gold_kept and len(nll_r) == len(nll_v) == sum(gold_kept)
    assert all(v <= r + 1e-4 for r, v in zip(nll_r, nll_v, strict=True))  # renormalized on fewer ids
    assert all(0 < m < 1 for m in stats["dropped_mass"])


def test_base_model_chat_template_joins_contents_after_bos():
    """eval/templates/base-plain.jinja (SERVE_CHAT_TEMPLATE of the gemma3-270m variants): no turn markers."""
    import jinja2

    from scripts.common import paths

    template = jinja2.Template((paths.EVAL / "templates" / "base-plain.jinja").read_text())
    text = template.render(bos_token="<bos>", messages=[{"role": "system", "content": "A"},
                                                        {"role": "user", "content": "B"}])
    assert text == "<bos>A\n\nB"


def test_a_tail_build_without_the_held_out_data_is_one_line_before_any_work(embedded_weights, tmp_path, monkeypatch,
                                                                            capsys):
    """`make prune-vocab` of a tail variant whose held-out report reads BIG-bench, without `make datasets`: one line
    naming the command, exit 2, weights/<variant> untouched."""
    from scripts.common import paths
    from scripts.data import bigbench
    from scripts.levers.vocab import prune

    monkeypatch.setattr(bigbench, "DATA", tmp_path / "no-bigbench")
    monkeypatch.setattr(prune, "time_head", lambda *a, **k: pytest.fail("the build went on without its data"))
    dest = paths.WEIGHTS / "smollm2-v16k-tail"
    before = dest.stat().st_mtime if dest.exists() else None
    assert prune.main(["smollm2-v16k-tail", "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "make datasets" in err and "\n" not in err, err
    assert (dest.stat().st_mtime if dest.exists() else None) == before


def test_fingerprint_is_the_same_under_every_python():
    """A keep list made under one Python is accepted under another: no character is hashed as this Python's repr()
    writes it (U+1FA76, an emoji of Unicode 15, is escaped by Python 3.11's repr() and printed by 3.12's)."""
    class Tok:
        def get_vocab(self):
            return {"\U0001FA76": 1, "a": 0}
    want = hashlib.sha256(b'[["a", 0], ["\\ud83e\\ude76", 1]]').hexdigest()
    assert vocab.tokenizer_fingerprint(Tok()) == want
