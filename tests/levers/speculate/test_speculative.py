"""Speculative decoding: the prompt set's splits, variant and head checks, identity and distillation logic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.common import paths, variants
from scripts.common.checkpoint import CheckpointError
from scripts.levers.speculate import prompts as make_spec_prompts
from scripts.levers.speculate import redistill as redistill_mtp
from scripts.measure import identity as eval_identity
from scripts.serve import plan


def rows(split: str) -> list[dict]:
    return [json.loads(x) for x in (paths.EVAL / "prompts" / f"spec-v1-{split}.jsonl").read_text().splitlines()]


def test_spec_prompts_are_generated_by_the_committed_script():
    for name, text in make_spec_prompts.render().items():
        assert (paths.EVAL / "prompts" / name).read_text() == text, f"{name}: run python -m scripts.levers.speculate.prompts"


def test_spec_prompt_splits_never_overlap():
    train, held = rows("train"), rows("eval")
    assert len(train) + len(held) >= 300 and len(held) >= 100
    text = lambda r: r["messages"][0]["content"]  # noqa: E731
    assert not {text(r) for r in train} & {text(r) for r in held}
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    # no evaluation prompt rewords a training one: the family (everything after the kind's verb) is never shared
    for kind, part in (("explain", 0), ("code", -1)):
        stems = [{text(r).split(" to ")[part] for r in rows if r["group"] == kind} for rows in (train, held)]
        assert not stems[0] & stems[1]
    assert {r["group"] for r in held} == {"explain", "list", "code", "writing", "rewrite", "passage-qa"}


# ---- speculative variants: config validation, the head check (no server)


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle3", "num_speculative_tokens": 17}', "integer in 1..16, got 17"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "integer in 1..16, got 0"),
    ('{"num_speculative_tokens": 4}', 'JSON object with a "method"'),
    ('["ngram", 4]', 'JSON object with a "method"'),
])
def test_speculative_config_is_checked_with_file_and_line(tmp_path, value, message):
    (tmp_path / "x-spec").mkdir()
    (tmp_path / "x-spec" / "config.env").write_text(f"MODEL=weights/x\nBASE=x\n# K\nSERVE_SPECULATIVE_CONFIG={value}\n")
    with pytest.raises(variants.VariantError, match=f"config.env:4: .*{message}"):
        variants.load_variant("x-spec", root=tmp_path, target="cpu")


def test_head_path_becomes_absolute_for_vllm():
    v = variants.load_variant("smollm2-bf16-eagle4", target="cpu")
    spec = json.loads(v.serve_settings()["speculative-config"])
    assert spec["model"] == str(paths.WEIGHTS / "smollm2-bf16-eagle-head") and spec["num_speculative_tokens"] == 4
    assert variants.head_dir(variants.load_variant("smollm2-ngram4", target="cpu")) is None


def test_missing_or_mismatched_head_is_refused(tmp_path, monkeypatch):
    target, head = tmp_path / "target", tmp_path / "head"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152}))
    v = variants.Variant("x-eagle4", tmp_path, {}, {"MODEL": str(target), "BASE": "x", "SERVE_SPECULATIVE_CONFIG":
                         json.dumps({"method": "eagle3", "model": "weights/h", "num_speculative_tokens": 4})})
    monkeypatch.setattr(plan, "head_dir", lambda _v: head)
    with pytest.raises(CheckpointError, match="make redistill VARIANT=x-eagle4"):
        plan.check_head(v)
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"transformer_layer_config": {"hidden_size": 960, "vocab_size": 49152}}))
    (head / "PROVENANCE.json").write_text(json.dumps({"target": "other-bf16"}))
    with pytest.raises(CheckpointError, match=r"built for other-bf16 \(hidden size 960\); x-eagle4 serves .* \(hidden size 576\)"):
        plan.check_head(v)
    (head / "config.json").write_text(json.dumps({"transformer_layer_config": {"hidden_size": 576, "vocab_size": 49152}}))
    plan.check_head(v)
    # a variant that pins its prompt set refuses a head trained on another one
    pinned = variants.Variant("x-eagle4", tmp_path, {}, {**v.resolved, "REDISTILL_PROMPT_SHA256": "a" * 64})
    (head / "PROVENANCE.json").write_text(json.dumps({"target": "x", "prompts": {"prompt_set_sha256": "b" * 64}}))
    with pytest.raises(CheckpointError, match="trained on prompt set bbbbbbbbbbbbbbbb; x-eagle4's REDISTILL_PROMPT_SHA256 says aaaa"):
        plan.check_head(pinned)
    (head / "PROVENANCE.json").write_text(json.dumps({"target": "x", "prompts": {"prompt_set_sha256": "a" * 64}}))
    plan.check_head(pinned)


def test_redistill_pure_parts():
    from collections import Counter

    assert redistill_mtp.aux_layer_ids(30) == [2, 15, 27]  # vLLM's default for SmolLM2's 30 layers
    freq = Counter({1: 50, 2: 30, 3: 20})
    assert redistill_mtp.coverage(freq, (1, 2, 3)) == {"1": 0.5, "2": 0.8, "3": 1.0}
    assert redistill_mtp.pack([300, 300, 100, 600, 50], [0, 1, 2, 3, 4], 512) == [[0], [1, 2], [3], [4]]


def test_sub_batches_keep_each_padded_batch_within_the_budget():
    import random

    lengths = [random.Random(i).choice([20, 30] * 9 + [2000, 3000]) for i in range(300)]
    groups = redistill_mtp.sub_batches(lengths, 8192)
    assert sorted(i for g in groups for i in g) == list(range(300))  # every sequence once
    assert all(len(g) * max(lengths[i] for i in g) <= 8192 for g in groups)
    assert sum(len(g) * max(lengths[i] for i in g) for g in groups) < 2 * sum(lengths)  # little padding
    assert redistill_mtp.sub_batches([9000, 10], 8192) == [[1], [0]]  # a sequence longer than the budget alone


def test_answers_round_trip_through_the_compact_file(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(redistill_mtp.paths, "CACHE", tmp_path / "cache")
    seqs = [{"id": f"p{i}", "sample": j, "split": "train" if i else "val", "group": "g", "prompt_ids": [1, 2, i],
             "ids": [70000 + i, j] if i == 2 else [i, j, 3]} for i in range(3) for j in range(2)]
    src = tmp_path / "src" / "k1"
    src.mkdir(parents=True)
    (src / "responses.json").write_text(json.dumps({"target": "t", "freq": {"3": 4}, "seqs": seqs}))
    redistill_mtp.export_answers(src, tmp_path / "a.npz")
    back = redistill_mtp.import_answers(tmp_path / "a.npz")
    assert back == tmp_path / "cache" / "redistill" / "k1"
    got = json.loads((back / "responses.json").read_text())
    assert got["seqs"] == seqs and got["target"] == "t" and got["freq"] == {"3": 4}  # ids past 65,535 kept (uint32)
    (tmp_path / "bad.npz").write_text("x")
    with pytest.raises(redistill_mtp.RedistillError, match="not an answers file"):
        redistill_mtp.import_answers(tmp_path / "bad.npz")


def test_warm_start_loads_an_earlier_head_and_refuses_another_vocabulary(tmp_path):
    import torch
    from safetensors.torch import save_file

    class Head(torch.nn.Module):  # the parts of a draft head warm_start reads: mapping buffers, layers, embedding
        def __init__(self, d2t, width=4):
            super().__init__()
            self.register_buffer("d2t", torch.tensor(d2t))
            self.register_buffer("t2d", torch.zeros(8, dtype=torch.bool))
            self.fc, self.embed_tokens = torch.nn.Linear(width, width, bias=False), torch.nn.Embedding(8, width)

    def written(head, name):  # as redistill writes a head: no input embedding, a PROVENANCE
        d = tmp_path / name
        d.mkdir()
        save_file({k: t.contiguous() for k, t in head.state_dict().items() if k != "embed_tokens.weight"},
                  str(d / "model.safetensors"))
        (d / "PROVENANCE.json").write_text(json.dumps({"steps": 7, "total_steps": 12, "val_cond_acc": [0.5]}))
        return d

    earlier, fresh = Head([0, 1]), Head([0, 1])
    info = redistill_mtp.warm_start(fresh, written(earlier, "a"))
    assert torch.equal(fresh.fc.weight, earlier.fc.weight) and info["steps"] == 7 and info["total_steps"] == 12
    redistill_mtp.shard_weights(sharded := written(earlier := Head([0, 1]), "s"), 64)  # a head in shards loads too
    assert len(list(sharded.glob("*.safetensors"))) > 1
    redistill_mtp.warm_start(fresh := Head([0, 1]), sharded)
    assert torch.equal(fresh.fc.weight, earlier.fc.weight)
    with pytest.raises(redistill_mtp.RedistillError, match="draft vocabulary \\(d2t\\) differs"):
        redistill_mtp.warm_start(Head([0, 2]), written(Head([0, 1]), "b"))
    with pytest.raises(redistill_mtp.RedistillError, match="tensors that do not fit this head: \\['fc.weight'\\]"):
        redistill_mtp.warm_start(Head([0, 1], width=3), written(Head([0, 1]), "c"))
    with pytest.raises(redistill_mtp.RedistillError, match="not a head written by redistill"):
        redistill_mtp.warm_start(Head([0, 1]), tmp_path)
    d2t, t2d = redistill_mtp.init_vocab(sharded, 8)  # REDISTILL_DRAFT_VOCAB=init: the earlier head's mapping
    assert d2t.tolist() == [0, 1] and t2d.shape == (8,)
    with pytest.raises(redistill_mtp.RedistillError, match="maps 8 target tokens, this target has 9"):
        redistill_mtp.init_vocab(sharded, 9)
    with pytest.raises(redistill_mtp.RedistillError, match="no draft vocabulary"):
        redistill_mtp.init_vocab(tmp_path, 8)


def test_a_large_head_is_written_in_shards_that_load_back(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {f"layers.{i}.w": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    redistill_mtp.shard_weights(tmp_path, 1000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert not (tmp_path / "model.safetensors").exists() and len(shards) == 3
    assert all(f.stat().st_size <= 1000 for f in shards) and index["metadata"]["total_size"] == 2000
    back = {k: t for f in shards for k, t in load_file(f).items()}
    assert sorted(back) == sorted(index["weight_map"]) == sorted(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    small = tmp_path / "small"
    small.mkdir()
    save_file({"w": torch.zeros(4)}, str(small / "model.safetensors"))
    redistill_mtp.shard_weights(small, 1000)  # under the limit: one file, as before
    assert sorted(f.name for f in small.iterdir()) == ["model.safetensors"]


def test_redistill_splits_and_nested_subsets():
    rows = [{"id": f"t{i}", "group": "g", "split": "train"} for i in range(5)] + [{"id": "v0", "group": "h", "split": "val"}]
    assert redistill_mtp.splits_of(rows)["v0"] == ("val", "h")  # the set's own split column, when it names val
    no_val = [{"id": f"p{i}", "split": "train"} for i in range(400)]
    assert 20 < sum(s == "val" for s, _ in redistill_mtp.splits_of(no_val).values()) < 60  # else one in ten, by id
    seqs = [{"id": f"t{i}", "sample": j, "split": "train", "ids": [1] * 10} for i in range(20) for j in range(2)]
    seqs += [{"id": "v0", "sample": 0, "split": "val", "ids": [1] * 10}, {"id": "e", "sample": 0, "split": "train", "ids": []}]
    small, big, every = (redistill_mtp.select(seqs, "train", n) for n in (35, 100, None))
    assert (len(small), len(big), len(every)) == (4, 10, 40)  # stops once the token budget is reached; empty answers skipped
    assert big[:4] == small and every[:10] == big  # nested: a larger budget keeps the smaller one's answers
    assert [s["id"] for s in redistill_mtp.select(seqs, "val", None)] == ["v0"]


def test_redistill_refusals(tmp_path):
    v = variants.Variant("x", tmp_path, {}, {"REDISTILL_PROMPT_SHA256": "a" * 64, "REDISTILL_LAYERS": "0"})
    with pytest.raises(redistill_mtp.RedistillError, match="has sha256 bbbbbbbbbbbbbbbb, x's REDISTILL_PROMPT_SHA256 is aaaa"):
        redistill_mtp.check_prompt_hash(v, {"prompt_set": "p.jsonl", "prompt_set_sha256": "b" * 64})
    with pytest.raises(redistill_mtp.RedistillError, match="REDISTILL_LAYERS must be >= 1"):
        redistill_mtp.settings_of(v)
    v = variants.Variant("x", tmp_path, {}, {"REDISTILL_DRAFT_VOCAB": "init"})
    with pytest.raises(redistill_mtp.RedistillError, match="REDISTILL_DRAFT_VOCAB=init needs REDISTILL_INIT"):
        redistill_mtp.settings_of(v)


def test_distillation_prompts_refuse_evaluation_items():
    from scripts.levers.speculate import prompts

    rows = [{"id": "bb/1", "group": "some_task", "messages": [{"role": "user", "content": "What is  2+2?"}]}]
    with pytest.raises(prompts.PromptLeak, match=r"bb/1 \(some_task\) is an evaluation prompt of spec-v1-eval \(x\)"):
        prompts.refuse_evaluation_rows(rows, {"What is 2+2?": "spec-v1-eval (x)"})
    prompts.refuse_evaluation_rows(rows, {"What is 3+3?": "BIG-bench Lite"})


def test_chat_prompts_use_new_families_and_refuse_spec_v1_ones(monkeypatch):
    p = make_spec_prompts
    chat, info = p.chat_rows()
    assert info["prompts"] == len(chat) > 1000 and {r["samples"] for r in chat} == {p.CHAT_SAMPLES}
    evaluation = {" ".join(r["messages"][-1]["content"].split()) for r in rows("eval")}
    assert not evaluation & {" ".join(r["messages"][-1]["content"].split()) for r in chat}
    quoted = "\n".join(r["messages"][-1]["content"] for r in rows("eval") + rows("train"))
    for r in chat:  # no passage of a spec-v1 prompt comes back in a chat prompt
        if r["group"] in ("chat-rewrite", "chat-passage-qa"):
            passage = r["messages"][-1]["content"].split("\n\n", 1)[1].rsplit("\n\nQuestion: ", 1)[0]
            assert passage not in quoted
    for kind in ("explain", "list", "code", "writing", "rewrite", "passage-qa"):  # both splits in every kind
        assert {r["split"] for r in chat if r["group"] == f"chat-{kind}"} == {"train", "val"}
    monkeypatch.setattr(p, "CHAT_CODE", [*p.CHAT_CODE, p.CODE[3]])
    with pytest.raises(p.PromptLeak, match=f"chat families that are spec-v1 families: \\['{p.CODE[3]}'\\]"):
        p.chat_rows()


def test_identity_compare_by_hand():
    ref = {"id": "a", "ids": [1, 2, 3, 4]}
    assert eval_identity.compare(ref, {"id": "a", "ids": [1, 2, 3, 4]}, None)["identical"]
    tie = eval_identity.compare(ref, {"id": "a", "ids": [1, 2, 9, 9]}, [0.0, 0.0, 0.125, 0.0])
    far = eval_identity.compare(ref, {"id": "a", "ids": [1, 2, 9, 9]}, [0.0, 0.0, 2.5, 0.0])
    assert tie["first_divergence"] == 2 and tie["near_tie"] and not far["near_tie"]
    short = eval_identity.compare(ref, {"id": "a", "ids": [1, 2]}, [0.0, 0.0])
    assert short["first_divergence"] == 2
    s = eval_identity.summarize_identity([eval_identity.compare(ref, {"id": "a", "ids": [1, 2, 3, 4]}, None), tie, far])
    assert (s["identical"], s["near_tie_divergences"], s["divergences_beyond_tie"]) == (1, 1, 1)
    with pytest.raises(eval_identity.IdentityError, match="not teacher-forced"):
        eval_identity.compare(ref, {"id": "a", "ids": [5]}, None)


@pytest.mark.slow
def test_tiny_eagle_head_serves_and_is_lossless(embedded_server, tmp_path):
    """`make redistill BUDGET=tiny` end to end (responses from the real server, hidden states, speculators training),
    then vLLM serves the head (EAGLE-3, K=4) and its greedy token ids equal the reference server's at batch 1 and 4,
    up to teacher-forced near-ties. A tiny head accepts little: this checks the format and losslessness, not speed."""
    from tests.conftest import serve

    head = tmp_path / "head"
    assert redistill_mtp.main(["smollm2-bf16-eagle4", "--budget", "tiny", "--base-url", embedded_server.base_url,
                               "--out", str(head)]) == 0
    prov = json.loads((head / "PROVENANCE.json").read_text())
    assert prov["target"] == "smollm2-bf16" and prov["steps"] == redistill_mtp.BUDGETS["tiny"][2] and prov["curve"]
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 4})
    with serve("smollm2-bf16-eagle4", tmp_path, [f"SERVE_SPECULATIVE_CONFIG={spec}", "SERVE_ENFORCE_EAGER=1"]) as s:
        code = eval_identity.main(["smollm2-bf16-eagle4", "--limit", "4", "--max-tokens", "32", "--concurrency", "1,4",
                                   "--var-url", s.base_url, "--ref-url", embedded_server.base_url,
                                   "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("quality_*.json")
    rec = json.loads(path.read_text())
    assert code == 0 and rec["summary"]["identity"]["divergences_beyond_tie"] == 0
    assert rec["summary"]["identity"]["sequences"] == 8


@pytest.mark.slow
def test_a_failed_training_keeps_its_last_snapshot_and_goes_on_from_it(embedded_server, tmp_path, monkeypatch, capsys):
    """REDISTILL_SNAPSHOT_EVERY: a training that fails at its third step keeps the snapshot of its second, says so,
    and REDISTILL_INIT goes on from it; a finished head removes its snapshot."""
    import torch

    head, calls, real = tmp_path / "head", [], torch.nn.utils.clip_grad_norm_

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*a, **k)

    args = ["smollm2-bf16-eagle4", "--budget", "tiny", "--base-url", embedded_server.base_url, "--out", str(head)]
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        redistill_mtp.main([*args, "--steps", "5", "--set", "REDISTILL_SNAPSHOT_EVERY=0.001"])
    snap = tmp_path / "head.snapshot"
    prov = json.loads((snap / "PROVENANCE.json").read_text())
    assert prov["snapshot"] and prov["steps"] == 2 and not head.exists()
    assert f"its last snapshot is {snap}" in capsys.readouterr().err
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real)
    # REDISTILL_DRAFT_VOCAB=init keeps the snapshot's draft vocabulary (here the same answers': it covers what auto does)
    assert redistill_mtp.main([*args, "--steps", "1", "--set", f"REDISTILL_INIT={snap}",
                               "--set", "REDISTILL_DRAFT_VOCAB=init"]) == 0
    prov = json.loads((head / "PROVENANCE.json").read_text())
    assert prov["settings"]["warm_start"]["steps"] == 2 and prov["total_steps"] == 3 and not snap.exists()
    cov = prov["draft_vocab_coverage"]
    assert prov["settings"]["draft_vocab"] in (1024, 2048) and cov["init"] == round(cov[str(prov["settings"]["draft_vocab"])], 4)


GEMMA_ANSWERS = Path(__file__).with_name("gemma3-270m-tiny-answers.npz")


@pytest.mark.slow
def test_tiny_gemma_eagle_head_serves_and_is_lossless(tmp_path):
    """The second model: a tiny EAGLE-3 head for Gemma 3 270M trained from the committed tiny answers (gemma3-270m-bf16's
    greedy answers to 24 spec-v1-train prompts, `redistill --export-answers`), served through the project's
    Gemma3Eagle3ForCausalLM (vLLM's Gemma 3 has no EAGLE-3 interface); the server drafts and some drafts are accepted,
    and its greedy tokens are the parent's (transformers in the server's dtype, tests/conftest.py TEST_DTYPE, teacher-forced)
    up to near-ties, alone and four at a time."""
    import concurrent.futures as cf
    import urllib.request

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.common.loadgen import openai_client
    from scripts.weights.download import materialize
    from tests.conftest import assert_parents_greedy, reference_dtype, serve

    parent = materialize("embedded:gemma3-270m", "gemma-3-270m")
    head = tmp_path / "head"
    assert redistill_mtp.main(["gemma3-270m-eagle4", "--budget", "tiny", "--answers", str(GEMMA_ANSWERS),
                               "--out", str(head)]) == 0
    assert json.loads((head / "config.json").read_text())["transformer_layer_config"]["hidden_act"] == "silu"
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 4})
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, there was"]
    with serve("gemma3-270m-eagle4", tmp_path, [f"SERVE_SPECULATIVE_CONFIG={spec}", "SERVE_ENFORCE_EAGER=1"]) as s:
        client = openai_client(s.base_url)

        def complete(text: str) -> tuple[list[int], list[int]]:
            r = client.completions.create(model="gemma3-270m-eagle4", prompt=text, max_tokens=32, temperature=0,
                                          extra_body={"return_token_ids": True}).model_dump()
            return r["choices"][0]["prompt_token_ids"], r["choices"][0]["token_ids"]

        cases = [complete(t) for t in texts]
        with cf.ThreadPoolExecutor(4) as ex:
            cases += list(ex.map(complete, texts))
        with urllib.request.urlopen(s.base_url.removesuffix("/v1") + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    def counter(name: str) -> float:
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))

    # acceptance needs the head to read the target's auxiliary states as it was trained on them: lossless verification
    # alone would pass with any states
    drafted, accepted = (counter(f"vllm:spec_decode_num_{k}_tokens_total") for k in ("draft", "accepted"))
    assert drafted > 0 and accepted > 0, f"{accepted:.0f} of {drafted:.0f} draft tokens accepted"
    assert_parents_greedy(AutoModelForCausalLM.from_pretrained(parent, dtype=reference_dtype()).eval(),
                          AutoTokenizer.from_pretrained(parent), cases)


def _average_on_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    seconds = redistill_mtp.average_gradients(params, 10.0 + rank, 2)
    torch.save({"grads": [p.grad for p in params], "seconds": seconds}, f"{out}/{rank}.pt")
    redistill_mtp.same_weights(params)
    if rank == 1:
        params[0].data += 1
    try:
        redistill_mtp.same_weights(params)
    except redistill_mtp.RedistillError as e:
        torch.save(str(e), f"{out}/{rank}.err")
    dist.destroy_process_group()


def test_data_parallel_ranks_average_gradients_and_agree_on_time(tmp_path):
    """average_gradients over two real gloo ranks: every rank gets the mean gradient and rank 0's clock; same_weights
    passes on equal weights and refuses on both ranks once one rank's weights differ."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_average_on_rank, args=(port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["seconds"] == 10.0 and all(bool((g == 1.5).all()) for g in got["grads"])
        assert "ranks ended with different weights" in torch.load(tmp_path / f"{rank}.err")


