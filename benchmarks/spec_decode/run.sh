#!/bin/sh
# Speculative decoding benchmarks (benchmarks/README.md, "Speculative decoding"). Each pair runs in one
# process on one engine (--compare-no-spec switches speculation off for every other run), except W1, whose
# two runs are serial. Run on a quiet machine: `sh benchmarks/spec_decode/run.sh`.
set -e
cd "$(dirname "$0")/../.."
B=".venv/bin/pagedserve bench"
NGRAM='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
DRAFT='{"method": "draft_model", "draft_num_layers": 12, "num_speculative_tokens": 3}'
OUT=benchmarks/spec_decode
# A single stream that copies its input (rewrite with one word changed, code edits), greedy, to EOS.
$B latency --prompts-file $OUT/copy_prompts.jsonl --output-len 160 --stop-at-eos --compare-no-spec \
  --speculative-config "$NGRAM" --quiet --json $OUT/copy_ngram.json > /dev/null
$B latency --prompts-file $OUT/copy_prompts.jsonl --output-len 160 --stop-at-eos --compare-no-spec \
  --speculative-config "$DRAFT" --quiet --json $OUT/copy_self_draft.json > /dev/null
# W2: random token-id prompts, 32 in, 256 out; greedy, then sampled (temperature 1: drafts mostly fail).
$B latency --input-len 32 --output-len 256 --num-iters 3 --compare-no-spec \
  --speculative-config "$NGRAM" --quiet --json $OUT/w2_ngram.json > /dev/null
$B latency --input-len 32 --output-len 256 --num-iters 3 --compare-no-spec --temperature 1.0 \
  --speculative-config "$NGRAM" --quiet --json $OUT/w2_ngram_t1.json > /dev/null
# W1: 128 x (128 in + 128 out) all at once, without and with speculation configured.
$B throughput --num-prompts 128 --input-len 128 --output-len 128 --quiet --json $OUT/w1_none.json > /dev/null
$B throughput --num-prompts 128 --input-len 128 --output-len 128 --quiet --speculative-config "$NGRAM" \
  --json $OUT/w1_ngram.json > /dev/null
