"""Structured outputs through the engine and the offline API, on the bundled model.

Every constrained output is checked against its constraint (pydantic validates JSON against the model the
schema came from); the unconstrained requests beside constrained ones are compared with the same requests
run alone; preemption, prefix caching, n > 1 and logprobs are compared with plain runs of the same
requests.
"""

from __future__ import annotations

import enum
import json
import re
import threading
import time

import pytest
import torch
from pydantic import BaseModel, Field

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.structured_output.backend import ascii_digits
from pagedserve.structured_output.manager import apply_token_mask

pytestmark = pytest.mark.slow


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    favourite: Color
    address: Address
    tags: list[str] = Field(max_length=3)


PERSON = Person.model_json_schema()
DATE = r"\d{4}-\d{2}-\d{2}"


def chat_prompt(llm: LLM, text: str) -> dict:
    tok = llm.engine.tokenizer
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)}


@pytest.fixture(scope="module")
def llm(llm_fp32) -> LLM:
    return llm_fp32


def test_params_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="structured_outputs: give exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .* \\(got json, regex\\)"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown field 'jsn'"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs: must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    # vLLM's older name, and a dict of the fields
    assert SamplingParams(guided_decoding=StructuredOutputsParams(regex="a")).structured_outputs.regex == "a"
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]


def test_ascii_digits():
    assert ascii_digits(r"\d{4}-[\d.]") == "[0-9]{4}-[0-9.]"
    assert ascii_digits(r"\\d") == r"\\d"  # an escaped backslash then a plain d


@pytest.mark.parametrize("spec, message", [
    (dict(regex="a(b"), "invalid regex: .*unclosed group|invalid regex"),
    (dict(json={"type": "nonsense"}), "invalid json: .*nonsense"),
    (dict(grammar="start: missing_rule"), "invalid grammar: .*missing_rule"),
])
def test_invalid_specs_are_value_errors(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_json_schema_regex_choice_grammar(llm):
    prompts = [chat_prompt(llm, f"Describe person number {i} as JSON.") for i in range(3)]
    people = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=120,
                                                  structured_outputs=StructuredOutputsParams(json=PERSON)),
                          use_tqdm=False)
    for out in people:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        Person.model_validate_json(c.text)  # nested objects, the enum, the array, required fields
    dates = llm.generate([chat_prompt(llm, "When did it happen?")],
                         SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=20,
                                        structured_outputs=StructuredOutputsParams(regex=DATE)), use_tqdm=False)
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", c.text) for c in dates[0].outputs), dates[0].outputs
    choices = ["positive", "negative", "no idea at all"]
    picked = llm.generate([chat_prompt(llm, "I love this film! Sentiment?")],
                          SamplingParams(temperature=0, max_tokens=10,
                                         structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert picked[0].outputs[0].text in choices
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    said = llm.generate([chat_prompt(llm, "What is 6 times 7?")],
                        SamplingParams(temperature=0, max_tokens=16,
                                       structured_outputs=StructuredOutputsParams(grammar=lark)), use_tqdm=False)
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", said[0].outputs[0].text)


def test_constrained_beside_plain_requests_leaves_them_unchanged(llm):
    plain = [chat_prompt(llm, t) for t in ("Tell me about cats.", "What is a paged KV cache?")]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24)
    alone = llm.generate(plain, [greedy, seeded], use_tqdm=False)
    constrained = SamplingParams(temperature=0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=PERSON))
    mixed = llm.generate([plain[0], chat_prompt(llm, "A person as JSON"), plain[1]], [greedy, constrained, seeded],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [o.outputs[0].token_ids for o in alone]
    json.loads(mixed[1].outputs[0].text)


def test_logprobs_stop_strings_and_max_tokens_under_a_grammar(llm):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"items": {
        "type": "array", "items": {"type": "string"}}}, "required": ["items"]})
    prompt = chat_prompt(llm, "List some fruits as JSON.")
    runner = llm.engine.runner
    seen: list[torch.Tensor] = []
    runner.on_logits = lambda ids, logits: seen.append(logits[0].clone())
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
    finally:
        runner.on_logits = None
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text.startswith("{")
    assert len(out.logprobs) == 6
    # The logprobs are the model's own, before the mask (vLLM's raw logprobs).
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        raw = torch.log_softmax(seen[step].float(), dim=-1)
        assert entry[token].logprob == pytest.approx(float(raw[token]), abs=1e-4)
        assert len(entry) >= 2
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, stop=['",'], structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '",' and '",' not in stopped.text


