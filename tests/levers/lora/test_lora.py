"""LoRA: settings and refusals (pure logic and tiny models), and a tiny adapter trained in the test session, merged,
and served by the real vLLM server beside the base (slow)."""

from __future__ import annotations

import json
import shutil

import pytest

from scripts.common import paths
from scripts.common.metrics import near_tie
from scripts.common.variants import load_variant
from scripts.levers.lora import adapters as lora

TINY = "weights/lora/.test-tiny"  # the session's adapter (weights/ is not tracked)
MERGED = "weights/.test-lora-merged"
TRAIN_SETS = {"LORA_ADAPTER": TINY, "LORA_STEPS": "6", "LORA_SEQ_LEN": "64", "LORA_BATCH": "2", "LORA_RANK": "8",
              "LORA_LR": "3e-3", "LORA_EVAL_EVERY": "3", "LORA_HELDOUT_CHUNKS": "2", "LORA_MAX_RISE": "10"}
PROMPTS = ["Explain what a Python list is in one sentence.", "What does the re module do?",
           "Write a haiku about the sea.", "Name three uses of itertools."]


def test_settings_defaults_and_bad_values():
    v = load_variant("smollm2-lora-a")
    s = lora.settings(v)
    assert s.split == (1, 3) and s.rank == 16 and "down_proj" in s.targets
    with pytest.raises(lora.LoraError, match="LORA_SPLIT"):
        lora.settings(load_variant("smollm2-lora-a", overrides={"LORA_SPLIT": "4/3"}))
    with pytest.raises(lora.LoraError, match="under weights/"):
        lora.settings(load_variant("smollm2-lora-a", overrides={"LORA_ADAPTER": "/tmp/x"}))
    with pytest.raises(lora.LoraError, match="not a number"):
        lora.settings(load_variant("smollm2-lora-a", overrides={"LORA_RANK": "big"}))


def test_served_adapters_resolve_and_reject_malformed():
    v = load_variant("smollm2-lora3")
    assert list(lora.served_adapters(v)) == ["docs-a", "docs-b", "docs-c"]
    flags = v.serve_settings()["lora-modules"].split()
    assert all(f.split("=", 1)[1].startswith(str(paths.WEIGHTS)) for f in flags)
    assert v.request_models == ["docs-a", "docs-b", "docs-c"]
    with pytest.raises(lora.LoraError, match="not name=path"):
        lora.served_adapters(load_variant("smollm2-lora3", overrides={"SERVE_LORA_MODULES": "docs-a"}))


def tiny_llama(tmp_path, hidden=64):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "base")
    return model, tmp_path / "base"


def test_targets_and_rank_are_checked_against_the_model(tmp_path):
    model, _ = tiny_llama(tmp_path)
    lora.check_targets(model, ("q_proj", "down_proj"), 8)
    with pytest.raises(lora.LoraError, match="no linear layer named w_pack"):
        lora.check_targets(model, ("q_proj", "w_pack"), 8)
    with pytest.raises(lora.LoraError, match="exceeds the smallest side"):
        lora.check_targets(model, ("k_proj",), 64)  # k_proj: 64 -> 32


def test_adapter_card_names_its_base_and_missing_files(tmp_path):
    _, base = tiny_llama(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(lora.LoraError, match="no adapter_model.safetensors, lora_card.json"):
        lora.read_card(adapter)
    card = {"base_config_sha256": "0" * 64, "base_model": "weights/other"}
    with pytest.raises(lora.LoraError, match="an adapter for another base"):
        lora.check_base(card, adapter, base)
    lora.check_base({"base_config_sha256": lora.config_sha256(base)}, adapter, base)


def test_token_ids_of_another_tokenizer_are_refused(tmp_path, embedded_weights):
    from transformers import AutoTokenizer

    from scripts.common.checkpoint import tokenizer_fingerprint

    tok = AutoTokenizer.from_pretrained(embedded_weights)
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3] * 50, "tokenizer_sha256": "f" * 64}) + "\n")
    with pytest.raises(lora.LoraError, match="made by another tokenizer"):
        lora.training_tokens(str(data), (1, 1), tok)
    data.write_text(json.dumps({"input_ids": [1, 2, 3] * 50, "tokenizer_sha256": tokenizer_fingerprint(tok)}) + "\n")
    assert lora.training_tokens(str(data), (1, 1), tok)[1] == [1, 2, 3] * 50


def test_merge_refuses_a_quantized_parent():
    from scripts.levers.lora.merge import merge

    if not (paths.WEIGHTS / "smollm2-int8sq" / "config.json").exists():
        pytest.skip("weights/smollm2-int8sq not built (make calibrate VARIANT=smollm2-int8sq)")
    with pytest.raises(lora.LoraError, match="is quantized: merge into the BF16 model"):
        merge("smollm2-lora-a", overrides={"PARENT": "smollm2-int8sq", "MODEL": MERGED})


