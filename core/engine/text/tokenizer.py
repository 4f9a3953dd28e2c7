"""Tokenizer: ``tokenizers`` BPE built from GGUF metadata or ``tokenizer.json``, plus chat templates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from loopstack.engine.errors import ChatTemplateError, UnsupportedTokenizerError
from loopstack.engine.text.chat_templates import default_chat_template
from loopstack.engine.text.segment_cache import SegmentCache
from loopstack.engine.text.spm_tokenizer import TokenType, sentencepiece_backend

__all__ = ["IncrementalDecoder", "Tokenizer", "gguf_eos_token_ids"]

_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp names ``tokenizer.ggml.pre``, rebuilt for ``tokenizers``."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    patterns = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
    if pre in patterns:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise UnsupportedTokenizerError(
        f"GGUF pre-tokenizer {pre!r} is not supported; supported: default, gpt2, smollm, llama-bpe, qwen2"
    )


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Build it with :meth:`from_gguf_metadata` or :meth:`from_hf_directory`.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        # a rendered conversation is encoded message by message, earlier messages from memory
        self.segments = SegmentCache.for_backend(backend)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF ``tokenizer.ggml.*`` metadata: byte-level BPE (``"gpt2"``: SmolLM,
        Llama 3, Qwen) or SentencePiece BPE (``"llama"``: Gemma, Llama 2; see
        :mod:`~loopstack.engine.text.spm_tokenizer`).

        The chat template is the file's ``tokenizer.chat_template``, else the architecture's
        known format where there is one (Gemma 3: see
        :func:`~loopstack.engine.text.chat_templates.default_chat_template`).

        Raises:
            UnsupportedTokenizerError: another tokenizer model, or an unknown pre-tokenizer.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _byte_level_backend(metadata)
        elif kind == "llama":
            backend = sentencepiece_backend(metadata)
        else:
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2' and "
                "SentencePiece 'llama'); load the Hugging Face directory with tokenizer.json instead"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        bos = _optional_int(metadata.get("tokenizer.ggml.bos_token_id"))
        if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
            )
        template = metadata.get("tokenizer.chat_template")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=gguf_eos_token_ids(metadata),
            pad_token_id=_optional_int(metadata.get("tokenizer.ggml.padding_token_id")),
            chat_template=template or default_chat_template(str(metadata.get("general.architecture"))),
        )

    @classmethod
    def from_hf_directory(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``).

        ``eos_token_ids`` (e.g. from ``config.json``/``generation_config.json``) are added to
        the tokenizer's own eos token. Raises ``FileNotFoundError`` without ``tokenizer.json``.
        """
        path = Path(path)
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            content = value.get("content") if isinstance(value, dict) else value
            return None if content is None else backend.token_to_id(content)

        eos = token_id("eos_token")
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=[*(() if eos is None else (eos,)), *eos_token_ids],
            pad_token_id=token_id("pad_token"),
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are
        recognized; ``add_special_tokens`` adds the model's BOS where the model wants one
        (leave it off for rendered chat templates, which write their own)."""
        if self.segments is not None and not add_special_tokens:
            return self.segments.encode(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; incomplete UTF-8 at the end becomes U+FFFD."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def incremental_decoder(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """A streaming detokenizer continuing after ``prompt_ids`` (see :class:`IncrementalDecoder`)."""
        return IncrementalDecoder(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (and JSON-schema ``tools``) with the model's own chat template.

        Rendering follows Hugging Face: a sandboxed jinja2 environment with ``trim_blocks``,
        ``lstrip_blocks``, loop controls, ``tojson`` (no HTML escaping), ``raise_exception``
        and ``strftime_now``; ``bos_token``/``eos_token`` and ``extra`` are template variables.

        Raises:
            ChatTemplateError: the model has no template, or the template raised.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _template_environment().from_string(self.chat_template)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        variables = {
            "bos_token": "" if self.bos_token_id is None else self.id_to_token(self.bos_token_id),
            "eos_token": "" if eos is None else self.id_to_token(eos),
            **extra,
            "messages": list(messages),
            "tools": None if tools is None else list(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids of a GGUF file: its eos/eot/eom ids, and for Gemma 3 the turn-end
    token ``<end_of_turn>`` that llama.cpp's converter does not name."""
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(metadata[k]) for k in eos_keys if metadata.get(k) is not None]
    if metadata.get("general.architecture") == "gemma3":
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        ids.extend(i for i, token in enumerate(tokens) if token == "<end_of_turn>")
    return tuple(dict.fromkeys(ids))


def _byte_level_backend(metadata: Mapping[str, Any]) -> BackendTokenizer:
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # CONTROL: special, skipped on decode; USER_DEFINED: kept
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(token_types) if kind == TokenType.CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(token_types) if kind == TokenType.USER_DEFINED])
    return backend


class IncrementalDecoder:
    """Turns a stream of token ids into text, yielding only complete UTF-8 characters.

    Byte-level BPE splits multi-byte characters across tokens; a piece that ends in an
    incomplete character is held back until a later token completes it. A few tokens of
    already-emitted context are decoded along with each new one so that decoders which
    treat a leading space specially still produce the right text.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: plain json.dumps, no HTML escaping (jinja2's built-in escapes <, >, &)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _template_environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