@pytest.mark.slow
def test_two_data_parallel_ranks_train_one_head(embedded_server, tmp_path):
    """`python -m torch.distributed.run --nproc-per-node 2 -m scripts.levers.speculate.redistill …`: the answers are
    cached first in one process; the two ranks train one head (rank 0 writes it) and PROVENANCE says so."""
    import subprocess
    import sys

    args = ["smollm2-bf16-eagle4", "--budget", "tiny", "--base-url", embedded_server.base_url]
    assert redistill_mtp.main([*args, "--generate-only"]) == 0
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                          "scripts.levers.speculate.redistill", *args, "--steps", "3", "--out", str(tmp_path / "head")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    prov = json.loads((tmp_path / "head" / "PROVENANCE.json").read_text())
    assert prov["settings"]["ranks"] == 2 and prov["steps"] == 3 and prov["val_cond_acc"]


def test_truncated_draft_keeps_the_first_layers_and_refuses_bad_counts(tmp_path):
    """make_draft_model.truncate: layers < N, embedding, norm and tokenizer files kept; config says N; N outside
    1..layers-1 refused naming the limit."""
    import torch
    from safetensors.torch import load_file, save_file

    from scripts.levers.speculate import draft as make_draft_model

    parent, out = tmp_path / "p", tmp_path / "d"
    parent.mkdir()
    out.mkdir()
    (parent / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "hidden_size": 4}))
    (parent / "tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4),
               **{f"model.layers.{i}.mlp.up_proj.weight": torch.full((4, 4), float(i)) for i in range(3)}},
              str(parent / "model.safetensors"))
    info = make_draft_model.truncate(parent, out, 2)
    kept = load_file(out / "model.safetensors")
    assert sorted(kept) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                            "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2 == info["layers"]
    assert (out / "tokenizer.json").exists()
    for bad in (0, 3):
        with pytest.raises(make_draft_model.DraftError, match=r"must lie in 1\.\.2"):
            make_draft_model.truncate(parent, tmp_path, bad)


def test_feature_cache_runs_the_target_once_per_answer_within_its_budget():
    """FeatureCache: an answer drawn again is not recomputed while the byte budget holds it; past the budget the
    target runs again, and samples come back in the group's order either way."""
    import torch

    calls = []

    class Fake:
        def samples(self, seqs, max_len):
            calls.extend(s["id"] for s in seqs)
            return [{"hidden_states": torch.full((4,), float(s["id"]))} for s in seqs]  # 16 bytes each

    sets = {"train": [{"id": i} for i in range(3)]}
    cache = redistill_mtp.FeatureCache(Fake(), sets, 512, budget_bytes=32)
    assert [float(s["hidden_states"][0]) for s in cache.samples("train", [2, 0])] == [2.0, 0.0]
    assert [float(s["hidden_states"][0]) for s in cache.samples("train", [0, 1, 2])] == [0.0, 1.0, 2.0]
    assert calls == [2, 0, 1]  # 1 did not fit the 32 bytes
    cache.samples("train", [1])
    assert calls == [2, 0, 1, 1]