def test_adapter_problems_found_before_vllm_loads(tmp_path):
    from peft import LoraConfig, get_peft_model

    model, base = tiny_llama(tmp_path)
    good = tmp_path / "good"
    get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM")).save_pretrained(good)
    assert lora.adapter_problem(good, base, 8) is None
    assert lora.adapter_problem(good, base, 1)[0] == 400 and "rank 8" in lora.adapter_problem(good, base, 1)[1]
    assert lora.adapter_problem(tmp_path / "none", base, 8)[0] == 404
    other_model, _ = tiny_llama(tmp_path / "wide", hidden=128)
    other = tmp_path / "other"
    get_peft_model(other_model, LoraConfig(r=8, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(other)
    status, message = lora.adapter_problem(other, base, 8)
    assert status == 400 and "another base" in message
    (good / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in lora.adapter_problem(good, base, 8)[1]


def test_admission_plugin_is_an_installed_entry_point():
    import importlib.metadata

    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("lora_admission") == "scripts.levers.lora.admission:register"


# ------------------------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def tiny_adapter(embedded_weights, tmp_path_factory):
    """A rank-8 adapter trained for a few steps at a high learning rate (so its greedy output moves), merged."""
    from scripts.levers.lora.merge import merge
    from scripts.levers.lora.train import train

    records = tmp_path_factory.mktemp("lora-records")
    card = train("smollm2-lora-a", overrides=TRAIN_SETS, record_dir=records)
    merged = merge("smollm2-lora-a", overrides={**TRAIN_SETS, "MODEL": MERGED}, record_dir=records)
    yield paths.ROOT / TINY, merged, card
    shutil.rmtree(paths.ROOT / TINY, ignore_errors=True)
    shutil.rmtree(merged, ignore_errors=True)


@pytest.fixture(scope="module")
def lora_server(tiny_adapter, tmp_path_factory):
    from tests.conftest import serve

    sets = [f"SERVE_LORA_MODULES=tiny={TINY}", "SERVE_MAX_LORAS=2", "SERVE_MAX_LORA_RANK=8",
            "ENV_VLLM_ALLOW_RUNTIME_LORA_UPDATING=1", "BENCH_MODELS=tiny"]
    with serve("smollm2-lora1", tmp_path_factory.mktemp("serve-lora"), sets) as s:
        yield s


def greedy(base_url: str, model: str, prompt: str, n: int = 32) -> tuple[list[int], list[int]]:
    from scripts.common.loadgen import openai_client

    r = openai_client(base_url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0,
        extra_body={"return_token_ids": True}).model_dump()
    return r["prompt_token_ids"], r["choices"][0]["token_ids"]


def worst_gap(model, prompt_ids: list[int], out: list[int]) -> float:
    """Largest log-prob shortfall of the served tokens below the reference model's argmax (teacher-forced)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out])).logits[0, len(prompt_ids) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return max(float(lp[i].max() - lp[i, t]) for i, t in enumerate(out))


@pytest.mark.slow
def test_training_lowered_heldout_perplexity_and_kept_answers(tiny_adapter):
    _, _, card = tiny_adapter
    assert card["heldout_ppl"]["adapted"] < card["heldout_ppl"]["base"]
    assert all(a["problem"] is None for a in card["answers"])
    assert card["base_config_sha256"] == lora.config_sha256(paths.ROOT / "weights" / paths.EMBEDDED_NAME)


@pytest.mark.slow
def test_adapter_name_serves_the_merged_model_and_base_name_the_base(lora_server, tiny_adapter, hf_reference):
    from transformers import AutoModelForCausalLM

    from tests.conftest import reference_dtype

    _, merged_dir, _ = tiny_adapter
    base_model, _ = hf_reference
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=reference_dtype()).eval()
    moved = 0
    for p in PROMPTS:
        ids, by_adapter = greedy(lora_server.base_url, "tiny", p)
        _, by_base = greedy(lora_server.base_url, "smollm2-lora1", p)
        moved += by_adapter != by_base
        assert near_tie(worst_gap(merged, ids, by_adapter)), f"{p!r}: adapter output is not the merged model's"
        assert near_tie(worst_gap(base_model, ids, by_base)), f"{p!r}: base name output is not the base's"
    assert moved >= 1, "the adapter changed no greedy output: the comparison above would not see a wrong adapter"


def post(base_url: str, path: str, body: dict) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
def test_runtime_load_use_and_unload(lora_server, tiny_adapter):
    adapter, _, _ = tiny_adapter
    url = lora_server.base_url
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "again", "lora_path": str(adapter)})[0] == 200
    _, out = greedy(url, "again", PROMPTS[0], 8)
    assert out == greedy(url, "tiny", PROMPTS[0], 8)[1]
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "again"})[0] == 200
    status, text = post(url, "/v1/chat/completions", {"model": "again", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and "again" in text


def bad_adapters(tmp_path, tiny: str):
    """(name, path, what the error must say): files missing, rank above the server's 8, another base's shapes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    missing = tmp_path / "missing-files"
    missing.mkdir()
    shutil.copy(paths.ROOT / tiny / "adapter_config.json", missing)
    rank16 = tmp_path / "rank16"
    base = AutoModelForCausalLM.from_pretrained(paths.ROOT / "weights" / paths.EMBEDDED_NAME)
    get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(rank16)
    other = tmp_path / "other-base"
    small, _ = tiny_llama(tmp_path)
    get_peft_model(small, LoraConfig(r=8, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(other)
    return [("missing", missing, "no adapter_model.safetensors"), ("rank16", rank16, "rank 16 is above"),
            ("other", other, "another base"), ("nowhere", tmp_path / "nowhere", "no adapter folder")]


@pytest.mark.slow
def test_bad_adapters_are_refused_and_the_server_keeps_serving(lora_server, tmp_path):
    url = lora_server.base_url
    for name, path, says in bad_adapters(tmp_path, TINY):
        status, text = post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert 400 <= status < 500, f"{name}: {status} {text[:300]}"
        assert says.lower() in text.lower(), f"{name}: {status} {text[:300]}"
        _, out = greedy(url, "smollm2-lora1", "Say hello.", 4)
        assert out, f"no answer after the {name} adapter was refused"
