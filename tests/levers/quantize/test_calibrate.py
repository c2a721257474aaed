"""Recipe handling of the llm-compressor entry point: pure parts, no llm-compressor import (it lives in .venv-quant)."""

from __future__ import annotations

import pytest

from scripts.common import paths
from scripts.levers.quantize import calibrate as cal


def test_group_size_is_the_largest_power_of_two_dividing_the_width():
    assert cal.group_size_for(576, 128, "q_proj") == 64  # SmolLM2's hidden size
    assert cal.group_size_for(1536, 128, "down_proj") == 128
    assert cal.group_size_for(9216, 128, "down_proj") == 128  # Qwen3.5-4B's MLP width
    with pytest.raises(cal.CalibrateError, match="layer odd: input width 100 has no power-of-two group size"):
        cal.group_size_for(100, 128, "odd")


def test_a_recipe_naming_its_kernel_refuses_the_layers_that_kernel_cannot_take():
    w4a8, _ = cal.load_recipe("rtn-w4a8-fp8")
    shapes = {"m.layers.0.mlp.up_proj": (2560, 9216), "m.layers.0.linear_attn.in_proj_b": (2560, 32),
              "m.layers.1.linear_attn.in_proj_b": (2560, 32), "m.layers.1.mlp.down_proj": (576, 128)}
    assert cal.kernel_refusals(w4a8, shapes) == [
        "m.layers.0.linear_attn.in_proj_b: output width 32 does not divide by 128",
        "m.layers.1.linear_attn.in_proj_b: output width 32 does not divide by 128",
        "m.layers.1.mlp.down_proj: input width 576 does not divide by 128; group size 64 is not 128"]
    with pytest.raises(cal.CalibrateError, match=r"rtn-w4a8-fp8: 3 layer\(s\) cannot run on CutlassW4A8LinearKernel, "
                       r"the kernel vLLM serves this scheme with \(families linear_attn.in_proj_b, mlp.down_proj\); "
                       r"first: m.layers.0.linear_attn.in_proj_b: output width 32"):
        cal.check_kernel("rtn-w4a8-fp8", w4a8, shapes)
    cal.check_kernel("rtn-w4a8-fp8", w4a8, {"m.layers.0.mlp.up_proj": (2560, 9216)})  # a shape it takes
    assert cal.kernel_refusals(cal.load_recipe("rtn-w4a16")[0], shapes) == []  # vLLM has a kernel for any shape
    channel = cal.apply_overrides(w4a8, ["weights.strategy=channel"])
    assert cal.kernel_refusals(channel, {"m.mlp.up_proj": (2560, 9216)}) == [
        "m.mlp.up_proj: channel-wise weights, not group 128"]
    nameless = cal.apply_overrides(cal.load_recipe("rtn-w4a16")[0], ["kernel.in_multiple=128"])
    with pytest.raises(cal.CalibrateError, match="`kernel` needs a name"):
        cal.check_kernel("rtn-w4a16", nameless, shapes)


def test_config_groups_split_by_group_size_and_name_layers_exactly():
    recipe, _ = cal.load_recipe("awq-w4a16")
    layers = {"model.layers.0.self_attn.q_proj": 576, "model.layers.0.mlp.down_proj": 1536}
    groups, ignore = cal.config_groups(recipe, layers)
    sizes = {g["weights"]["group_size"]: g["targets"] for g in groups.values()}
    assert sizes == {128: [r"re:^model\.layers\.0\.mlp\.down_proj$"], 64: [r"re:^model\.layers\.0\.self_attn\.q_proj$"]}
    assert ignore == []


def test_single_group_targets_linear_and_keeps_model_aware_ignores():
    recipe, _ = cal.load_recipe("int8-w8a8")
    groups, ignore = cal.config_groups(recipe, {"a.q_proj": 576, "a.down_proj": 1536})
    assert groups["group_0"]["targets"] == ["Linear"] and "group_size" not in groups["group_0"]["weights"]
    assert "re:.*lm_head$" in ignore and "re:.*mtp.*" in ignore and "re:.*linear_attn.*" in ignore and \
        "re:.*visual.*" in ignore


def test_mlp_scope_and_lm_head_recipe():
    mlp, _ = cal.load_recipe("awq-w4a16-mlp")
    groups, _ = cal.config_groups(mlp, {"m.mlp.up_proj": 2560})
    assert groups["group_0"]["targets"] == [f"re:{cal.MLP_TARGET.pattern}"]
    w4lm, _ = cal.load_recipe("w4lm")
    _, ignore = cal.config_groups(w4lm, {"m.mlp.up_proj": 1536})
    assert not any("lm_head" in p for p in ignore)


