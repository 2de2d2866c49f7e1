"""fuselm/tokenizer.py: a plain tokenizer.json is read by `tokenizers` directly, with the same ids and text
as transformers' AutoTokenizer; anything else (and --chat) goes through transformers."""

from __future__ import annotations

import json
import shutil

from fuselm.tokenizer import FileTokenizer, load_tokenizer

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
