"""A seeded serving load for engine tests: requests arrive while others run and finish, so batch sizes,
lengths and block tables change from step to step."""

from __future__ import annotations

import torch


def run_workload(engine, seed: int, n_requests: int = 12, gap: int = 8, max_new: int = 60, max_prompt: int = 20):
    """Drive ``engine`` through ``n_requests`` seeded requests (arrival gaps < ``gap`` steps, prompts of
    1..``max_prompt - 1`` tokens, 1..``max_new - 1`` new tokens); returns (outputs by request id, steps)."""
    gen = torch.Generator().manual_seed(seed)
    at, pending = 0, []
    for _ in range(n_requests):
        at += int(torch.randint(0, gap, (1,), generator=gen))
        prompt = torch.randint(0, 1024, (int(torch.randint(1, max_prompt, (1,), generator=gen)),), generator=gen).tolist()
        pending.append((at, prompt, int(torch.randint(1, max_new, (1,), generator=gen))))
    steps = 0
    while pending or engine.waiting or engine.running:
        while pending and pending[0][0] <= steps:
            _, prompt, n = pending.pop(0)
            engine.add_request(prompt, n)
        if pending and not (engine.waiting or engine.running):
            pending[0] = (steps, *pending[0][1:])
            continue
        engine.step(keep_logits=True)
        steps += 1
    return [r.output for r in sorted(engine.finished, key=lambda r: r.id)], steps
