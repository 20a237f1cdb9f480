"""Constrained decoding through the engine (CPU, tiny-random): the bitmask applied on the device
(the artifact's `constrained_pick` / `constrained_mask`, on decode and prefill logits) gives the
same tokens and logprobs as the host mask, for greedy and seeded sampled requests batched with
a free one; the answers validate; and a device path that ignored the masks would be caught."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.engine import Engine
from qwen35_tvm.runtime.grammar import GrammarCompiler
from qwen35_tvm.runtime.sampler import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 9},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
            "required": ["city"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["kind", "age", "owner", "tags"],
    "additionalProperties": False,
}
# Few blanks between tokens: a random model free to pick whitespace would pick little else.
FORMAT = {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 2}
SPEC = {"type": "structural_tag", "format": FORMAT}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def setup(tiny_random_artifact):
    art = Artifact(tiny_random_artifact)
    tok = Tokenizer.from_file(str(tiny_random_artifact / "tokenizer.json"))
    grammars = GrammarCompiler(tok, art.widths.decodable, art.eos_token_ids)
    return art, tok, grammars, grammars.compile(SPEC)


def generate(setup, on_device: bool, spy=None) -> list[tuple[list[int], list[float]]]:
    art, tok, grammars, compiled = setup
    engine = Engine(art, max_batch_size=4, max_total_tokens=2048)
    assert engine.runner.constrains_on_device
    engine.runner.constrains_on_device = on_device
    if spy is not None:
        spy(engine.runner)
    prompts = [tok.encode(t).ids for t in ("A pet as JSON:", "Describe a dog.", "x", "Hi")]
    params = [GREEDY, GREEDY, SamplingParams(temperature=1.0, seed=3), GREEDY]
    ids = [
        engine.submit(
            p, sp, 120, grammar=grammars.state(compiled) if k < 3 else None  # the 4th is free
        )
        for k, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    out: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprobs)
    return [out[i] for i in ids]


def _json(tok: Tokenizer, ids: list[int], eos: list[int]) -> object:
    return json.loads(tok.decode([t for t in ids if t not in eos]))


def test_device_mask_equals_host_mask_and_answers_validate(setup):
    art, tok = setup[0], setup[1]
    calls: list[tuple[int, bool, bool]] = []

    def spy(runner):
        constrain = runner.constrain

        def counted(step, rows, bitmasks, pick, mask):
            calls.append((len(rows), pick, mask))
            return constrain(step, rows, bitmasks, pick, mask)

        runner.constrain = counted

    device = generate(setup, True, spy)
    host = generate(setup, False)
    assert calls and any(p for _, p, _ in calls) and any(m for *_, m in calls)
    for (d_ids, d_lp), (h_ids, h_lp) in zip(device, host, strict=True):
        assert d_ids == h_ids
        np.testing.assert_allclose(d_lp, h_lp, atol=1e-4)
    for ids, _ in device[:3]:
        jsonschema.validate(_json(tok, ids, art.eos_token_ids), SCHEMA)


def test_a_device_path_that_ignored_the_masks_would_be_caught(setup):
    art, tok = setup[0], setup[1]

    def ignore_masks(runner):
        constrain = runner.constrain
        runner.constrain = lambda step, rows, bits, pick, mask: constrain(
            step, rows, np.full_like(bits, -1), pick, mask
        )

    answers = generate(setup, True, ignore_masks)[:3]
    broken = 0
    for ids, _ in answers:
        try:
            jsonschema.validate(_json(tok, ids, art.eos_token_ids), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            broken += 1
    assert broken == 3
