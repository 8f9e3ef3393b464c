"""Tokenization as the model does it, incremental detokenization, stop strings and the checks
of request bodies: no servers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvsp_moq.gateway.errors import ApiError
from kvsp_moq.gateway.requests import Sampling, parse_chat, parse_completion
from kvsp_moq.gateway.text import ModelText, StopScan


def test_stop_strings_are_cut_and_held_back_across_pieces() -> None:
    scan = StopScan(["END", "\n\n"])
    assert scan.push("one E") == "one "  # "E" may start "END": held back
    assert scan.push("x two EN") == "Ex two "
    assert scan.push("D three") == "" and scan.stopped
    assert scan.flush() == "" and scan.text[:scan.sent] == "one Ex two "
    plain = StopScan([])
    assert plain.push("a") == "a" and plain.push("b") == "b" and plain.flush() == ""
    tail = StopScan(["xyz"])
    assert tail.push("abx") == "ab" and tail.flush() == "x"


def _byte_level_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "héllo wörld ünïcode", "日本語のテキスト"] * 5,
                            trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_incremental_text_is_the_whole_text_even_inside_a_character(tmp_path: Path) -> None:
    text = ModelText(_byte_level_dir(tmp_path))
    prompt = text.encode("hello", special=False)
    out = text.encode(" wörld 日本語 ünïcode", special=False)
    detok = text.detokenizer(prompt)
    pieces = [detok.add(t) for t in out]
    assert "".join(pieces) == text.decode(out)
    assert not any("\ufffd" in p for p in pieces)


def test_chat_template_the_models_own_or_the_default(model_dir: Path, tmp_path: Path) -> None:
    tiny = model_dir
    default = ModelText(tiny)
    messages = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7"}]
    assert not default.own_template
    assert default.render_chat(messages) == "system: w5 w6\nuser: w7\nassistant:"
    assert default.eos_ids == {2}

    own = tmp_path / "own"
    own.mkdir()
    shutil.copy(tiny / "tokenizer.json", own / "tokenizer.json")
    template = ("{{ bos_token }} {% for m in messages %}{% if m.role == 'tool' %}"
                "{{ raise_exception('no tools') }}{% endif %}{{ m.role }} {{ m.content }} "
                "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
    (own / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    text = ModelText(own)
    assert text.own_template
    assert text.render_chat(messages) == "<s> system w5 w6 user w7 assistant"
    assert text.chat_tokens(messages)[0] == 1  # <s>, written by the template
    with pytest.raises(ValueError, match="no tools"):
        text.render_chat([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "logprobs": 2}, "logprobs"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "a", "temperature": 3}, "temperature"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "stop": ["x"] * 5}, "stop"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "model": None}, "model"),
])
def test_completion_bodies_refused_with_their_parameter(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m", **body})
    assert e.value.status == 400 and e.value.param == param
    assert e.value.to_json()["error"]["type"] == "invalid_request_error"


def test_completion_and_chat_bodies_accepted() -> None:
    ask = parse_completion({"model": "m", "prompt": [[5, 6, 7]], "stop": "x", "seed": 3,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}})
    assert ask.prompt_tokens == (5, 6, 7) and ask.stop == ("x",) and ask.max_tokens == 16
    assert ask.include_usage and ask.sampling.sampler() == {"method": "greedy", "seed": 3}
    chat = parse_chat({"model": "m", "max_completion_tokens": 4, "top_p": 0.5,
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]})
    assert chat.messages == ({"role": "user", "content": "ab"},) and chat.max_tokens == 4
    assert chat.sampling.sampler()["params"] == {"p": 0.5, "temperature": 1.0}
    assert Sampling(0.7, seed=9).sampler() == {"method": "top-p", "seed": 9,
                                               "params": {"p": 1.0, "temperature": 0.7}}
    with pytest.raises(ApiError) as e:
        parse_chat({"model": "m", "messages": [{"role": "wizard", "content": "a"}]})
    assert e.value.param == "messages[0]"
