"""fuselm/tokenizer.py: a plain tokenizer.json is read by `tokenizers` directly, with the same ids and text
as transformers' AutoTokenizer; anything else (and --chat) goes through transformers."""

from __future__ import annotations

import json
import shutil

from fuselm.tokenizer import Detokenizer, FileTokenizer, load_tokenizer

TEXTS = ["hello world! what is the capital of france?", "  two  spaces\nand a newline", "héllo — ünïcode 你好",
         "<|im_start|>user\nhi<|im_end|>", ""]


def test_a_plain_tokenizer_json_matches_transformers(make_ckpt):
    from transformers import AutoTokenizer

    ckpt = make_ckpt("qwen3")
    ours, ref = load_tokenizer(ckpt, required=True), AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    assert isinstance(ours, FileTokenizer) and ours.eos_token_id == ref.eos_token_id is not None
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_anything_else_goes_through_transformers(make_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_ckpt("qwen3"), ckpt)
    assert not isinstance(load_tokenizer(ckpt, required=True, chat=True), FileTokenizer)
    config = ckpt / "tokenizer_config.json"
    for change in ({"add_bos_token": True}, {"clean_up_tokenization_spaces": True}, {"tokenizer_class": "LlamaTokenizer"}):
        data = json.loads(config.read_text())
        config.write_text(json.dumps({**data, **change}))
        assert not isinstance(load_tokenizer(ckpt, required=False), FileTokenizer), change
        config.write_text(json.dumps(data))
    assert isinstance(load_tokenizer(ckpt, required=True), FileTokenizer)


def test_the_streamed_text_is_the_whole_decode(make_ckpt):
    """Detokenizer decodes a window per token: the pieces it streams join to the decode of all the ids, UTF-8
    sequences split over several byte tokens included (held back until complete); special tokens show nothing."""
    import numpy as np

    tok = load_tokenizer(make_ckpt("qwen3"), required=True)
    rng = np.random.default_rng(0)
    for ids in [tok.encode(t) for t in TEXTS] + [[int(i) for i in rng.integers(0, 300, 64)]]:
        detok = Detokenizer(tok)
        streamed = "".join(detok.add(i) for i in ids)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(streamed) and whole[len(streamed):] in ("", "\ufffd" * (len(whole) - len(streamed))), ids


def test_the_stream_keeps_the_spaces_of_a_sentencepiece_decode():
    """A Metaspace decoder (Llama, Mistral, Gemma: sentencepiece) drops the space of the first word it decodes;
    the window keeps context tokens before the new one, so the words of the stream stay apart."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    ids = tok.encode("what is the capital of france? hello world").ids
    detok = Detokenizer(tok)
    assert "".join(detok.add(i) for i in ids) == tok.decode(ids) == "what is the capital of france? hello world"
