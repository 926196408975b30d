"""bench_v4_decode's first step in bf16 on CPU, per row: ours vs HF, HF forced onto our discrete picks (--force moe,index:
the MoE top-k ids and/or the indexer's top-k entries), and each against a float32 run of the same weights and caches.
Diagnosis of issue #29 (bf16 errors grow with the batch):
    python benchmarks/diag_v4_bf16_rows.py --set experts=256,moe=256,idx_topk=128,vocab=32768 --b 16 --ctx 2048
(the flags pick the slice's dims as bench_v4_decode's FULL with overrides; float32 needs twice the weights' memory).
"""
import argparse, sys, types
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch
import bench_v4_decode as bv
from mla_compile.models import v4_model as vm
from mla_compile.models.model import patch

p = argparse.ArgumentParser()
p.add_argument("--set", default="")
p.add_argument("--b", type=int, default=16)
p.add_argument("--ctx", type=int, default=2048)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--force", default="moe,index")
o = p.parse_args()
a = dict(bv.FULL)
for kv in filter(None, o.set.split(",")):
    k, v = kv.split("="); a[k] = int(v)
a = types.SimpleNamespace(**a, seed=o.seed, backend=None)
dev = torch.device("cpu")
hf = bv.build_model(a, dev, torch.bfloat16)
model = patch(hf, backend=None)
b = o.b
ids = torch.randint(0, a.vocab, (b,), generator=torch.Generator().manual_seed(a.seed))
ctx = bv.Contexts(a, model, b, o.ctx, dev)
step = ctx.step(b, ids)
M = sys.modules[type(hf).__module__]

rec = {"route": [], "index": []}
orig_route = vm.V4MoE.route
def route(self, x, input_ids):
    w, i = orig_route(self, x, input_ids); rec["route"].append(i); return w, i
vm.V4MoE.route = route
orig_idx = vm.v4_index_topk
def idx(*args, **kw):
    out = orig_idx(*args, **kw); rec["index"].append(out); return out
vm.v4_index_topk = idx

forced = {}
orig_fwd = M.DeepseekV4TopKRouter.forward
def router_fwd(self, h):
    if self in forced:
        flat = h.reshape(-1, self.hidden_dim); logits = torch.nn.functional.linear(flat, self.weight)
        scores = self.score_fn(logits); ind = forced[self]
        w = scores.gather(1, ind); w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, ind
    return orig_fwd(self, h)
M.DeepseekV4TopKRouter.forward = router_fwd
def index_hook(mod, inp, out):
    return forced.get(mod, out)
gates = [l.mlp.gate for l in hf.model.layers]
indexers = [l.self_attn.compressor.indexer for l in hf.model.layers
            if getattr(l.self_attn, "compressor", None) is not None and hasattr(l.self_attn.compressor, "indexer")]
for ix in indexers:
    ix.register_forward_hook(index_hook)

def run_hf():
    cache = bv.hf_cache(hf, model, ctx, b)
    return hf(input_ids=ids.view(b, 1), position_ids=torch.full((b, 1), o.ctx), use_cache=True,
              **{bv.hf_cache_kw(hf): cache}).logits[:, -1].float()

def rowerr(x, r):
    return (x - r).norm(dim=-1) / r.norm(dim=-1)

with torch.no_grad():
    ours = model(*step).float()
    our_route, our_index = list(rec["route"]), list(rec["index"])
    hf_free = run_hf()
    ne = ctx.entry[a.csa].shape[1]
    base = (torch.arange(b) * ne * a.block_size).view(b, 1)
    for g, i in zip(gates, our_route):
        if isinstance(g, M.DeepseekV4TopKRouter) and "moe" in o.force:
            forced[g] = i
    for ix, s in zip(indexers, our_index):
        if "index" in o.force: forced[ix] = torch.where(s >= 0, s.long() - base, -1).view(b, 1, -1)
    hf_forced = run_hf()
    forced.clear()
    # float32 of the same weights / caches
    rec["route"].clear(); rec["index"].clear()
    hf.float()
    for attn in model.attn:
        for n in ("kv_cache", "comp_cache", "index_cache"):
            t = getattr(attn, n)
            if t is not None: setattr(attn, n, t.float())
        attn.state = {k: tuple(t.float() for t in v) for k, v in attn.state.items()}
    ours32 = model(*step).float()
    hf32 = run_hf()
    r32route, r32index = rec["route"], rec["index"]

def flips(x, y):
    return (x.sort(-1).values != y.sort(-1).values).any(-1)
e_free, e_forced = rowerr(hf_free, ours), rowerr(hf_forced, ours)
e_o32, e_h32 = rowerr(ours, ours32), rowerr(hf_free, ours32)
e_32 = rowerr(hf32, ours32)
moe_flip = torch.stack([flips(x, y) for x, y in zip(our_route, r32route)]).any(0)
print(f"B={b} ctx={o.ctx} dims {o.set}")
print("norm rel err hf-vs-ours bf16 %.2e | HF forced on our picks %.2e | fp32 hf-vs-ours %.2e" % (
    (hf_free - ours).norm() / ours.norm(), (hf_forced - ours).norm() / ours.norm(), (hf32 - ours32).norm() / ours32.norm()))
print("median row: free %.2e forced %.2e | ours-bf16 vs fp32 %.2e, hf-bf16 vs fp32 %.2e" % (
    e_free.median(), e_forced.median(), e_o32.median(), e_h32.median()))
print("norm: ours-bf16 vs fp32 %.2e, hf-bf16 vs fp32 %.2e" % ((ours - ours32).norm() / ours32.norm(), (hf_free - ours32).norm() / ours32.norm()))
for r in range(b):
    idiff = len(set(our_index[0][r].tolist()) ^ set(r32index[0][r].tolist())) // 2
    print(f" row {r:2d}: hf-ours {e_free[r]:.1e}  forced {e_forced[r]:.1e}  ours-fp32 {e_o32[r]:.1e}  hf-fp32 {e_h32[r]:.1e}"
          f"  ours bf16-vs-fp32 moe flip {int(moe_flip[r])} index picks differing {idiff}")
