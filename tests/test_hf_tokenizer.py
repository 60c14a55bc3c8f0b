"""HFTokenizer: chat templates rendered as transformers 5.x renders them, and the v5 file layout.

The expected strings are written out by hand from the templates; ids are checked against the
tokenizer's own encoding of those strings, so no transformers install is needed.
"""

import json
from dataclasses import replace
from datetime import datetime

import numpy as np
import pytest
import tokenizers as hf
from tokenizers import processors

from diloco.hf.chat import ChatTemplateError
from diloco.hf.source import CheckpointError
from diloco.hf.tokenizer import (HFTokenizer, from_parts, load_tokenizer,
                                 save_tokenizer)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2-Instruct's template.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same shape with the assistant's reply (and its end marker) inside a generation block.
CHATML_GEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
              "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}")
CONVERSATION = [{"role": "user", "content": "Hello, how are you?"},
                {"role": "assistant", "content": "I am fine, thank you."},
                {"role": "user", "content": "What is a tokenizer?"}]
DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n")
EXPECTED = (DEFAULT_SYSTEM
            + "<|im_start|>user\nHello, how are you?<|im_end|>\n"
            + "<|im_start|>assistant\nI am fine, thank you.<|im_end|>\n"
            + "<|im_start|>user\nWhat is a tokenizer?<|im_end|>\n")
ONE = [{"role": "user", "content": "hi"}]  # transformers refuses an empty conversation
CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
          "unk_token": "<|endoftext|>", "chat_template": CHATML}


@pytest.fixture(scope="module")
def tok():
    t = hf.Tokenizer(hf.models.BPE())
    t.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["Hello, how are you? I am fine, thank you.", "What is a tokenizer?",
                           "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                           "system user assistant"], trainer=trainer)
    return t


@pytest.fixture(scope="module")
def smol(tok):
    return from_parts(tok, CONFIG)


def ids_of(t: HFTokenizer, text: str) -> list[int]:
    return t.tok.encode(text, add_special_tokens=False).ids


def test_chatml_renders_exactly(smol):
    assert smol.render_chat(CONVERSATION) == EXPECTED
    assert smol.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False) == (
        EXPECTED + "<|im_start|>assistant\n")


def test_system_message_replaces_the_default(smol):
    chat = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    assert smol.render_chat(chat) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                      "<|im_start|>user\nHello, how are you?<|im_end|>\n")


def test_ids_are_the_rendered_text_without_added_specials(smol):
    ids = smol.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert ids == ids_of(smol, EXPECTED + "<|im_start|>assistant\n")
    start, end = smol.tok.token_to_id("<|im_start|>"), smol.tok.token_to_id("<|im_end|>")
    assert (ids.count(start), ids.count(end)) == (5, 4)  # each marker is one id, never split
    assert ids[0] == start and smol.decode(ids, skip_special_tokens=False) == (
        EXPECTED + "<|im_start|>assistant\n")


def test_generation_mask_covers_exactly_the_assistant_replies(tok):
    t = from_parts(tok, {**CONFIG, "chat_template": CHATML_GEN})
    chat = CONVERSATION + [{"role": "assistant", "content": "It splits text into tokens."}]
    text, spans = t.render_chat(chat, return_generation_spans=True)
    replies = ["I am fine, thank you.<|im_end|>", "It splits text into tokens.<|im_end|>"]
    assert [text[a:b] for a, b in spans] == replies
    ids, mask = t.apply_chat_template(chat, return_assistant_tokens_mask=True)
    assert ids == ids_of(t, text) and len(mask) == len(ids)
    kept = [i for i, m in zip(ids, mask) if m]
    assert t.decode(kept, skip_special_tokens=False) == "".join(replies)
    # Each reply starts right after '\n', a token boundary, so the mask is the replies and no more.
    runs = np.flatnonzero(np.diff([0, *mask, 0]))
    assert [t.decode(ids[a:b], skip_special_tokens=False) for a, b in zip(runs[::2], runs[1::2])] == replies


def test_mask_needs_a_generation_block_and_tokenize(smol):
    with pytest.raises(ValueError, match="generation"):
        smol.apply_chat_template(CONVERSATION, return_assistant_tokens_mask=True)
    with pytest.raises(ValueError, match="tokenize=True"):
        smol.apply_chat_template(CONVERSATION, tokenize=False, return_assistant_tokens_mask=True)


def with_template(t: HFTokenizer, template: str) -> HFTokenizer:
    return replace(t, chat_template=template)


def test_tojson_is_transformers_not_jinja(smol):
    tools = [{"name": "wetter", "description": "<Grüße> & 'mehr'", "b": 1, "a": 2}]
    t = with_template(smol, "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2, sort_keys=True) }}"
                            "|{{ tools[0] | tojson(separators=(',', ':')) }}")
    assert t.render_chat(ONE, tools=tools) == "|".join([
        json.dumps(tools, ensure_ascii=False), json.dumps(tools[0], ensure_ascii=False, indent=2,
                                                          sort_keys=True),
        json.dumps(tools[0], ensure_ascii=False, separators=(",", ":"))])


