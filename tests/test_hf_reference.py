"""Against transformers' own outputs, stored as fixtures: chat rendering and token ids of a saved
tokenizer, and SmolLM2-135M-Instruct imported from its GGUF (tokens, logits, greedy reply)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.pretrained import shipped_smollm2
from diloco.hf.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TOKENIZER_REF = json.loads((FIXTURES / "tokenizer" / "reference.json").read_text())
SMOLLM2_REF = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())


def _check_chats(tok, ref):
    for name, chat in ref["chats"].items():
        for flag in (False, True):
            want = chat["with_generation_prompt" if flag else "without_generation_prompt"]
            assert tok.render_chat(chat["messages"], add_generation_prompt=flag) == want["text"], name
            assert tok.apply_chat_template(chat["messages"], add_generation_prompt=flag) == want["ids"], name


def _check_specials(tok, ref):
    for kind in ("bos", "eos", "pad", "unk"):
        assert getattr(tok, f"{kind}_token") == ref["special_tokens"][f"{kind}_token"]
        assert tok.tok.token_to_id(ref["special_tokens"][f"{kind}_token"]) == ref["special_tokens"][f"{kind}_token_id"]


def test_saved_tokenizer_renders_and_encodes_chats_as_transformers():
    tok = load_tokenizer(FIXTURES / "tokenizer")
    _check_chats(tok, TOKENIZER_REF)
    _check_specials(tok, TOKENIZER_REF)
    for case in TOKENIZER_REF["plain"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids_no_special"], case["text"]
    ids = TOKENIZER_REF["chats"]["multi_turn"]["with_generation_prompt"]["ids"]
    assert tok.decode(ids) == TOKENIZER_REF["decode"]["skip_special_tokens"]
    assert tok.decode(ids, skip_special_tokens=False) == TOKENIZER_REF["decode"]["keep_special_tokens"]


needs_smollm2 = pytest.mark.skipif(shipped_smollm2() is None, reason="needs `make smollm2`")


@pytest.fixture(scope="module")
def smollm2():
    from diloco.hf import load

    return load(shipped_smollm2())


@needs_smollm2
def test_smollm2_config_and_tokenizer_match_transformers_gguf_import(smollm2):
    ref = SMOLLM2_REF["model_config"]
    cfg = smollm2.config
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.tie_embeddings) == (
        ref["hidden_size"], ref["num_hidden_layers"], ref["num_attention_heads"], ref["num_key_value_heads"],
        ref["intermediate_size"], ref["tie_word_embeddings"])
    assert cfg.rope_theta == ref["rope_parameters"]["rope_theta"] and smollm2.vocab_size == ref["vocab_size"]
    tok = smollm2.tokenizer
    assert tok.chat_template == SMOLLM2_REF["chat_template_found"]
    _check_chats(tok, SMOLLM2_REF["tokenizer"])
    _check_specials(tok, SMOLLM2_REF["tokenizer"])
    for case in SMOLLM2_REF["tokenizer"]["plain"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids_no_special"], case["text"]


@needs_smollm2
def test_smollm2_logits_and_greedy_reply_match_transformers(smollm2):
    ref = SMOLLM2_REF["logits"]
    logits = jax.jit(smollm2.model.apply)(smollm2.model.params, jnp.asarray([ref["input_ids"]]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for pos in ref["positions"]:
        row = logp[pos["position"]]
        np.testing.assert_allclose(row[pos["top_ids"]], pos["top_logprobs"], atol=2e-3)
        np.testing.assert_allclose(row[ref["fixed_ids"]], pos["fixed_logprobs"], atol=2e-3)
        assert int(np.argmax(row)) == pos["top_ids"][0]

    from diloco.model.generate import generate

    gen = SMOLLM2_REF["generate"]
    out = generate(smollm2.model, smollm2.config, [ref["input_ids"]], 12, stop_ids=smollm2.tokenizer.stop_ids)
    assert out.tokens[0] + [smollm2.tokenizer.eos_id] == gen["new_ids"]
    assert smollm2.tokenizer.decode(out.tokens[0]) == gen["new_text_skip_special"]
