"""``mla-compile generate`` on a tiny checkpoint directory: the checkpoint's own tokenizer, streamed text, the
same tokens as greedy generation with the loaded model, --chat, --kv-cache fp8, --compile, and errors."""

from __future__ import annotations

import io

import pytest
import torch

from mla_compile import from_pretrained
from mla_compile.app.cli import main
from mla_compile.serving.generate import greedy_generate
from mla_compile.app.textgen import generate_text, load_tokenizer
from tests.checkpoints import write_checkpoint

pytest.importorskip("transformers")
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("v3-fp8")
    write_checkpoint(root, "v3", "fp8", seed=3)
    return root


def _greedy(root, ids, n):
    model = from_pretrained(root, dtype=torch.float32)
    model.allocate_cache(8, 16)
    return greedy_generate(model, [ids], n, block_size=16, num_blocks=8).tokens[0]


def test_generate_streams_the_greedy_tokens_as_text(ckpt):
    stream = io.StringIO()
    res = generate_text(ckpt, PROMPT, max_new_tokens=6, dtype=torch.float32, compile=False, stream=stream)
    tok = load_tokenizer(ckpt)
    assert res.prompt_ids == tok.encode(PROMPT)
    want = _greedy(ckpt, res.prompt_ids, 6)
    eos = tok.eos_token_id
    assert res.tokens == (want[:want.index(eos)] if eos in want else want)
    assert res.text == tok.decode(res.tokens, skip_special_tokens=True)
    assert stream.getvalue() == res.text + "\n"
    assert res.tokens_per_s > 0


def test_cli_generate_no_compile_chat_and_fp8_cache(ckpt, capsys):
    argv = ["generate", "--model", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "4", "--no-compile"]
    assert main(argv + ["--chat", "--kv-cache", "fp8"]) == 0
    out, err = capsys.readouterr()
    assert "tokens/s" in err and out.endswith("\n")
    tok = load_tokenizer(ckpt)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                       tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert f"prompt {len(chat_ids)} tokens" in err


def test_cli_generate_compiled_matches_eager(ckpt, capsys):
    """Compiled regionally (the default) and as one whole graph (``--no-regional-compile``): the eager text."""
    argv = ["generate", "--model", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "4", "--dtype", "float32"]
    assert main(argv + ["--no-compile"]) == 0
    eager = capsys.readouterr().out
    assert main(argv + ["--compile"]) == 0
    assert capsys.readouterr().out == eager
    assert main(argv + ["--compile", "--no-regional-compile"]) == 0
    assert capsys.readouterr().out == eager


def test_from_pretrained_regional_compile_reaches_the_model(ckpt, monkeypatch):
    """``from_pretrained(regional_compile=...)`` sets the loaded model's flag (off by default); ``generate_text``
    asks for it only when it compiles."""
    import mla_compile.models.loader as loader

    assert from_pretrained(ckpt, dtype=torch.float32, regional_compile=True).regional_compile
    assert not from_pretrained(ckpt, dtype=torch.float32).regional_compile
    asked = []
    real = loader.from_pretrained
    monkeypatch.setattr(loader, "from_pretrained", lambda *a, **kw: asked.append(kw["regional_compile"]) or real(*a, **kw))
    generate_text(ckpt, PROMPT, max_new_tokens=1, dtype=torch.float32, compile=False, stream=None)
    assert asked == [False]


def test_cli_generate_broken_checkpoint_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--no-compile"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_generate_samples_with_a_seed_reproducibly_and_top_k_1_is_greedy(ckpt):
    """Sampling through the engine: the same seed gives the same tokens (the request's own stream), the draw at
    temperature 1 is the sampler's on the model's logits (float64 check of the first token), and top-k 1 keeps
    only the argmax, so it equals greedy generation."""
    from mla_compile.serving.sampling import SamplingParams, sample_rows

    kw = dict(max_new_tokens=8, dtype=torch.float32, compile=False, stream=None)
    a = generate_text(ckpt, PROMPT, temperature=1.0, seed=11, **kw)
    b = generate_text(ckpt, PROMPT, temperature=1.0, seed=11, **kw)
    assert a.tokens == b.tokens and len(a.tokens) >= 1
    model = from_pretrained(ckpt, dtype=torch.float32)
    model.allocate_cache(8, 16)
    first = greedy_generate(model, [a.prompt_ids], 1, block_size=16, num_blocks=8, keep_logits=True).step_logits[0]
    want = sample_rows(first.double(), [SamplingParams(temperature=1.0, seed=11)], [0])
    assert a.tokens[0] == int(want[0])
    greedy = generate_text(ckpt, PROMPT, **kw)
    assert generate_text(ckpt, PROMPT, temperature=1.0, top_k=1, seed=3, **kw).tokens == greedy.tokens
