"""`pagedserve trace`: the trace's numbers agree with the engine's own counters and outputs."""

from __future__ import annotations

import json

import pytest
from trace_helpers import PROMPTS, small_config, small_trace, spec_trace

from pagedserve.engine.trace import engine_trace_data
from pagedserve.entrypoints.cli.main import main
from pagedserve.entrypoints.dashboard.views import render_html, write_report
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trace():
    return small_trace()


def test_workload_shows_chunked_prefill_and_preemption(trace):
    _, _, data = trace
    assert data["totals"]["preemptions"] > 0
    states = {r["id"]: [s["state"] for s in r["segments"]] for r in data["requests"]}
    assert states["r0"][:2] == ["prefill", "prefill"], "the 20-token prompt is prefilled in two chunks"
    assert any("preempted" in s for s in states.values())
    assert any(s["num_scheduled_tokens"] == s["token_budget"] for s in data["steps"])


def test_tokens_per_step_sum_to_prompt_generated_and_recomputed(trace):
    engine, recorder, data = trace
    steps = data["steps"]
    for s in steps:
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] == s["num_scheduled_tokens"]
        assert sum(s["scheduled"].values()) == s["num_scheduled_tokens"] <= s["token_budget"]
    totals = data["totals"]
    assert totals["scheduled_tokens"] == sum(s["num_scheduled_tokens"] for s in steps)
    assert totals["prefill_tokens"] == engine.num_computed_prefill_tokens
    assert totals["preemptions"] == engine.num_preemptions
    assert totals["prompt_tokens"] == engine.num_prompt_tokens
    assert totals["generated_tokens"] == engine.num_generation_tokens
    # Every request computes its prompt and all its tokens but the last sampled one, plus whatever it
    # had computed before each preemption (prefix caching is off, so nothing comes from the cache).
    expected_total = 0
    for r in data["requests"]:
        out = recorder.outputs[r["id"]]
        prompt, generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        assert (r["prompt_tokens"], r["output_tokens"]) == (prompt, generated)
        assert r["computed_tokens"] == prompt + generated - 1 + r["recomputed_tokens"], r["id"]
        assert r["recomputed_tokens"] > 0 or r["num_preemptions"] == 0
        expected_total += r["computed_tokens"]
    assert totals["scheduled_tokens"] == expected_total
    assert totals["recomputed_tokens"] > 0


