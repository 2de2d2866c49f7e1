"""The checkpoint's tokenizer, as `fuselm run` and `validate` use it: load, encode the prompt, stream the text.

A directory whose tokenizer.json says all there is to say (its tokenizer_config.json adds no BOS/EOS, no
space clean-up and names a plain fast-tokenizer class, as Qwen's do) is read by the `tokenizers` library
directly: the same encode and decode as transformers' fast tokenizer on that file, without importing
transformers and torch (most of a fresh process's time to its first token on onnxruntime,
bench/first_token.py). Anything else, and --chat (the chat template renders in transformers' sandbox),
goes through transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import FuselmError

FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# tokenizer_config.json classes that are transformers' fast tokenizer over tokenizer.json and nothing more
PLAIN_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast")


class FileTokenizer:
    """tokenizer.json through `tokenizers`: the part of transformers' tokenizer interface fuselm uses."""

    chat_template = None  # --chat loads transformers' tokenizer instead

    def __init__(self, directory: Path, config: dict):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self.backend.token_to_id(eos) if isinstance(eos, str) else None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def plain_config(directory: Path) -> dict | None:
    """tokenizer_config.json when tokenizer.json alone encodes and decodes as transformers does, else None."""
    if not (directory / "tokenizer.json").is_file():
        return None
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text()) \
            if (directory / "tokenizer_config.json").is_file() else {}
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_CLASSES or "auto_map" in config:
        return None
    if any(config.get(k) for k in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces")):
        return None
    return config


def load_tokenizer(model_dir: Path, required: bool, chat: bool = False):
    """The checkpoint's tokenizer, copied into the model directory by convert/optimize (offline): a
    FileTokenizer where tokenizer.json suffices (and not `chat`), else transformers' AutoTokenizer."""
    directory = model_dir if model_dir.is_dir() else model_dir.parent
    if not any((directory / f).is_file() for f in FILES):
        if required:
            raise FuselmError(f"{directory} has no tokenizer files; pass --prompt-ids, or use a model directory "
                              "written by `fuselm convert` (it copies the tokenizer)")
        return None
    config = None if chat else plain_config(directory)
    if config is not None:
        try:
            return FileTokenizer(directory, config)
        except Exception:  # noqa: BLE001 - a file `tokenizers` cannot read: transformers names the problem below
            pass
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False: an auto_map in tokenizer_config.json is refused, never prompted for
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for broken tokenizer files
        if required:
            raise FuselmError(f"cannot load the tokenizer in {directory} ({type(e).__name__}: {e}); "
                              "pass --prompt-ids instead") from None
        return None


def vocabulary(model_dir: Path) -> list[str | None] | None:
    """The directory's tokens by id (None for an id it leaves out), None where it has no tokenizer it can read:
    tokenizer.json through `tokenizers`, else transformers' tokenizer."""
    if (model_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            by_token = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
        except Exception:  # noqa: BLE001 - a file `tokenizers` cannot read: transformers' reading below
            by_token = None
        if by_token is not None:
            tokens: list[str | None] = [None] * (max(by_token.values(), default=-1) + 1)
            for token, i in by_token.items():
                tokens[i] = token
            return tokens
    tok = load_tokenizer(model_dir, required=False)
    if tok is None or not hasattr(tok, "convert_ids_to_tokens"):
        return None
    return list(tok.convert_ids_to_tokens(list(range(len(tok)))))


def eos_ids(model_dir: Path, meta: dict, tok) -> set[int]:
    """Every eos id the checkpoint names: generation_config.json, fuselm.json, the tokenizer."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(i) for i in v if isinstance(i, int))

    directory = model_dir if model_dir.is_dir() else model_dir.parent
    gen = directory / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (ValueError, RecursionError, AttributeError):  # broken, deeply nested or not an object: as HF, ignore
            pass
    add((meta.get("special_tokens") or {}).get("eos_token_id"))
    if tok is not None:
        add(tok.eos_token_id)
        add(end_of_turn_id(tok))
    return ids


def end_of_turn_id(tok) -> int | None:
    """The special token the chat template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>): the first token after the reply in a rendered turn, when it is special."""
    if not getattr(tok, "chat_template", None):
        return None
    mark = "fuselm-reply-mark"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": mark}],
                                       tokenize=False)
        after = text.split(mark, 1)[1].lstrip(" ")
        ids = tok.encode(after, add_special_tokens=False) if after else []
    except Exception:  # noqa: BLE001 - a template that refuses this turn (or fails in the sandbox) names no token
        return None
    return int(ids[0]) if ids and ids[0] in set(getattr(tok, "all_special_ids", ())) else None


def encode_prompt(tok, prompt: str | list[int] | None, chat: bool) -> list[int]:
    """The prompt's token ids: `prompt` is text (encoded, through the chat template with `chat`) or the ids."""
    if prompt is not None and not isinstance(prompt, str):
        if chat:
            raise FuselmError("--chat applies the chat template to --prompt text; it cannot be used with --prompt-ids")
        try:
            return [int(i) for i in prompt]
        except (TypeError, ValueError):
            raise FuselmError(f"the prompt must be text or a list of token ids, got {type(prompt).__name__}") from None
    if prompt is None:
        raise FuselmError("pass --prompt TEXT or --prompt-ids 1,2,3")
    if chat:
        if not getattr(tok, "chat_template", None):
            raise FuselmError("this checkpoint has no chat template; run without --chat")
        try:  # transformers renders it in jinja2's ImmutableSandboxedEnvironment; it refuses unsafe templates
            out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
        except Exception as e:  # noqa: BLE001 - SecurityError, TemplateError, and whatever a template raises
            raise FuselmError(f"the checkpoint's chat template failed ({type(e).__name__}: {str(e)[:200]}); it is "
                              "broken or tried something the sandbox forbids. Run without --chat") from None
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tok.encode(prompt)]


class Detokenizer:
    """The text each new token adds; holds back an incomplete UTF-8 sequence; special tokens (an eos, the chat
    template's end of turn) add nothing. Without a tokenizer, the ids.

    Decodes a window (the tokens since the last text shown, plus the few before them for context: a
    sentencepiece tokenizer drops a word's leading space when the word starts a decode), not the whole
    output, so a token costs the same at the 10th and the 10,000th (the incremental decode of
    text-generation-inference and vLLM)."""

    CONTEXT = 4  # tokens kept before the ones not yet shown

    def __init__(self, tok):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0

    def add(self, token: int) -> str:
        if self.tok is None:
            return f"{token} "
        self.ids.append(token)
        shown = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if text.endswith("\ufffd") or text == shown:
            return ""
        new = text[len(shown):] if text.startswith(shown) else text
        self.prefix, self.read = max(0, self.read - self.CONTEXT), len(self.ids)
        return new