def test_every_recipe_loads_and_unknown_is_refused():
    for path in sorted((paths.ROOT / "scripts" / "levers" / "quantize" / "recipes").glob("*.yaml")):
        recipe, sha = cal.load_recipe(path.stem)
        assert recipe["algorithm"] in cal.ALGORITHMS and len(sha) == 64
    with pytest.raises(cal.CalibrateError, match="unknown recipe 'nope'; known: awq-w4a16"):
        cal.load_recipe("nope")


def test_cli_refuses_existing_output(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert cal.main(["int8-w8a8", "--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "exists; remove it first" in capsys.readouterr().err


def test_cli_refuses_a_source_that_fails_verification(tmp_path, capsys):
    assert cal.main(["int8-w8a8", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_set_overrides_nested_fields_without_touching_the_recipe():
    recipe, _ = cal.load_recipe("gptq-w4a16")
    out = cal.apply_overrides(recipe, ["weights.group_size=32", "weights.symmetric=false", "scope=mlp"])
    assert out["weights"]["group_size"] == 32 and out["weights"]["symmetric"] is False and out["scope"] == "mlp"
    assert recipe["weights"]["group_size"] == 128 and "scope" not in recipe  # a copy, not the loaded recipe


@pytest.mark.parametrize("item, message", [
    ("foo=1", "expected KEY=VALUE with KEY one of"),
    ("weights.group_size", "expected KEY=VALUE"),
    ("weights.a.b=1", "expected KEY=VALUE"),
    ("scope.x=1", "scope is not a mapping"),
    ("algorithm=magic", "algorithm must be one of"),
])
def test_bad_set_is_refused_with_one_line(item, message):
    recipe, _ = cal.load_recipe("awq-w4a16-mlp")
    with pytest.raises(cal.CalibrateError, match=message):
        cal.apply_overrides(recipe, [item])


def test_bad_set_fails_before_any_work(embedded_weights, tmp_path, capsys):
    assert cal.main(["awq-w4a16", "--model", str(embedded_weights), "--out", str(tmp_path / "o"), "--set", "bogus=1"]) == 2
    assert "bogus=1" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_recipe_switches_lift_only_their_default_ignore_and_static_scales_need_data():
    w4 = cal.load_recipe("rtn-w4a16")[0]
    assert "re:.*linear_attn.*" not in cal.ignore_patterns(w4)
    assert "re:.*lm_head$" in cal.ignore_patterns(w4) and "re:.*visual.*" in cal.ignore_patterns(w4)
    assert "re:.*linear_attn.*" in cal.ignore_patterns(cal.load_recipe("rtn-w4a16-mlp")[0])
    w4a8 = cal.load_recipe("rtn-w4a8-fp8")[0]
    assert cal.ignore_patterns(w4a8)[-1] == "re:.*linear_attn\\.in_proj_[ab]$"
    assert "re:.*lm_head$" not in cal.ignore_patterns(cal.load_recipe("w4lm")[0])
    assert not cal.needs_calibration_data(w4) and not cal.needs_calibration_data(w4a8)  # rtn, dynamic activations
    assert cal.needs_calibration_data(cal.load_recipe("fp8-w8a8-static")[0])  # static scales: observers need data
    assert cal.needs_calibration_data(cal.load_recipe("awq-w4a16")[0])
    with pytest.raises(cal.CalibrateError, match="quantize_linear_attn"):
        cal.apply_overrides(w4, ["quantize_linear_atn=true"])


def test_a_quantized_output_layer_is_named_in_a_linear_target():
    """vLLM matches the target "Linear" by class name, and its output layer is a ParallelLMHead."""
    w4 = cal.load_recipe("rtn-w4a16-lm")[0]
    layers = {"model.language_model.layers.0.mlp.up_proj": 2560, "lm_head": 2560}
    groups, ignore = cal.config_groups(w4, layers)
    assert groups["group_0"]["targets"] == ["Linear", "re:.*lm_head$"] and "re:.*lm_head$" not in ignore
    groups, _ = cal.config_groups(cal.load_recipe("rtn-w4a16")[0], {"model.language_model.layers.0.mlp.up_proj": 2560})
    assert groups["group_0"]["targets"] == ["Linear"]
