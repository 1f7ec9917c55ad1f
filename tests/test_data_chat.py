"""Chat data: templates render as transformers renders them; the loss falls exactly on the
assistant's (or the completion's) tokens; bad conversations are skipped and counted."""

import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.data import chat, check_data, formats, make_input, row_streams, sources
from jaxscale.data.specs import source_specs
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError
from tests.helpers import config_with, one_line_error, resumable_cli_losses

BYTE = ByteTokenizer()
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
# Meta's Llama 3 template, as its tokenizer_config.json holds it.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's format with the {% generation %} markers transformers' assistant mask reads.
LLAMA3_MARKED = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}"
                 "<|end_header_id|>\n\n{% if m.role == 'assistant' %}{% generation %}"
                 "{{ m.content | trim }}<|eot_id|>{% endgeneration %}{% else %}"
                 "{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                 "{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "I am fine."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "how are you?"},
     {"role": "assistant", "content": " Fine, élève "}, {"role": "user", "content": "système"},
     {"role": "assistant", "content": "Hello."}],
    [{"role": "user", "content": "no reply yet"}],
]


@pytest.fixture(scope="module")
def batch_sharding():
    return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))


def hf_folder(directory, template):
    """A Hugging Face tokenizer folder (a small byte-level BPE) with `template` as its chat
    template; the path of its tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([json.dumps(CONVERSATIONS)] * 10, trainer)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "chat_template": template}))
    return str(directory / "tokenizer.json")


def write_chat(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dict(format="chat", path=str(path), eval_fraction=0.01)


def chat_config(spec, **data):
    config = config_with(spec, packing="first_fit", **data)
    config.train.seq_len = 128
    return config


def encoder(config):
    spec = source_specs(config)[0]
    return chat.ChatEncoder(spec, tokenizer_from_config(config), config)


@pytest.mark.parametrize("template", [LLAMA3, CHATML])
def test_rendering_and_ids_are_transformers_apply_chat_template(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    path = hf_folder(tmp_path / "hf", template)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    config = chat_config(write_chat(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}]),
                         tokenizer=path, add_bos=False, add_eos=False)
    encode = encoder(config)
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            text = encode.render(messages, add_generation_prompt=prompt)
            assert text == reference.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=prompt)
        ids = encode({"messages": messages}).tokens
        assert ids.tolist() == reference.apply_chat_template(messages)["input_ids"]


def test_assistant_tokens_are_transformers_assistant_masks(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = hf_folder(tmp_path / "hf", LLAMA3_MARKED)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    config = chat_config(write_chat(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}]),
                         tokenizer=path, add_bos=True, add_eos=True, bos_token=SPECIAL[0],
                         eos_token="<|eot_id|>")
    encode = encoder(config)
    for messages in CONVERSATIONS:
        document = encode({"messages": messages})
        expected = reference.apply_chat_template(messages, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        # The template renders BOS itself and ends every turn with the EOS: nothing is added.
        assert document.tokens.tolist() == expected["input_ids"]
        assert document.learned.astype(int).tolist() == expected["assistant_masks"]
        assert document.learned.any() == any(m["role"] == "assistant" for m in messages)


def test_the_template_is_the_tokenizer_folders_else_the_built_in_one(tmp_path):
    spec = dict(name="data.sources[0]", template="")
    assert chat.template_text(spec, "byte")[0] == chat.BUILTIN_TEMPLATE
    folder = tmp_path / "hf"
    folder.mkdir()
    tokenizer = str(folder / "tokenizer.json")
    assert chat.template_text(spec, tokenizer)[0] == chat.BUILTIN_TEMPLATE  # no config
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "D"}]}))
    assert chat.template_text(spec, tokenizer)[:2] == ("D", {"bos_token": "<s>",
                                                             "eos_token": "</s>"})
    (folder / "chat_template.jinja").write_text("J")  # what transformers saves, and prefers
    assert chat.template_text(spec, tokenizer)[0] == "J"
    assert chat.template_text(dict(spec, template="builtin"), tokenizer)[0] == \
        chat.BUILTIN_TEMPLATE


def test_a_tokenizer_config_of_another_json_shape_is_one_config_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('["chat_template"]\n')
    spec = dict(name="data.sources[0]", template="")
    message = one_line_error(ConfigError, lambda: chat.template_text(
        spec, str(tmp_path / "tokenizer.json")))
    assert "tokenizer_config.json' (beside data.tokenizer) is a JSON array, not an object; " \
        "fix it, or set data.sources[0].template" in message


def byte_records(n):
    """`n` records, conversations and prompt/completion pairs mixed, each with unique text."""
    records = []
    for i in range(n):
        if i % 3 == 2:
            records.append({"prompt": f"Q{i}: 2+{i}=", "completion": f" {2 + i} (ré{i})"})
            continue
        messages = [{"role": "user", "content": f"question {i}?"},
                    {"role": "assistant", "content": f"answer {i}, é"}]
        if i % 3 == 1:
            messages = [{"role": "system", "content": f"sys {i}"}] + messages + [
                {"role": "user", "content": f"more {i}"},
                {"role": "assistant", "content": f"done {i}"}]
        if i % 5 == 0:
            messages.append({"role": "user", "content": f"unanswered {i}"})
        records.append({"messages": messages})
    return records


def expected_learned(record) -> tuple[bytes, np.ndarray]:
    """(the framed document's bytes, which of them are learned), found by locating each reply's
    text in the document, independently of the encoder."""
    if "prompt" in record:
        body = (record["prompt"] + record["completion"]).encode()
        learned = np.arange(len(body)) >= len(record["prompt"].encode())
        return body, np.concatenate([[False], learned, [True]])
    body = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n"
                   for m in record["messages"]).encode()
    learned = np.zeros(len(body), bool)
    for m in record["messages"]:
        if m["role"] == "assistant":
            reply = f"{m['content']}<|end|>\n".encode()
            start = body.index("<|assistant|>\n".encode() + reply) + len("<|assistant|>\n")
            learned[start:start + len(reply)] = True
    ends_with_reply = record["messages"][-1]["role"] == "assistant"
    return body, np.concatenate([[False], learned, [ends_with_reply]])


def test_batch_loss_mask_is_one_exactly_where_the_target_is_learned(tmp_path):
    records = byte_records(60)
    config = chat_config(write_chat(tmp_path / "c.jsonl", records))
    by_body = {}
    for record in records:
        body, learned = expected_learned(record)
        by_body[body] = learned
    batches = row_streams.local_batches(config, "train", range(8), sources.SkippedRecords())
    iterator = iter(batches)
    seen = 0
    for _ in range(4):
        batch = next(iterator)
        for row in range(8):
            segments = batch["segment_ids"][row]
            assert (batch["loss_mask"][row][segments == 0] == 0).all()
            for segment in np.unique(segments[segments > 0]):
                at = np.flatnonzero(segments == segment)
                assert (np.diff(at) == 1).all()  # one conversation: one run, whole
                np.testing.assert_array_equal(batch["positions"][row][at], np.arange(len(at)))
                tokens = np.concatenate([batch["inputs"][row][at[:1]], batch["targets"][row][at]])
                assert tokens[0] == BYTE.bos_id and tokens[-1] == BYTE.eos_id
                learned = by_body[(tokens[1:-1] - 3).astype(np.uint8).tobytes()]
                # Pair j predicts token j + 1: its mask is that token's.
                np.testing.assert_array_equal(batch["loss_mask"][row][at], learned[1:])
                seen += 1
    assert seen > 30


def test_a_chat_source_mixed_with_text_learns_every_text_token(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": "plain text document"}) + "\n"
                            for _ in range(50)))
    config = chat_config(write_chat(tmp_path / "c.jsonl", byte_records(30)))
    config.data.sources += (dict(format="jsonl", path=str(text), eval_fraction=0.01),)
    batch = next(iter(row_streams.local_batches(config, "train", range(8),
                                             sources.SkippedRecords())))
    plain = BYTE.encode("plain text document")
    found = 0
    for row in range(8):
        segments = batch["segment_ids"][row]
        for segment in np.unique(segments[segments > 0]):
            at = segments == segment
            if np.array_equal(batch["inputs"][row][at][1:], plain):
                assert (batch["loss_mask"][row][at] == 1).all()
                found += 1
    assert found


def test_bad_conversations_are_skipped_and_counted(tmp_path, caplog):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m.content == 'boom' %}"
                        "{{ raise_exception('no boom here') }}{% endif %}"
                        "{{ m.role }}: {{ m.content }}\n{% endfor %}")
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}]}
    bad = [{"messages": []}, {"text": "no messages"},
           {"messages": [{"role": "wizard", "content": "x"}]},
           {"messages": [{"role": "user", "content": 3}]},
           {"prompt": "p", "completion": None},
           {"messages": [{"role": "user", "content": "boom"}]},
           {"messages": [{"role": "user", "content": "x" * 500}]}]
    spec = dict(write_chat(tmp_path / "c.jsonl", [good] + bad + [good]), template=str(template))
    config = chat_config(spec, max_bad_records=len(bad) - 1)  # the long one is not malformed
    skipped = sources.SkippedRecords()
    documents = sources.source_documents(source_specs(config)[0], "train", BYTE,
                                         config, skipped)
    read = [documents[i] for i in range(len(documents))]
    assert [d is None for d in read] == [False] + [True] * len(bad) + [False]
    assert skipped.count == len(bad)
    for reason in ('"messages" is []', 'has no "messages", nor "prompt" and "completion"',
                   'role "wizard"', "content is 3, not a string", "'completion' is NoneType",
                   "the chat template failed: TemplateError: no boom here",
                   "does not fit a row of train.seq_len=128"):
        assert reason in caplog.text


def test_only_too_long_conversations_stop_the_run_at_the_first_read(tmp_path):
    """Checked when the source is opened, before the run writes anything: before, each pass
    over the file read (and tokenized) them again until max_bad_records reads had failed."""
    records = [{"messages": [{"role": "user", "content": "x" * 200},
                             {"role": "assistant", "content": "y"}]}] * 5
    config = chat_config(write_chat(tmp_path / "c.jsonl", records), max_bad_records=2)
    message = one_line_error(JaxscaleError, lambda: sources.source_documents(
        source_specs(config)[0], "train", BYTE, config))
    assert "none of the first 5 train conversations read fits a row" in message
    assert "raise train.seq_len" in message


def test_conversations_without_a_reply_to_learn_stop_the_run_at_the_first_read(tmp_path):
    """No assistant turn in the first conversations: the run would train at loss 0 (it did,
    for the whole run, on ff727fb)."""
    records = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(40)]
    config = chat_config(write_chat(tmp_path / "c.jsonl", records))
    message = one_line_error(JaxscaleError, lambda: sources.source_documents(
        source_specs(config)[0], "train", BYTE, config))
    assert message.startswith("data.sources[0] (chat ")
    assert "none of the first 32 train conversations read has a token to learn" in message


def test_a_bad_record_counts_once_however_often_it_is_read(tmp_path, caplog):
    """Every pass over a file reads its bad lines again: they count once each, so a file with
    fewer bad lines than data.max_bad_records trains to the end (on ff727fb it stopped after a
    few passes)."""
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}]}
    records = [good] * 6 + [{"messages": []}] * 3
    config = chat_config(write_chat(tmp_path / "c.jsonl", records), max_bad_records=3)
    skipped = sources.SkippedRecords()
    documents = sources.source_documents(source_specs(config)[0], "train", BYTE,
                                         config, skipped)
    for _ in range(5):  # five passes
        read = [documents[i] for i in range(len(documents))]
    assert sum(d is None for d in read) == 3
    assert skipped.count == 3
    assert caplog.text.count("skipped malformed record") == 3


def test_a_stream_whose_share_holds_nothing_to_train_on_stops_instead_of_waiting(
        tmp_path, batch_sharding):
    """Seven good conversations, then nine too long for a row, over 8 row streams: stream 7's
    share is two long ones only, so it never gets a row. It stops with an error after a pass
    over its share, instead of waiting forever (each long one counts once, so
    data.max_bad_records never ends that wait)."""
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "x" * 300},
                        {"role": "assistant", "content": "y"}]}  # too long for a row
    config = chat_config(write_chat(tmp_path / "c.jsonl", [good] * 7 + [bad] * 9),
                         eval_fraction=0.01)
    with pytest.raises(JaxscaleError, match=r"train row stream \d: \d+ documents in a row were "
                                            r"skipped .* nothing to train on"):
        take(config, batch_sharding, 4)


def test_a_template_that_rewrites_earlier_turns_is_a_bad_record(tmp_path):
    template = tmp_path / "t.jinja"  # numbers turns from the end: earlier turns change
    template.write_text("{% for m in messages %}{{ messages | length - loop.index0 }} "
                        "{{ m.content }}\n{% endfor %}")
    spec = dict(write_chat(tmp_path / "c.jsonl", byte_records(3)), template=str(template))
    encode = encoder(chat_config(spec))
    with pytest.raises(formats.MalformedRecord, match="cannot be located"):
        encode(byte_records(1)[0])


def test_config_mistakes_are_one_line_errors(tmp_path):
    spec = write_chat(tmp_path / "c.jsonl", byte_records(5))
    message = one_line_error(ConfigError, lambda: check_data(config_with(spec, packing="concat")))
    assert "data.packing='concat' cuts conversations" in message and "first_fit" in message
    check_data(config_with(spec))  # the default, 'auto', packs chat data with first_fit
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }")
    message = one_line_error(ConfigError, lambda: check_data(
        chat_config(dict(spec, template=str(broken)))))
    assert f"chat template {str(broken)!r} is not valid Jinja (line 2" in message
    message = one_line_error(ConfigError, lambda: check_data(
        chat_config(dict(spec, template=str(tmp_path / "missing.jinja")))))
    assert "template=" in message and "cannot be read" in message
    wrong = write_chat(tmp_path / "w.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}] * 3)
    message = one_line_error(JaxscaleError, lambda: sources.source_documents(
        source_specs(chat_config(wrong))[0], "train", BYTE, chat_config(wrong)))
    assert 'role "bot"' in message and 'needs "messages"' in message


def take(config, sharding, n, state=None):
    it = make_input(config, "train", sharding)
    if state is not None:
        it.set_state(state)
    batches = [jax.device_get(next(it)) for _ in range(n)]
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    return batches, state


@pytest.mark.slow  # reads the chat stream three times (about 11 s)
def test_chat_batches_are_deterministic_and_resume_mid_stream(tmp_path, batch_sharding):
    config = chat_config(write_chat(tmp_path / "c.jsonl", byte_records(40)))
    config.train.seq_len = 64
    first, _ = take(config, batch_sharding, 5)
    again, _ = take(config, batch_sharding, 5)
    for a, b in zip(first, again, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    _, state = take(config, batch_sharding, 2)
    resumed, _ = take(config, batch_sharding, 3, state)
    for a, b in zip(first[2:], resumed, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert 0 < np.mean([b["loss_mask"].mean() for b in first]) < 1


@pytest.mark.slow
def test_tiny_trains_on_chat_data(tmp_path):
    path = tmp_path / "c.jsonl"
    write_chat(path, byte_records(40))
    losses, _ = resumable_cli_losses(
        tmp_path / "run", steps=3, **{"data.packing": "first_fit", "train.seq_len": 128,
                                      "train.batch_size": 8,
                                      "data.sources": f"(dict(format='chat', path='{path}'),)"})
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses.values())
