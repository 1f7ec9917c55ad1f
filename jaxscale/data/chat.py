"""Chat and instruction data: a conversation -> its tokens, each marked learned or not.

The records (read and checked by `formats.ChatLines`) are conversations, `{"messages": [{"role",
"content"}, ...]}`, or instruction pairs, `{"prompt", "completion"}`. The loss falls only on the
assistant's (or the completion's) tokens: a document here is a `packing.TrainedTokens`, token ids
with a per-token flag, and the pipeline turns the flag into the batch's `loss_mask`.

Rendering. A conversation becomes text through a Jinja chat template, evaluated as `transformers`'
`apply_chat_template` does (a sandboxed environment, `trim_blocks`/`lstrip_blocks`, the
`raise_exception` function, its `tojson` filter, loop controls, the template's special tokens
from `tokenizer_config.json`), so the text is the one the model will be served with. The template
is the source's `template` key: "" takes the tokenizer folder's (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`, as `transformers` loads it), or the built-in one when
there is none (the byte tokenizer has none); "builtin" the built-in one; anything else is a path
to a Jinja file. The built-in template renders each message as
`<|ROLE|>\\nCONTENT<|end|>\\n`, and ends a prompt for generation with `<|assistant|>\\n`.
`strftime_now` is left out on purpose: a batch must be a function of the config and the step,
not of the day it was made (Llama 3.1's template then falls back to its fixed date).

Finding the assistant's tokens. The whole conversation is rendered once and tokenized once, so
its ids are exactly `apply_chat_template`'s. Assistant message k's characters run from the end of
the rendering of messages[:k] with `add_generation_prompt=True` (the conversation so far and the
assistant's header) to the end of the rendering of messages[:k+1]: its content and whatever the
template closes the turn with (Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>\\n`), so the model
learns to end its turn. This needs no markers in the template; it needs every such rendering to
be a prefix of the whole, as it is for templates that render messages one after another. A
conversation for which one is not (a template that rewrites earlier turns) is a bad record, as
is one whose template raises. A token is learned when any of its characters is an assistant's,
as in `transformers`' `return_assistant_tokens_mask`; `{% generation %}` blocks (the markers
that option reads) render as their content. Instruction pairs need no template: the prompt and
the completion are tokenized separately and joined, and the completion's tokens are learned.

Framing. `data.add_bos`/`data.add_eos` frame a conversation as they frame any document, without
doubling what the template renders itself (Llama 3 renders `{{ bos_token }}` first: no second
BOS). An added EOS is learned when the token before it is, so the model learns to stop after a
reply but not after a prompt.

Too long. A framed document with more than `train.seq_len` next-token pairs (more than
`seq_len + 1` tokens) would not fit a row whole; it is skipped and counted in
`data_skipped_records` (see `sources._Documents`), never cut: a cut conversation trains on a
reply without its end, or a prompt without its reply.
"""

from __future__ import annotations

import json
import os

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import ml_collections
import numpy as np

from jaxscale.data.formats import MalformedRecord
from jaxscale.data.packing import TrainedTokens
from jaxscale.errors import ConfigError, json_object

BUILTIN = "builtin"
BUILTIN_TEMPLATE = ("{% for message in messages %}<|{{ message.role }}|>\n"
                    "{{ message.content }}<|end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# The special tokens `transformers` passes to a template (its special_tokens_map).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# What evaluating a template can raise: Jinja's own errors (raise_exception, an undefined value,
# the sandbox) and the Python errors of the operations it runs on the record's values.
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its content: the markers HF templates
    put around assistant turns for `return_assistant_tokens_mask` (found here without them)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: Jinja's own escapes HTML characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def template_text(spec: dict, tokenizer: str) -> tuple[str, dict[str, str], str]:
    """(the Jinja source of `spec`'s chat template, the special tokens it is rendered with, where
    it comes from) for a chat source `spec` and the `data.tokenizer` setting; ConfigError when
    the template named cannot be read."""
    where = f"{spec['name']}.template"
    choice = spec["template"]
    if choice == BUILTIN:
        return BUILTIN_TEMPLATE, {}, "the built-in template"
    if choice:
        return _read(os.path.expanduser(choice), where, choice), {}, repr(choice)
    if tokenizer == "byte" or not tokenizer.endswith(".json"):
        return BUILTIN_TEMPLATE, {}, "the built-in template"
    folder = os.path.dirname(os.path.expanduser(tokenizer))
    config_path = os.path.join(folder, "tokenizer_config.json")
    tokenizer_config = {}
    if os.path.isfile(config_path):
        fix = f"fix it, or set {where} to a Jinja file or {BUILTIN!r}"
        try:
            with open(config_path, encoding="utf-8") as f:
                tokenizer_config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config_path!r} (beside data.tokenizer) cannot be read as JSON "
                              f"({e}); {fix}") from None
        json_object(tokenizer_config, f"{config_path!r} (beside data.tokenizer)", fix,
                    ConfigError)
    special = {}
    for key in _SPECIAL_TOKENS:
        token = tokenizer_config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[key] = token
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):  # transformers saves it there, and prefers it
        return _read(jinja_path, where, jinja_path), special, repr(jinja_path)
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(template, str) and template:
        return template, special, f"{config_path!r}'s chat_template"
    return BUILTIN_TEMPLATE, {}, "the built-in template"


