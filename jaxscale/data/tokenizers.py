"""Tokenizers: text -> token ids, plus the BOS/EOS ids the pipeline frames documents with.

`data.tokenizer` is "byte" (no file, 259 ids), a SentencePiece `.model` file or a Hugging Face
`tokenizer.json`, on a local disk or in a bucket (gs://, s3://: read once, whole); nothing is
downloaded from a hub.
"""

from __future__ import annotations

import hashlib
import os

import ml_collections
import numpy as np

from jaxscale.errors import ConfigError, json_object
from jaxscale.runtime.storage import classified, filesystem


class ByteTokenizer:
    """Every byte is a token: nothing to download, nothing unknown, 259 ids in all.

    Ids 0-2 are reserved so that padding (0) is never a real token.
    """

    name = "byte"
    pad_id = 0
    bos_id = 1
    eos_id = 2
    _offset = 3
    vocab_size = 256 + _offset

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + self._offset

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, starts, ends): the ids of `text` and the [start, end) character offsets of each
        in it; the bytes of one character all point at that character."""
        ids = self.encode(text)
        # Every byte but a UTF-8 continuation byte (0b10xxxxxx) starts a character.
        chars = np.cumsum((ids - self._offset) & 0xC0 != 0x80) - 1
        return ids, chars, chars + 1

    def decode(self, ids: np.ndarray) -> str:
        """Text of the byte ids (special ids dropped); a byte sequence that is not UTF-8, such as
        a character cut off by the end of a sample, becomes U+FFFD."""
        ids = np.asarray(ids)
        data = (ids[ids >= self._offset] - self._offset).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


def _as_text(text: str | bytes) -> str:
    # Learned tokenizers work on Unicode; a stray invalid byte should not cost the document.
    return text if isinstance(text, str) else text.decode("utf-8", errors="replace")


def _content_name(kind: str, content: bytes) -> str:
    """Names a tokenizer by its content, so token files can tell whether they match it."""
    return f"{kind}:{hashlib.sha256(content).hexdigest()[:16]}"


class SentencePieceTokenizer:
    def __init__(self, content: bytes, bos_token: str, eos_token: str):
        import sentencepiece  # optional dependency, only for this tokenizer

        self._model = sentencepiece.SentencePieceProcessor(model_proto=content)
        self.name = _content_name("sentencepiece", content)
        self.vocab_size = self._model.get_piece_size()
        self.bos_id = self._special(bos_token, self._model.bos_id(), "bos_token")
        self.eos_id = self._special(eos_token, self._model.eos_id(), "eos_token")

    def _special(self, token: str, default: int, key: str) -> int:
        if not token:
            return default
        token_id = self._model.piece_to_id(token)
        if token_id == self._model.unk_id() and token != self._model.id_to_piece(token_id):
            raise ConfigError(f"data.{key}={token!r} is not in the SentencePiece vocabulary; "
                              "use one of its pieces or '' for the model's own")
        return token_id

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self._model.encode(_as_text(text)), dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return self._model.decode(np.asarray(ids).tolist())


class HuggingFaceTokenizer:
    def __init__(self, content: bytes, bos_token: str, eos_token: str):
        import tokenizers  # optional dependency, only for this tokenizer

        self._tokenizer = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
        self.name = _content_name("huggingface", content)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        # tokenizer.json does not say which tokens are BOS/EOS; -1 = not given (checked when used).
        self.bos_id = self._special(bos_token, "bos_token")
        self.eos_id = self._special(eos_token, "eos_token")

    def _special(self, token: str, key: str) -> int:
        if not token:
            return -1
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"data.{key}={token!r} is not in the tokenizer's vocabulary; "
                              "name one of its special tokens, e.g. '<s>' or '</s>'")
        return token_id

    def encode(self, text: str | bytes) -> np.ndarray:
        encoding = self._tokenizer.encode(_as_text(text), add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, starts, ends): the ids of `text` and the [start, end) character offsets of each
        in it."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), offsets[:, 0], offsets[:, 1]

    def decode(self, ids: np.ndarray) -> str:
        return self._tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer


def tokenizer_from_config(config: ml_collections.ConfigDict) -> Tokenizer:
    """The tokenizer `config.data` names, with its BOS/EOS checked against add_bos/add_eos."""
    d = config.data
    if d.tokenizer == "byte":
        tokenizer = ByteTokenizer()
    else:
        path = os.path.expanduser(d.tokenizer)
        if not path.endswith((".model", ".json")):
            raise ConfigError(f"data.tokenizer={d.tokenizer!r}: unknown kind; a SentencePiece "
                              "model ends in .model, a Hugging Face tokenizer in .json")
        content = _tokenizer_file(path, d.tokenizer)
        if path.endswith(".model"):
            tokenizer = _load(SentencePieceTokenizer, content, d, "sentencepiece")
        else:
            tokenizer = _load(HuggingFaceTokenizer, content, d, "tokenizers")
    for wanted, key in ((d.add_bos, "bos"), (d.add_eos, "eos")):
        if wanted and getattr(tokenizer, f"{key}_id") < 0:
            raise ConfigError(f"data.add_{key}=True but tokenizer {d.tokenizer!r} has no "
                              f"{key.upper()} token; set data.{key}_token to one of its tokens "
                              f"or data.add_{key}=False")
    return tokenizer


_KINDS = {  # package: (what the file should be, the fix)
    "sentencepiece": ("a SentencePiece model",
                      "give a .model file as SentencePieceTrainer writes it"),
    "tokenizers": ("a Hugging Face tokenizer",
                   "give a tokenizer.json as tokenizers' Tokenizer.save writes it"),
}


def _tokenizer_file(path: str, name: str) -> bytes:
    """The bytes of the tokenizer file `path` (local or in a bucket)."""
    fs, inner = filesystem(path, "data.tokenizer")
    with classified(f"cannot read data.tokenizer={name!r}", "make it readable"):
        try:
            return fs.cat_file(inner)
        except (FileNotFoundError, IsADirectoryError):
            raise ConfigError(f"data.tokenizer={name!r}: no such file; give 'byte', a "
                              "SentencePiece .model or a Hugging Face tokenizer.json") from None


def _load(kind, content: bytes, data: ml_collections.ConfigDict, package: str) -> Tokenizer:
    try:
        if package == "tokenizers":
            _check_json(content, data.tokenizer)
        return kind(content, data.bos_token, data.eos_token)
    except ImportError:
        raise ConfigError(f"data.tokenizer={data.tokenizer!r} needs the {package} package; "
                          "pip install 'jaxscale[data]'") from None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the libraries raise RuntimeError, OSError or bare
        # Exception for a file they cannot parse; any of them means a bad file.
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        what, fix = _KINDS[package]
        raise ConfigError(f"data.tokenizer={data.tokenizer!r} cannot be loaded as {what}: "
                          f"{reason}; {fix}, or use 'byte'") from None


def _check_json(content: bytes, name: str) -> None:
    """A clear message for a tokenizer.json that is not a JSON object (tokenizers' own message
    reads like a Rust parser's)."""
    import json

    fix = "give a tokenizer.json as tokenizers' Tokenizer.save writes it, or use 'byte'"
    try:
        value = json.loads(content.decode("utf-8"))
    except ValueError as e:  # also UnicodeDecodeError: a binary file
        raise ConfigError(f"data.tokenizer={name!r} is not JSON ({e}); {fix}") from None
    json_object(value, f"data.tokenizer={name!r}", fix, ConfigError)


def encode_prompt(tokenizer, config: ml_collections.ConfigDict, text: str) -> np.ndarray:
    """The ids of `text` as the run framed its documents: after BOS when it added one."""
    ids = np.asarray(tokenizer.encode(text), np.int32)
    if config.data.add_bos:
        ids = np.concatenate([np.asarray([tokenizer.bos_id], np.int32), ids])
    return ids


def decode_continuation(tokenizer, config: ml_collections.ConfigDict, tokens) -> str:
    """The text of generated `tokens`, up to the first EOS when the run ended documents with one."""
    ends = np.flatnonzero(tokens == tokenizer.eos_id) if config.data.add_eos else []
    return tokenizer.decode(tokens[:ends[0]] if len(ends) else tokens)
