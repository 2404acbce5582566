"""Held-out evaluation sampling: batched, left-padded generation equals one prompt at a time
(greedy), and token counts / truncation flags follow the end-of-sequence token."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_async.learner.evaluation import sample_responses

PROMPTS = ["Question: what is 3 + 4 * 2?", "Question: what is 12 + 0 * 2? Step: 0 * 2 = 0.", "Answer:"]


def test_batched_left_padded_generation_equals_one_at_a_time(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts, counts, trunc = sample_responses(model, tok, PROMPTS, samples=2, temperature=0.0, max_tokens=12,
                                            batch_size=8, seed=0)
    for j, prompt in enumerate(PROMPTS):
        alone, alone_counts, alone_trunc = sample_responses(model, tok, [prompt], samples=1, temperature=0.0,
                                                            max_tokens=12, batch_size=1, seed=0)
        assert texts[j] == [alone[0][0]] * 2  # greedy: both samples equal the unpadded run
        assert counts[j] == [alone_counts[0][0]] * 2 and trunc[j] == [alone_trunc[0][0]] * 2
        for n, t in zip(counts[j], trunc[j], strict=True):
            assert (n == 12 and t) or (n <= 12 and not t)  # no EOS within 12 tokens <=> truncated


def test_sampling_is_seeded(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    a = sample_responses(model, tok, PROMPTS[:1], samples=4, temperature=1.0, max_tokens=8, batch_size=4, seed=3)
    b = sample_responses(model, tok, PROMPTS[:1], samples=4, temperature=1.0, max_tokens=8, batch_size=4, seed=3)
    assert a == b
    assert len(set(a[0][0])) > 1  # a random tiny model samples different responses