def test_preemption_and_prefix_cache_keep_constrained_outputs(llm):
    """Few KV blocks: constrained requests are preempted (recomputed) and must still give the tokens of a
    roomy run; a second run hits the prefix cache and gives them again."""
    spec = StructuredOutputsParams(json=PERSON)
    roomy = llm
    prompts = [chat_prompt(roomy, f"Person {i} of the story, as JSON, with a long description.") for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=56, structured_outputs=spec)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(dtype="float32", num_kv_blocks=18, max_num_seqs=6)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    hits = roomy.engine.stats().prefix_cache_hits
    again = roomy.generate(prompts, params, use_tqdm=False)
    assert roomy.engine.stats().prefix_cache_hits > hits
    assert [o.outputs[0].token_ids for o in again] == want
    assert tight.engine.kv_manager.pool.num_used_blocks == 0 and not tight.engine.structured.matchers


def test_a_grammar_failure_ends_only_that_request(llm, monkeypatch):
    engine = llm.engine
    spec = StructuredOutputsParams(json=PERSON)
    plain = chat_prompt(llm, "Tell me about dogs.")
    want = llm.generate([plain], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0].token_ids
    accept = engine.structured.accept
    seen: dict[str, int] = {}

    def failing(rid, token):
        seen[rid] = seen.get(rid, 0) + 1
        if rid.startswith("bad") and seen[rid] == 3:
            return False, "structured_outputs: the grammar rejected token 7 (injected)"
        return accept(rid, token)

    monkeypatch.setattr(engine.structured, "accept", failing)
    engine.add_request("bad", chat_prompt(llm, "JSON please"), SamplingParams(temperature=0, max_tokens=40,
                                                                              structured_outputs=spec))
    engine.add_request("good", plain, SamplingParams(temperature=0, max_tokens=20))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert "rejected token" in finals["bad"].error and finals["bad"].outputs[0].finish_reason == "abort"
    assert len(finals["bad"].outputs[0].token_ids) == 3
    assert finals["good"].error is None and finals["good"].outputs[0].token_ids == want
    assert "bad" not in engine.structured.matchers


def test_a_slow_grammar_does_not_hold_up_the_batch(llm, monkeypatch):
    """The compile runs on its own thread: a plain request keeps stepping while it runs, and the constrained
    request joins once it is ready. An uncached invalid spec, added straight to the engine, ends that
    request with the compile error."""
    engine = llm.engine
    backend = engine.structured.backend
    compile_fn = backend._compile
    release = threading.Event()

    def slow(params):
        release.wait(30)
        return compile_fn(params)

    monkeypatch.setattr(backend, "_compile", slow)
    spec = StructuredOutputsParams(regex=r"[a-z]{3} slow")
    engine.add_request("plain", chat_prompt(llm, "Count to ten."), SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("slow", chat_prompt(llm, "Three letters"), SamplingParams(temperature=0, max_tokens=12,
                                                                                 structured_outputs=spec))
    engine.add_request("broken", "Hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="(unclosed")))
    finals = {}
    while "plain" not in finals:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert "slow" not in finals and engine.get_request("slow") is None  # never scheduled while compiling
    release.set()
    deadline = time.time() + 60
    while engine.has_unfinished_requests() and time.time() < deadline:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert re.fullmatch(r"[a-z]{3} slow", finals["slow"].outputs[0].text)
    assert "invalid regex" in finals["broken"].error and finals["broken"].outputs[0].token_ids == []
    assert engine.finished_by_reason["abort"] >= 1


def test_mask_kernel_equals_the_torch_path(llm):
    kernels = llm.engine.runner.kernels
    if kernels is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(6, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(
        torch.int32)
    bitmask[0] = -1  # every token allowed
    rows = torch.tensor([4, 0, 2])
    a, b = logits.clone(), logits.clone()
    apply_token_mask(a, rows, bitmask, kernels)
    apply_token_mask(b, rows, bitmask, None)
    assert torch.equal(a, b)
    bit = (bitmask[1, 5 // 32] >> (5 % 32)) & 1
    assert (a[0, 5] == float("-inf")) == (bit == 0)
    assert torch.equal(a[[1, 3, 5]], logits[[1, 3, 5]]) and torch.equal(a[4], logits[4])
    # The greedy fast path's C++ argmax over masked rows (-inf everywhere but a few allowed tokens).
    only = torch.full((4, vocab), float("-inf"))
    for r, allowed in enumerate(([3], [999], [10, 500], [0])):
        only[r, allowed] = logits[r, allowed]
    assert kernels.argmax_rows(only).tolist() == only.argmax(dim=-1).tolist()