def test_block_counts_never_exceed_the_pool(trace):
    _, _, data = trace
    num_blocks, bs = data["config"]["num_blocks"], data["config"]["block_size"]
    assert num_blocks == small_config().num_kv_blocks
    for s, held in zip(data["steps"], data["block_tables"], strict=True):
        assert s["num_used_blocks"] + s["num_cached_free_blocks"] + s["num_free_blocks"] == num_blocks
        assert min(s["num_used_blocks"], s["num_cached_free_blocks"], s["num_free_blocks"]) >= 0
        owned = [b for h in held.values() for b in h["blocks"]]
        assert len(owned) == len(set(owned)), f"step {s['step']}: a block held twice without prefix caching"
        assert all(0 <= b < num_blocks for b in owned)
        for rid, h in held.items():
            assert h["tokens"] is not None
            assert -(-h["tokens"] // bs) == len(h["blocks"]), (s["step"], rid)


def test_finish_reasons_match_outputs(trace):
    _, recorder, data = trace
    by_id = {r["id"]: r for r in data["requests"]}
    assert set(by_id) == {f"r{i}" for i in range(len(PROMPTS))}
    for rid, out in recorder.outputs.items():
        assert by_id[rid]["finish_reason"] == out.outputs[0].finish_reason, rid
    for s in data["steps"]:
        for rid, reason in s["finished"].items():
            assert by_id[rid]["finish_step"] == s["step"] and by_id[rid]["finish_reason"] == reason
    assert by_id["r4"]["finish_reason"] == "abort"
    assert by_id["r3"]["arrival_step"] == 5 and by_id["r3"]["segments"][0]["from"] == 5


def test_report_is_self_contained(trace, tmp_path):
    _, _, data = trace
    html_path = tmp_path / "trace.html"
    json_path = write_report(data, str(html_path))
    assert json_path == str(tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == json.loads(json.dumps(data))
    page = html_path.read_text()
    assert "__TRACE" not in page and "__TITLE__" not in page
    for remote in ("<script src", "<link", "@import", "https://", "url("):
        assert remote not in page
    # Prompt text cannot close the data <script>.
    evil = dict(data, model="</script><script>alert(1)</script>")
    assert "</script><script>alert" not in render_html(evil)


def test_engine_trace_data_of_a_live_engine(trace):
    engine, _, _ = trace
    engine.add_request("live-a", PROMPTS[0], SamplingParams(max_tokens=3))
    engine.add_request("live-b", PROMPTS[1], SamplingParams(max_tokens=3))
    engine.step()
    data = engine_trace_data(engine, max_steps=2)  # no recorder: what the dashboard sees
    assert len(data["steps"]) == 2 and data["first_step"] == data["steps"][0]["step"]
    live = {r["id"]: r for r in data["requests"] if r["id"].startswith("live-")}
    assert set(live) == {"live-a", "live-b"}
    assert live["live-a"]["segments"][0]["state"] == "prefill"
    assert live["live-b"]["prompt_tokens"] == len(engine.tokenizer.encode(PROMPTS[1]))
    held = data["block_tables"][-1]["live-a"]
    assert held["tokens"] == 16 and len(held["blocks"]) == 4
    json.dumps(data)
    engine.abort_request(["live-a", "live-b"])


def test_cli_trace_with_a_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('Hello there\n{"prompt": "One two three", "max_tokens": 2, "arrival_step": 1}\n')
    out = tmp_path / "report.html"
    rc = main(["trace", "--prompts", str(prompts), "--dtype", "float32", "--max-tokens", "2",
               "--num-kv-blocks", "8", "-o", str(out)])
    assert rc == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert [r["id"] for r in data["requests"]] == ["req-00", "req-01"]
    assert [r["output_tokens"] for r in data["requests"]] == [2, 2]
    assert data["requests"][1]["arrival_step"] == 1
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert "2 requests" in capsys.readouterr().err


def test_demo_workload_is_varied():
    from pagedserve.entrypoints.cli.trace import demo_engine_overrides, demo_workload

    work = demo_workload()
    assert len(work) == 12 and len({w.request_id for w in work}) == 12
    assert len({len(w.prompt.split()) for w in work}) == 12
    assert len({w.params.max_tokens for w in work}) > 6
    assert len({w.arrival_step for w in work}) > 6
    assert any(w.params.stop for w in work) and any(w.abort_step is not None for w in work)
    over = demo_engine_overrides()
    assert over["keep_block_tables"]
    assert over["max_num_batched_tokens"] < max(len(w.prompt) // 4 for w in work)  # some prompts are chunked


# ---- speculative decoding -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec():
    return spec_trace()


def test_trace_without_speculation_has_no_spec_figures(trace):
    _, _, data = trace
    t = data["totals"]
    assert data["config"]["speculative_config"] is None
    assert (t["drafts"], t["draft_tokens"], t["accepted_tokens"], t["acceptance_rate"]) == (0, 0, 0, None)
    assert all(r["draft_tokens"] == r["accepted_tokens"] == 0 for r in data["requests"])
    assert not any("draft_tokens" in seg for r in data["requests"] for seg in r["segments"])
    assert not any("draft_blocks" in h for held in data["block_tables"] for h in held.values())


def test_spec_totals_match_the_engine_stats(spec):
    engine, _, data, stats, _ = spec
    t = data["totals"]
    assert data["config"]["speculative_config"] == engine.speculative_config.to_dict()
    assert data["config"]["speculative_config"]["method"] == "ngram"
    assert t["drafts"] == stats.num_drafts
    assert t["draft_tokens"] == stats.num_draft_tokens == sum(s["num_spec_tokens"] for s in data["steps"])
    assert t["accepted_tokens"] == stats.num_accepted_tokens
    assert t["accepted_per_pos"] == stats.accepted_per_pos
    assert 0 < t["accepted_tokens"] < t["draft_tokens"], "some drafts accepted and some rejected"
    assert t["acceptance_rate"] == round(t["accepted_tokens"] / t["draft_tokens"], 4)


def test_spec_generates_the_same_tokens_in_fewer_steps(spec):
    engine, recorder, data, _, (baseline, baseline_steps) = spec
    for r in data["requests"]:
        spec_ids = recorder.outputs[r["id"]].outputs[0].token_ids
        assert spec_ids == baseline.outputs["b" + r["id"][1:]].outputs[0].token_ids, r["id"]
        assert r["output_tokens"] == len(spec_ids)
    t = data["totals"]
    assert t["generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in baseline.outputs.values())
    assert t["steps"] < baseline_steps  # accepted drafts are tokens for which no step of their own was needed
    # A step adds, per request, its accepted drafts and one more token.
    for s in data["steps"]:
        for rid, drafts in s["spec_drafts"].items():
            assert s["scheduled"][rid] == len(drafts) + 1 and rid not in s["prefill_requests"]
            assert 0 <= s["spec_accepted"][rid] <= len(drafts)


def test_spec_steps_and_requests_add_up(spec):
    _, recorder, data, _, _ = spec
    steps, t = data["steps"], data["totals"]
    for s in steps:
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] == s["num_scheduled_tokens"]
        assert s["num_spec_tokens"] == sum(len(d) for d in s["spec_drafts"].values()) <= s["num_decode_tokens"]
        assert s["num_accepted_tokens"] == sum(s["spec_accepted"].values())
    rejected = t["draft_tokens"] - t["accepted_tokens"]
    by_id = {r["id"]: r for r in data["requests"]}
    for rid, r in by_id.items():
        drafts = [(s["spec_drafts"][rid], s["spec_accepted"][rid]) for s in steps if rid in s["spec_drafts"]]
        assert r["draft_tokens"] == sum(len(d) for d, _ in drafts)
        assert r["accepted_tokens"] == sum(a for _, a in drafts)
        assert sum(seg.get("draft_tokens", 0) for seg in r["segments"]) == r["draft_tokens"]
        assert sum(seg.get("accepted_tokens", 0) for seg in r["segments"]) == r["accepted_tokens"]
        assert sum(seg["tokens"] for seg in r["segments"]) == sum(s["scheduled"].get(rid, 0) for s in steps)
        # Computed tokens are those whose K/V were kept: rejected drafts do not count.
        out = recorder.outputs[rid]
        assert r["computed_tokens"] == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1, rid
    assert sum(r["draft_tokens"] for r in by_id.values()) == t["draft_tokens"]
    assert sum(r["accepted_tokens"] for r in by_id.values()) == t["accepted_tokens"]
    assert by_id["s0"]["draft_tokens"] > 0 and by_id["s2"]["draft_tokens"] == 0
    assert sum(r["computed_tokens"] for r in by_id.values()) + rejected == t["scheduled_tokens"]


def test_spec_block_tables_return_the_draft_lookahead(spec):
    _, _, data, _, _ = spec
    bs = data["config"]["block_size"]
    returned = 0
    for s, held in zip(data["steps"], data["block_tables"], strict=True):
        for rid, h in held.items():
            assert -(-h["tokens"] // bs) == len(h["blocks"]), (s["step"], rid)
            if "draft_blocks" in h:
                assert rid in s["spec_drafts"] and s["spec_accepted"][rid] < len(s["spec_drafts"][rid])
                assert not set(h["draft_blocks"]) & set(h["blocks"])
                returned += len(h["draft_blocks"])
    assert returned > 0


def test_spec_report_embeds_the_figures(spec):
    _, _, data, _, _ = spec
    page = render_html(data)
    t = data["totals"]
    for key in ("draft_tokens", "accepted_tokens", "acceptance_rate"):
        assert f'"{key}":{json.dumps(t[key])}' in page
    assert '"speculative_config":{"method":"ngram"' in page
    assert "acceptance rate" in page and "spec-table" in page  # the renderer's spec parts are inlined