def test_raise_exception_surfaces_the_templates_message(smol):
    t = with_template(smol, "{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}")
    with pytest.raises(ChatTemplateError) as e:
        t.render_chat([{"role": "assistant", "content": "hi"}])
    assert str(e.value) == "Conversations must start with a user turn"
    assert isinstance(e.value, ValueError)


def test_loopcontrols_trim_lstrip_and_strftime(smol):
    t = with_template(smol, "{% for m in messages %}\n"
                            "    {% if loop.index == 2 %}{% continue %}{% endif %}\n"
                            "    {% if loop.index == 4 %}{% break %}{% endif %}\n"
                            "{{ m['content'] }};\n"
                            "{% endfor %}{{ strftime_now('%Y') }}")
    chat = [{"role": "user", "content": c} for c in "abcde"]
    # trim_blocks eats the newline after each tag, lstrip_blocks the indentation before it.
    assert t.render_chat(chat) == f"a;\nc;\n{datetime.now().year}"


def test_context_holds_set_specials_and_kwargs(smol):
    t = with_template(smol, "[{{ eos_token }}|{{ unk_token }}|{{ bos_token is defined }}|"
                            "{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ x }}]")
    # bos_token is None, so it is absent from special_tokens_map and undefined in the template.
    assert t.render_chat(ONE) == "[<|im_end|>|<|endoftext|>|False|None|None|False|]"
    assert t.render_chat(ONE, True, x=3, eos_token="E", documents=[{"text": "d"}]) == (
        "[E|<|endoftext|>|False|None|[{'text': 'd'}]|True|3]")


def test_messages_reach_the_template_as_transformers_5_hands_them(smol):
    t = with_template(smol, "{% for m in messages %}{{ m | tojson }}{% endfor %}|{{ k }}")
    chat = [{"role": "user", "content": "q", "name": None},  # None-valued keys are dropped
            {"role": "assistant", "content": "a", "reasoning": "r"},  # reasoning is aliased
            {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]
    assert t.render_chat(chat, k=(np.float32(0.5), datetime)) == (
        '{"role": "user", "content": "q"}'
        '{"thinking": "r", "role": "assistant", "content": "a", "reasoning": "r", '
        '"reasoning_content": "r"}'
        '{"role": "assistant", "tool_calls": [{"name": "f"}]}|(0.5, \'<type>\')')


def test_sandbox_refuses_mutation_and_underscore_names(smol):
    for template, why in (("{{ messages.append(1) }}", "SecurityError"),
                          ("{% set ns = namespace(_x=1) %}", "underscore"),
                          ("{{ dict.__class__.__subclasses__() }}", "unsafe")):
        with pytest.raises(ChatTemplateError, match=why):
            with_template(smol, template).render_chat(ONE)
    ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    assert with_template(smol, ns + "{{ ns.n }}{{ dict(a=1) }}").render_chat(CONVERSATION) == "3{'a': 1}"


def test_other_named_specials_reach_the_template(tok):
    config = {**CONFIG, "sep_token": "<|endoftext|>", "image_token": "<|im_start|>",
              "extra_special_tokens": {"video_token": "<|im_end|>"},
              "chat_template": "{{ sep_token }}{{ image_token }}{{ video_token }}"}
    assert from_parts(tok, config).render_chat(ONE) == "<|endoftext|><|im_start|><|im_end|>"


@pytest.mark.parametrize("messages, where", [
    ("hello", "list of dicts"),
    ([], "empty"),
    ([["user", "hi"]], r"messages\[0\] is a list"),
    ([{"content": "hi"}], r"messages\[0\] has role None"),
    ([{"role": "user"}], "no 'content'"),
    ([{"role": "user", "content": 3}], "content of type int"),
    ([{"role": "user", "content": [{"text": "hi"}]}], r"content\[0\]"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "without a string 'text'"),
])
def test_bad_messages_say_what_and_where(smol, messages, where):
    with pytest.raises(ValueError, match=where):
        smol.render_chat(messages)


def test_content_parts_pass_through(smol):
    t = with_template(smol, "{% for p in messages[0]['content'] %}{{ p['text'] }}{% endfor %}")
    assert t.render_chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}]) == "ab"


