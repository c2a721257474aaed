"""Speculative decoding: the prompt set's splits (no server)."""

from __future__ import annotations

import json

from scripts import make_spec_prompts
from scripts.common import paths


def rows(split: str) -> list[dict]:
    return [json.loads(x) for x in (paths.EVAL / "prompts" / f"spec-v1-{split}.jsonl").read_text().splitlines()]


def test_spec_prompts_are_generated_by_the_committed_script():
    for name, text in make_spec_prompts.render().items():
        assert (paths.EVAL / "prompts" / name).read_text() == text, f"{name}: run python -m scripts.make_spec_prompts"


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
