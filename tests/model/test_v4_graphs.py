"""DeepSeek-V4 decode through :class:`mla_compile.graphs.DecodeGraphRunner` with the V4 builder.

On CPU the runner runs the same padded steps directly (``enabled=False``): padding rows, persistent
buffers and the runner's flow are checked against HF eager. The ``cuda`` test captures the decode steps
of the compiled model in CUDA graphs and replays them (run by the GPU session).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile.graphs.cuda_graph import DecodeGraphRunner  # noqa: E402
from mla_compile.models.model import patch  # noqa: E402
from mla_compile.serving.v4_builder import V4Chunk, V4DecodeBuilder  # noqa: E402
from mla_compile.models.v4_model import V4Sequences  # noqa: E402
from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402

from test_v4_model import hf_greedy, prompts  # noqa: E402


def _run(device: str, enabled: bool, compile_backend: str | None, tol: float, regional: bool = False
         ) -> DecodeGraphRunner:
    hf = toy_v4_model(9)
    ps = prompts(9, [14, 5, 23])
    refs = [hf_greedy(hf, p, 10) for p in ps]
    model = patch(hf.to(device), regional_compile=regional)
    seqs = V4Sequences(model, 4, 48, 4, fill=float("nan"))  # block lists and caches (on the model's device)
    builder = V4DecodeBuilder(max_batch=4, max_blocks_per_seq=seqs.tables.shape[1],
                              max_entry_blocks=max(t.shape[1] for t in seqs.entry.values()), rates=model.rates,
                              block_size=4, device=device)
    step_fn = model if compile_backend is None else torch.compile(model, fullgraph=True, backend=compile_backend)
    runner = DecodeGraphRunner(step_fn, builder, capture_sizes=[2, 4], enabled=enabled)

    def chunk(s, tokens, start):
        return V4Chunk(tokens, start, seqs.tables[s].tolist(), {r: t[s].tolist() for r, t in seqs.entry.items()}, s)

    out = runner.run((), [chunk(s, p, 0) for s, p in enumerate(ps)])
    logits = [[out[i].cpu()] for i in range(len(ps))]
    lens = [len(p) for p in ps]
    for _ in range(10):  # 3 sequences: padded to the captured size 4
        out = runner.decode([chunk(s, [int(logits[s][-1].argmax())], lens[s]) for s in range(3)])
        for s in range(3):
            logits[s].append(out[s].cpu().clone())
            lens[s] += 1
    for (_, ref_logits, ref_tokens), mine in zip(refs, logits):
        assert [int(x.argmax()) for x in mine] == ref_tokens
        torch.testing.assert_close(torch.stack(mine), torch.stack(ref_logits), rtol=tol, atol=tol)
    return runner


def test_v4_padded_decode_steps_through_the_runner_match_hf():
    runner = _run("cpu", enabled=False, compile_backend=None, tol=1e-4)
    assert runner.replays == 0 and runner.fallbacks == 0


def test_v4_regional_padded_decode_steps_through_the_runner_match_hf():
    """The regional model's split layers (eager: the regions are plain calls) through the runner's padded steps."""
    runner = _run("cpu", enabled=False, compile_backend=None, tol=1e-4, regional=True)
    assert runner.replays == 0 and runner.fallbacks == 0


@pytest.mark.cuda
@pytest.mark.parametrize("regional", [False, True])
def test_v4_decode_cuda_graphs_match_hf(regional):
    """Compiled by Inductor (``regional``: each layer as two nested compile regions) and captured in CUDA graphs."""
    runner = _run("cuda", enabled=True, compile_backend="inductor", tol=1e-3, regional=regional)
    assert runner.replays == 10 and set(runner.graphs) == {2, 4}