def _read(path: str, where: str, value: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}={value!r} cannot be read ({e}); give a Jinja chat template "
                          f"file, {BUILTIN!r}, or '' for the tokenizer folder's") from None


def compile_template(spec: dict, tokenizer: str) -> tuple[jinja2.Template, dict[str, str]]:
    """`spec`'s chat template compiled, with its special tokens; ConfigError naming the line of
    a template that is not valid Jinja."""
    source, special, origin = template_text(spec, tokenizer)
    try:
        return _environment().from_string(source), special
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{spec['name']}: chat template {origin} is not valid Jinja (line "
                          f"{e.lineno}: {e.message}); fix it, or set {spec['name']}.template to "
                          f"another Jinja file or {BUILTIN!r}") from None


class ChatEncoder:
    """A `ChatLines` record -> its framed `TrainedTokens`; MalformedRecord for a conversation its
    template cannot render or locate turns in, and (kind "long") for one longer than a row."""

    def __init__(self, spec: dict, tokenizer, config: ml_collections.ConfigDict):
        if not hasattr(tokenizer, "encode_with_offsets"):
            raise ConfigError(f"{spec['name']} (chat) needs the byte tokenizer or a Hugging Face "
                              f"tokenizer.json, not {config.data.tokenizer!r}: finding the "
                              "assistant's tokens needs each token's place in the text")
        self._tokenizer = tokenizer
        self._template, self._special = compile_template(spec, config.data.tokenizer)
        self._bos = tokenizer.bos_id if config.data.add_bos else None
        self._eos = tokenizer.eos_id if config.data.add_eos else None
        self._seq_len = config.train.seq_len

    def __call__(self, record: dict) -> TrainedTokens:
        if "messages" in record:
            ids, learned = self._conversation(record["messages"])
        else:
            prompt = self._tokenizer.encode(record["prompt"])
            completion = self._tokenizer.encode(record["completion"])
            ids = np.concatenate([prompt, completion]).astype(np.int32)
            learned = np.arange(len(ids)) >= len(prompt)
        document = self._framed(ids, learned)
        if len(document.tokens) - 1 > self._seq_len:
            raise MalformedRecord(f"a document of {len(document.tokens)} tokens does not fit a "
                                  f"row of train.seq_len={self._seq_len} (+1)", "long")
        return document

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of `messages`; MalformedRecord when the template raises."""
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special)
        except _TEMPLATE_ERRORS as e:
            raise MalformedRecord(f"the chat template failed: {type(e).__name__}: {e}",
                                  "template") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the text of `messages`, the [start, end) characters of each assistant turn in it)."""
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[:k + 1])
            if not (text.startswith(before) and text.startswith(through)):
                raise MalformedRecord(
                    f"the chat template renders the conversation up to message {k} otherwise "
                    "than the start of the whole, so its assistant turn cannot be located; use "
                    "a template that renders messages in order", "template")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return text, spans

    def _conversation(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        text, spans = self.assistant_spans(messages)
        ids, starts, ends = self._tokenizer.encode_with_offsets(text)
        inside = np.zeros(len(text) + 1, np.int64)
        for start, end in spans:
            inside[start] += 1
            inside[end] -= 1
        # learned_before[i]: how many of the first i characters are an assistant's.
        learned_before = np.concatenate([[0], np.cumsum(np.cumsum(inside)[:-1] > 0)])
        ends = np.minimum(np.maximum(ends, starts + 1), len(text))  # an empty token: its start
        return ids, learned_before[ends] > learned_before[starts]

    def _framed(self, ids: np.ndarray, learned: np.ndarray) -> TrainedTokens:
        ids, learned = list(ids), list(learned)
        if self._bos is not None and ids[:1] != [self._bos]:
            ids, learned = [self._bos] + ids, [False] + learned
        if self._eos is not None and ids[-1:] != [self._eos]:
            ids, learned = ids + [self._eos], learned + [bool(learned and learned[-1])]
        return TrainedTokens(np.asarray(ids, np.int32), np.asarray(learned, bool))
