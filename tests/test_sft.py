"""Fine-tuning data (diloco/data/sft.py): conversations read with clear errors, the loss mask on
exactly the assistant's tokens (end-of-turn included), packing whose examples keep their logits,
and a loss that counts only trained tokens."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import tiny_model

from diloco.data.errors import DataError
from diloco.data.sft import batch_at, pack, read_conversations, render
from diloco.hf.tokenizer import load_tokenizer
from diloco.model import build
from diloco.train.step import masked_next_token_loss
from test_generate_cli import FIXTURES

TOK = load_tokenizer(FIXTURES / "tokenizer")  # ChatML, SmolLM2's template (no generation blocks)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


def trained(tok, example):
    return [tok.tok.id_to_token(int(i)) for i, m in zip(example.ids, example.mask) if m]


def test_the_mask_is_every_assistant_turn_with_its_end_of_turn_token():
    e = render(TOK, CHAT)
    assert trained(TOK, e) == ["Hell", "o", "!", "<|im_end|>", "Ċ", "4", "<|im_end|>", "Ċ"]
    assert TOK.decode([int(i) for i in e.ids], skip_special_tokens=False) == TOK.render_chat(CHAT)
    # without a system prompt the template adds its own, which is never trained on
    e = render(TOK, CHAT[1:3])
    assert trained(TOK, e) == ["Hell", "o", "!", "<|im_end|>", "Ċ"]


def test_a_template_with_generation_blocks_is_masked_by_its_spans():
    template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n'}}{% if m['role'] == 'assistant' %}"
                "{% generation %}{{m['content'] + '<|im_end|>'}}{% endgeneration %}{{'\\n'}}"
                "{% else %}{{m['content'] + '<|im_end|>\\n'}}{% endif %}{% endfor %}")
    tok = dataclasses.replace(TOK, chat_template=template)
    e = render(tok, CHAT[1:])
    assert trained(tok, e) == ["Hell", "o", "!", "<|im_end|>", "4", "<|im_end|>"]  # the block, no newline


def write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown role 'robot'"),
    ({"prompt": "hi", "response": "  "}, "empty assistant response"),
    ({"prompt": "hi"}, "'response' must be a string"),
    ({"text": "hi"}, "want {'prompt', 'response'}"),
    ([1, 2], "must be a JSON object"),
])
def test_a_bad_line_names_its_file_and_line_or_is_skipped_and_counted(tmp_path, line, message):
    good = {"prompt": "What is 2+2?", "response": "4"}
    path = write(tmp_path, [good, line, good])
    with pytest.raises(DataError, match=f"data.jsonl:2: .*{message}"):
        read_conversations(path)
    conversations, skipped = read_conversations(path, on_bad="skip")
    assert len(conversations) == 2 and skipped == 1
    assert conversations[0] == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]


def test_packing_keeps_segments_apart_counts_long_examples_and_deals_disjoint_shards():
    short, long_ = render(TOK, CHAT[1:3]), render(TOK, CHAT[1:])  # the long one has a second turn
    assert len(long_.ids) > len(short.ids) + 3
    width = len(short.ids) + 2  # the long one does not fit
    rows, counts = pack([short, long_, short, short], seq_len=width - 1, too_long="drop")
    assert counts.dropped == 1 and counts.truncated == 0 and counts.examples == 4
    assert rows.tokens.shape[1] == width and int(rows.targets.sum()) == counts.trained_tokens == 3 * 5
    # a target never crosses a segment boundary, and positions restart in each segment
    for r in range(len(rows.tokens)):
        seg, pos = rows.segments[r], rows.positions[r]
        for t in np.flatnonzero(rows.targets[r]):
            assert seg[t] == seg[t + 1] > 0
        starts = np.flatnonzero(np.diff(seg, prepend=0) != 0)
        assert all(pos[s] == 0 for s in starts if seg[s] > 0)
    rows, counts = pack([short, long_], seq_len=width - 1, too_long="truncate")
    assert counts.truncated == 1 and counts.dropped == 0  # cut after its first answer: still trainable
    many, _ = pack([short] * 9, seq_len=2 * len(short.ids))
    seen = [set(map(tuple, batch_at(many, seed=0, learner=m, num_learners=2, step=s, batch_size=2)["tokens"].tolist()))
            for m in range(2) for s in range(3)]
    a = batch_at(many, seed=0, learner=1, num_learners=2, step=2, batch_size=2)
    b = batch_at(many, seed=0, learner=1, num_learners=2, step=2, batch_size=2)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # a pure function of (seed, learner, step)
    assert seen  # rows exist for both learners
    shard = [set(np.arange(m, len(many.tokens), 2)) for m in range(2)]
    assert not shard[0] & shard[1]


TINY = tiny_model(n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)


def test_each_example_in_a_packed_row_has_the_logits_it_has_alone_and_the_loss_counts_only_targets():
    model = build(TINY, TOK.vocab_size, seed=0)
    a, b = render(TOK, CHAT[1:3]), render(TOK, CHAT)
    rows, _ = pack([a, b], seq_len=len(a.ids) + len(b.ids) + 3)
    assert len(rows.tokens) == 1  # both in one row, then padding
    seg = rows.segments[0]
    logits = model.packed(model.params, rows.tokens[:, :-1], rows.segments[:, :-1], rows.positions[:, :-1])
    for s in (1, 2):
        idx = np.flatnonzero(seg[:-1] == s)
        alone = model.apply(model.params, rows.tokens[:, idx])
        np.testing.assert_allclose(np.asarray(logits[0, idx]), np.asarray(alone[0]), rtol=2e-5, atol=2e-5)
    batch = {"tokens": rows.tokens, "segments": rows.segments, "positions": rows.positions, "targets": rows.targets}
    loss, count = masked_next_token_loss(model, model.params, batch)
    assert int(count) == int(rows.targets.sum())
    logp = jax.nn.log_softmax(np.asarray(logits[0]))
    want = -np.mean([logp[t, rows.tokens[0, t + 1]] for t in np.flatnonzero(rows.targets[0])])
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
