"""Importing the ops keys torch's compile caches by their sources (``torch.compiler.config.cache_key_tag``), so a graph
cached by one version of the ops never serves another whose schemas differ."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import mla_compile  # noqa: F401  (imports the ops: the tag is set)
from mla_compile.ops._cache_tag import PREFIX, ops_digest, tag_compile_caches, tagged


def test_importing_the_ops_tags_the_compile_caches_with_their_digest():
    tag = torch.compiler.config.cache_key_tag
    assert PREFIX + ops_digest() in tag.split("|")
    assert tag_compile_caches() == tag  # again: the same tag, our part not repeated


def test_a_user_tag_is_kept_and_our_earlier_part_replaced():
    assert tagged("", "abc") == PREFIX + "abc"
    assert tagged("mine", "abc") == "mine|" + PREFIX + "abc"
    assert tagged(f"mine|{PREFIX}old|theirs", "new") == f"mine|theirs|{PREFIX}new"


def test_the_digest_follows_every_source_byte_and_name(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f(x: int) -> int: ...\n")
    b.write_text("X = 1\n")
    first = ops_digest([a, b])
    assert ops_digest([a, b]) == first and len(first) == 16
    a.write_text("def f(x: int, y: int = 0) -> int: ...\n")  # a schema grows an argument
    assert ops_digest([a, b]) != first
    a.write_text("def f(x: int) -> int: ...\n")
    c = tmp_path / "c.py"
    b.rename(c)
    assert ops_digest([a, c]) != first


def test_another_tag_misses_the_fx_graph_cache():
    """The tag is part of Inductor's FX graph cache key: the same graph compiled again hits the cache, and misses it
    under another ops digest (configs changed through their own ``patch``, which restores them)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import fresh_cache

    def f(x):
        return (x * 3).sin() + 1

    def compile_once():
        torch._dynamo.reset()
        torch.compile(f, backend="inductor")(torch.randn(8))

    with fresh_cache(), inductor_config.patch(fx_graph_cache=True):
        counters.clear()
        compile_once()
        compile_once()
        assert counters["inductor"]["fxgraph_cache_miss"] == 1 and counters["inductor"]["fxgraph_cache_hit"] == 1
        with torch.compiler.config.patch(cache_key_tag=tagged(torch.compiler.config.cache_key_tag, "0" * 16)):
            compile_once()
        assert counters["inductor"]["fxgraph_cache_miss"] == 2
    torch._dynamo.reset()
