"""config.env parsing and validation (no vLLM)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts.common import paths
from scripts.common.variants import PLATFORM_DEFAULTS, VariantError, list_variants, load_variant, parse_config_env


def write_variant(root, name, text):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.env").write_text(text)
    return d / "config.env"


def test_every_committed_variant_loads_on_both_targets():
    names = list_variants()
    assert paths.DEFAULT_VARIANT in names
    for name in names:
        for target in PLATFORM_DEFAULTS:
            v = load_variant(name, target=target)
            assert v.settings["BASE"] == name.split("-")[0] or name.startswith(v.settings["BASE"])
            assert (paths.EXPERIMENTS / name / "README.md").exists(), f"{name} has no README.md"


def test_layering_platform_then_file_then_override(tmp_path):
    write_variant(tmp_path, "x-bf16", "MODEL=weights/x\nBASE=x\nSERVE_DTYPE=float16\n")
    v = load_variant("x-bf16", root=tmp_path, target="cpu", overrides={"SERVE_MAX_NUM_SEQS": "4"})
    assert v.resolved["SERVE_DTYPE"] == "float16" != PLATFORM_DEFAULTS["cpu"]["SERVE_DTYPE"]  # file beats platform
    assert v.resolved["ENV_VLLM_CPU_KVCACHE_SPACE"] == PLATFORM_DEFAULTS["cpu"]["ENV_VLLM_CPU_KVCACHE_SPACE"]
    assert v.serve_settings()["max-num-seqs"] == "4"
    assert v.env()["VLLM_CPU_KVCACHE_SPACE"] == PLATFORM_DEFAULTS["cpu"]["ENV_VLLM_CPU_KVCACHE_SPACE"]
    assert "ENV_VLLM_CPU_KVCACHE_SPACE" not in load_variant("x-bf16", root=tmp_path, target="cuda").resolved


def test_shared_gpu_settings_reach_vllm_variants_only(tmp_path, monkeypatch):
    write_variant(tmp_path, "x-bf16", "MODEL=weights/x\nBASE=x\nSERVE_GPU_MEMORY_UTILIZATION=0.9\n")
    write_variant(tmp_path, "x-gguf", "MODEL=weights/x.gguf\nBASE=x\nENGINE=llamaserver\n")
    monkeypatch.setenv("LAB_SERVE_SET", "SERVE_GPU_MEMORY_UTILIZATION=0.05 SERVE_KV_CACHE_MEMORY_BYTES=2147483648")
    v = load_variant("x-bf16", root=tmp_path, target="cuda", overrides={"SERVE_GPU_MEMORY_UTILIZATION": "0.8"})
    assert v.resolved["SERVE_GPU_MEMORY_UTILIZATION"] == "0.05"  # beats the file and the command line
    assert v.serve_settings()["kv-cache-memory-bytes"] == "2147483648"
    assert "SERVE_KV_CACHE_MEMORY_BYTES" not in load_variant("x-gguf", root=tmp_path, target="cuda").resolved
    monkeypatch.setenv("LAB_SERVE_SET", "ENV_X=1")
    with pytest.raises(VariantError, match="LAB_SERVE_SET: ENV_X is not a SERVE_ or SGLANG_ key"):
        load_variant("x-bf16", root=tmp_path, target="cuda")


def test_shared_gpu_settings_reach_each_engine_by_its_own_keys(tmp_path, monkeypatch):
    write_variant(tmp_path, "x-bf16", "MODEL=weights/x\nBASE=x\n")
    write_variant(tmp_path, "x-sglang", "MODEL=weights/x\nBASE=x\nENGINE=sglang\nSGLANG_MEM_FRACTION_STATIC=0.8\n")
    monkeypatch.setenv("LAB_SERVE_SET", "SERVE_KV_CACHE_MEMORY_BYTES=2147483648 SGLANG_MEM_FRACTION_STATIC=0.15")
    sgl, vllm = (load_variant(n, root=tmp_path, target="cuda").resolved for n in ("x-sglang", "x-bf16"))
    assert sgl["SGLANG_MEM_FRACTION_STATIC"] == "0.15" and "SERVE_KV_CACHE_MEMORY_BYTES" not in sgl
    assert vllm["SERVE_KV_CACHE_MEMORY_BYTES"] == "2147483648" and "SGLANG_MEM_FRACTION_STATIC" not in vllm


def test_comments_blank_lines_and_json_values(tmp_path):
    p = write_variant(tmp_path, "x", '# c\n\nMODEL=weights/x\nBASE=x\nSERVE_SPECULATIVE_CONFIG={"method": "ngram", "num_speculative_tokens": 2, "x": "#"}\n')
    assert parse_config_env(p)["SERVE_SPECULATIVE_CONFIG"] == '{"method": "ngram", "num_speculative_tokens": 2, "x": "#"}'


@pytest.mark.parametrize(
    "text, message",
    [
        ("MODEL=weights/x\nBASE=x\nFOO=1\n", "config.env:3: unknown key 'FOO'; valid keys: MODEL"),
        ("MODEL=weights/x\nBASE x\n", "config.env:2: malformed line"),
        ("MODEL=weights/x\nbase=x\n", "config.env:2: malformed key"),
        ("MODEL=weights/x\nBASE=x\nBASE=y\n", "config.env:3: BASE is set twice"),
        ("MODEL=weights/x\nBASE=\n", "config.env:2: BASE has an empty value"),
        ("MODEL=weights/x\nBASE=x\nSERVE_COMPILATION_CONFIG={bad\n", "config.env:3: SERVE_COMPILATION_CONFIG is not valid JSON"),
        ("MODEL=weights/x\nBASE=x\nSHAPE_PROXY=yes\n", "SHAPE_PROXY must be 0 or 1"),
        ("MODEL=weights/x\n", "missing required key(s) BASE"),
        ("MODEL=weights/x\nBASE=x\nPARENT=nope\n", "PARENT='nope' is not a variant; closest: x (make list shows all 1)"),
        ("MODEL=weights/x\nBASE=x\n# why\nSUPERSEDED_BY=nope\n",
         "config.env:4: SUPERSEDED_BY='nope' is not a variant; closest: x (make list shows all 1)"),
        ("MODEL=weights/x\nBASE=x\nSUPERSEDED_BY=x\n", "config.env:3: SUPERSEDED_BY='x' names the variant itself"),
    ],
)
def test_bad_config_fails_with_file_and_line(tmp_path, text, message):
    write_variant(tmp_path, "x", text)
    with pytest.raises(VariantError) as e:
        load_variant("x", root=tmp_path, target="cpu")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["nope", "../smollm2-bf16", "", "Smollm2-BF16", "smollm2-bf16-eagle"])
def test_bad_variant_name_names_the_three_closest_and_make_list(name):
    with pytest.raises(VariantError) as e:
        load_variant(name)
    closest = re.fullmatch(r"unknown variant '.*'; closest: (\S+), (\S+), (\S+) \(make list shows all (\d+)\)", str(e.value))
    assert closest, str(e.value)
    assert set(closest.groups()[:3]) <= set(list_variants()) and int(closest.group(4)) == len(list_variants())
    if name in ("../smollm2-bf16", "Smollm2-BF16"):
        assert closest.group(1) == "smollm2-bf16"


def test_unknown_variant_closest_names_by_similarity(tmp_path):
    for name in ("smollm2-bf16", "smollm2-int8", "gemma3-270m-bf16", "qwen35-4b-bf16"):
        write_variant(tmp_path, name, "MODEL=weights/x\nBASE=x\n")
    with pytest.raises(VariantError, match=r"^unknown variant 'smollm2-int9'; closest: smollm2-int8, smollm2-bf16, "
                                           r"\S+ \(make list shows all 4\)$"):
        load_variant("smollm2-int9", root=tmp_path, target="cpu")


def test_bad_override_key(tmp_path):
    write_variant(tmp_path, "x", "MODEL=weights/x\nBASE=x\n")
    with pytest.raises(VariantError, match="override NOPE: unknown key"):
        load_variant("x", root=tmp_path, target="cpu", overrides={"NOPE": "1"})


def test_serving_target(monkeypatch):
    from scripts.common import variants

    monkeypatch.setenv("VLLM_TARGET", "cuda")
    assert variants.serving_target() == "cuda"
    monkeypatch.setenv("VLLM_TARGET", "tpu")
    with pytest.raises(VariantError, match="VLLM_TARGET='tpu'"):
        variants.serving_target()
    monkeypatch.delenv("VLLM_TARGET")
    monkeypatch.setattr(variants.shutil, "which", lambda _: None)
    assert variants.serving_target() == "cpu"


def test_cpu_preload_auto_resolves_to_the_libraries_found(tmp_path, monkeypatch):
    """ENV_LD_PRELOAD=auto (the CPU default) becomes the paths of the libraries present; a missing one is named with
    where it comes from, and an explicit value (empty: preload nothing) is kept as written."""
    from scripts.common import variants

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libfound.so").write_text("")
    monkeypatch.setattr(variants.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(variants, "CPU_PRELOAD", (("libfound.so", "here"), ("libnowhere-xyz.so.9", "apt-get install it")))
    assert variants.cpu_preload() == ([str(tmp_path / "lib" / "libfound.so")], ["libnowhere-xyz.so.9 (apt-get install it)"])
    write_variant(tmp_path / "exp", "x-bf16", "MODEL=weights/x\nBASE=x\n")
    assert load_variant("x-bf16", root=tmp_path / "exp", target="cpu").env()["LD_PRELOAD"] == str(tmp_path / "lib" / "libfound.so")
    v = load_variant("x-bf16", root=tmp_path / "exp", target="cpu", overrides={"ENV_LD_PRELOAD": ""})
    assert v.env()["LD_PRELOAD"] == ""
    assert "ENV_LD_PRELOAD" not in load_variant("x-bf16", root=tmp_path / "exp", target="cuda").resolved


def test_cpu_dtype_note_only_where_bf16_has_no_native_kernels():
    from scripts.common.hardware import cpu_dtype_note

    assert "FP32" in cpu_dtype_note("bfloat16", ["avx2", "avx512f", "avx512_vnni"])
    assert cpu_dtype_note("bfloat16", ["avx2", "avx512f", "avx512_bf16"]) is None
    assert cpu_dtype_note("bfloat16", ["amx_bf16", "amx_tile"]) is None
    assert cpu_dtype_note("float32", ["avx2"]) is None


# Fuzzing the parser (hypothesis): any bytes, keys and values give a valid variant or a one-line VariantError that
# names the file (and the line, where one line is at fault); never another exception.
_KEYS = st.sampled_from(["MODEL", "BASE", "PARENT", "SUPERSEDED_BY", "SHAPE_PROXY", "SERVE_MAX_NUM_SEQS",
                         "SERVE_SPECULATIVE_CONFIG", "ENV_X", "GATE_Y", "ENGINE", "SERVE_", "model", "1X", "X-Y",
                         "UNKNOWN_KEY", ""])
_VALUES = st.one_of(st.text(max_size=60), st.sampled_from(["weights/x", "x", "{", "[1, 2", '{"method": "ngram"}',
                                                            '{"method": "ngram", "num_speculative_tokens": true}',
                                                            "[" * 5000 + "]" * 5000, "2", "\x00", "a\rb"]),
                    st.integers(0, 300_000).map(lambda n: "v" * n))
_LINES = st.one_of(st.text(max_size=80), st.builds("{}={}".format, _KEYS, _VALUES),
                   st.builds("{}={}".format, st.text(max_size=20), st.text(max_size=20)), st.just("# comment"))


def _check_parse(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = write_variant(Path(d), "fz", "")
        path.write_bytes(data)
        try:
            v = load_variant("fz", root=Path(d), target="cpu")
        except VariantError as e:
            msg = str(e)
            assert "\n" not in msg and "\r" not in msg and len(msg) < 2000, msg[:300]
            assert msg.startswith(str(path)), msg[:300]
            return
        assert v.settings["MODEL"] and v.settings["BASE"]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(lines=st.lists(_LINES, max_size=12), encoding=st.sampled_from(["utf-8", "utf-16", "latin-1", "cp1252"]),
       required=st.booleans())
def test_fuzzed_config_env_is_a_variant_or_one_line_error(lines, encoding, required):
    text = "\n".join((["MODEL=weights/x", "BASE=x"] if required else []) + lines)
    _check_parse(text.encode(encoding, errors="replace"))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.binary(max_size=400))
def test_fuzzed_config_env_bytes_are_a_variant_or_one_line_error(data):
    _check_parse(b"MODEL=weights/x\nBASE=x\n" + data)


@pytest.mark.parametrize(("data", "message"), [
    (b"MODEL=weights/x\nBASE=x\nENV_A=\xff\xfe\n", r"config.env:3: not UTF-8 text \(byte 0xff"),
    (b"MODEL=weights/x\nBASE=x\nENV_A=a\x00b\n", r"config.env:3: ENV_A holds the control character '\\x00' at column 8"),
    (b"MODEL=weights/x\nBASE=x\nSERVE_X=" + b"[" * 100_000 + b"\n", r"config.env:3: SERVE_X is JSON nested too deeply"),
    (b"MODEL=weights/x\nBASE=x\n" + b"y" * 100_000 + b"\n", r"config.env:3: malformed line 'yyy.*\(100000 characters\)"),
])
def test_fuzz_findings_are_one_line_errors(tmp_path, data, message):
    path = write_variant(tmp_path, "fz", "")
    path.write_bytes(data)
    with pytest.raises(VariantError, match=message):
        load_variant("fz", root=tmp_path, target="cpu")


def test_training_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    from scripts.common import hardware
    from scripts.common.hardware import training_dtype

    monkeypatch.setattr(hardware, "cpu_model_and_flags", lambda: ("x", ["avx2"]))
    assert training_dtype() == "float32" and training_dtype("cuda") == "bfloat16"
    monkeypatch.setattr(hardware, "cpu_model_and_flags", lambda: ("x", ["avx2", "avx512f", "avx512_bf16"]))
    assert training_dtype() == "bfloat16"


REASONING = 'SERVE_REASONING_PARSER=qwen3\n'


@pytest.mark.parametrize(("value", "line"), [("-1", 3), ("2.5", 3), ("256 tokens", 3), ("0x10", 3)])
def test_think_budget_must_be_a_non_negative_integer_named_by_file_and_line(tmp_path, value, line):
    write_variant(tmp_path, "x", f"MODEL=weights/x\nBASE=x\nTHINK_BUDGET={value}\n{REASONING}")
    with pytest.raises(VariantError, match=rf"config.env:{line}: THINK_BUDGET must be a non-negative integer"):
        load_variant("x", root=tmp_path, target="cpu")


def test_think_budget_needs_a_reasoning_configuration(tmp_path):
    write_variant(tmp_path, "x", "MODEL=weights/x\nBASE=x\n# budget\nTHINK_BUDGET=256\n")
    with pytest.raises(VariantError, match=r"x/config.env:4: THINK_BUDGET needs a reasoning configuration: set "
                                           r"SERVE_REASONING_PARSER or SERVE_REASONING_CONFIG"):
        load_variant("x", root=tmp_path, target="cpu")
    for reasoning in (REASONING, 'SERVE_REASONING_CONFIG={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}\n'):
        (tmp_path / "x" / "config.env").write_text(f"MODEL=weights/x\nBASE=x\nTHINK_BUDGET=0\n{reasoning}")
        assert load_variant("x", root=tmp_path, target="cpu").resolved["THINK_BUDGET"] == "0"
    with pytest.raises(VariantError, match="override THINK_BUDGET: THINK_BUDGET must be a non-negative integer"):
        load_variant("x", root=tmp_path, target="cpu", overrides={"THINK_BUDGET": "-5"})


def test_think_budget_under_speculation_refused_on_a_vllm_listed_as_not_holding_it(tmp_path, monkeypatch):
    from scripts.common import variants
    from scripts.common.variants import check_think_budget

    spec = 'SERVE_SPECULATIVE_CONFIG={"method": "mtp", "num_speculative_tokens": 2}\n'
    write_variant(tmp_path, "x", f"MODEL=weights/x\nBASE=x\n{REASONING}THINK_BUDGET=64\n{spec}")
    v = load_variant("x", root=tmp_path, target="cuda")
    monkeypatch.setattr(variants, "BUDGET_UNENFORCED_UNDER_SPECULATION", {"9.9.9": "vllm-project/vllm#54906"})
    with pytest.raises(VariantError, match=r"config.env:4: THINK_BUDGET with SERVE_SPECULATIVE_CONFIG: vLLM 9.9.9 "
                                           r"does not hold .*vllm-project/vllm#54906"):
        check_think_budget(v.resolved, v.path / "config.env", "9.9.9")
    check_think_budget(v.resolved, v.path / "config.env", "9.9.10")  # a release not listed
    del v.resolved["SERVE_SPECULATIVE_CONFIG"]
    check_think_budget(v.resolved, v.path / "config.env", "9.9.9")  # no speculation


def test_a_missing_model_names_the_target_of_the_variant_that_builds_it():
    """A server variant on its parent's weights (llama-server on the Q8_0 GGUF) names the parent's export, not a
    calibration of its own; a lever variant with weights of its own names its own target; a base `make weights`."""
    from scripts.common.variants import how_to_build

    assert how_to_build(load_variant("smollm2-gguf-q8-0-server")) == "make export-gguf VARIANT=smollm2-gguf-q8-0"
    assert how_to_build(load_variant("smollm2-gguf-q8-0")) == "make export-gguf VARIANT=smollm2-gguf-q8-0"
    assert how_to_build(load_variant("smollm2-bf16")) == "make weights VARIANT=smollm2-bf16"