def test_chat_without_template_or_with_bad_arguments_fails(smol):
    with pytest.raises(ValueError, match="no chat template"):
        replace(smol, chat_template=None).render_chat(CONVERSATION)
    with pytest.raises(ValueError, match="JSON schema"):
        smol.render_chat(CONVERSATION, tools=[print])
    with pytest.raises(ValueError, match="continue_final_message"):
        smol.render_chat(CONVERSATION, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        with_template(smol, "{% for m in messages %}").render_chat(CONVERSATION)


def test_added_token_dicts_and_template_lists(tok):
    config = {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                            "normalized": False, "rstrip": False, "single_word": False},
              "unk_token": {"content": "<|endoftext|>"},
              "chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": CHATML}]}
    t = from_parts(tok, config)
    assert (t.eos_token, t.unk_token, t.bos_token, t.pad_token) == ("<|im_end|>", "<|endoftext|>",
                                                                    None, None)
    assert t.eos_id == tok.token_to_id("<|im_end|>") and t.pad_id is None and t.bos_id is None
    assert t.chat_template == CHATML
    with pytest.raises(CheckpointError, match=r"tokenizer_config\['eos_token'\]"):
        from_parts(tok, {"eos_token": 7})
    with pytest.raises(CheckpointError, match="none is named 'default'"):
        from_parts(tok, {"chat_template": [{"name": "tool_use", "template": "T"}]})


def test_stop_ids_take_generation_configs_eos_list(tok):
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert from_parts(tok, CONFIG).stop_ids == (im_end,)
    assert from_parts(tok, CONFIG, {"eos_token_id": [eot, im_end]}).stop_ids == (im_end, eot)
    assert from_parts(tok, CONFIG, {"eos_token_id": eot}).stop_ids == (im_end, eot)
    with pytest.raises(CheckpointError, match="eos_token_id"):
        from_parts(tok, CONFIG, {"eos_token_id": "2"})


def test_bos_follows_the_post_processor_not_the_config(tok):
    # transformers 5 drops tokenizer_config's add_bos_token when tokenizer.json exists.
    assert not from_parts(tok, {**CONFIG, "bos_token": "<|endoftext|>", "add_bos_token": True}).add_bos_token
    with_bos = hf.Tokenizer.from_str(tok.to_str())
    eot = tok.token_to_id("<|endoftext|>")
    with_bos.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B:1", special_tokens=[("<|endoftext|>", eot)])
    t = from_parts(with_bos, {**CONFIG, "bos_token": "<|endoftext|>", "add_bos_token": False})
    assert (t.add_bos_token, t.add_eos_token) == (True, False)
    assert t.encode("Hello") == [eot] + t.encode("Hello", add_special_tokens=False)
    assert t.encode("Hello") == with_bos.encode("Hello").ids  # what tokenizer(text) gives
    with pytest.raises(CheckpointError, match="post-processor"):
        from_parts(with_bos, CONFIG)  # it adds a token that is not this config's bos


def test_missing_specials_are_added_and_tokenizer_left_alone(tok):
    before = tok.get_vocab_size(with_added_tokens=True)
    t = from_parts(tok, {**CONFIG, "unk_token": "<unk>", "extra_special_tokens": ["<tool>"]})
    assert t.vocab_size == before + 2 and t.tok.token_to_id("<unk>") == before
    assert tok.token_to_id("<unk>") is None
    assert t.encode("a<unk>b<tool>", add_special_tokens=False)[1::2] == [before, before + 1]
    assert t.decode(t.encode("a<tool>b")) == "ab"  # special, so skipped on decode


def test_save_load_round_trip_in_v5_layout(tmp_path, tok):
    eot = tok.token_to_id("<|endoftext|>")
    t = from_parts(tok, {**CONFIG, "bos_token": "<|endoftext|>"}, {"eos_token_id": [eot]})
    t = replace(t, add_bos_token=True)  # only tokenizer.json can carry this to transformers
    save_tokenizer(t, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and "add_bos_token" not in config
    assert (tmp_path / "chat_template.jinja").read_text() == CHATML
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    back = load_tokenizer(tmp_path)
    for field in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template",
                  "add_bos_token", "add_eos_token", "stop_ids", "vocab_size"):
        assert getattr(back, field) == getattr(t, field), field
    text = "Hello <|im_start|>user\nWhat is a tokenizer?<|im_end|>"
    assert back.encode(text) == t.encode(text) == [eot] + ids_of(t, text)
    assert back.tok.encode(text).ids == t.encode(text)
    assert back.apply_chat_template(CONVERSATION) == t.apply_chat_template(CONVERSATION)


def test_load_reads_template_from_config_and_prefers_the_jinja_file(tmp_path, tok):
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    assert load_tokenizer(tmp_path).chat_template == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ 'jinja file' }}")
    assert load_tokenizer(tmp_path).render_chat(ONE) == "jinja file"
    # special_tokens_map.json (legacy) overrides the config's specials.
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert load_tokenizer(tmp_path).eos_token == "<|endoftext|>"


def test_load_failures_name_the_file(tmp_path, tok):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(CheckpointError, match="no such folder"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": 3}))
    with pytest.raises(CheckpointError, match=r"bos_token"):
        load_tokenizer(tmp_path)


def test_data_adapter(smol):
    d = smol.for_training()
    ids = d.encode("Hello<|im_end|>")
    assert (d.kind, d.vocab_size) == ("hf", smol.vocab_size) and ids.dtype == np.int32
    assert list(ids) == ids_of(smol, "Hello<|im_end|>") and d.decode(ids) == "Hello<|im_end|>"
