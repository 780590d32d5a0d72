#!/usr/bin/env python3
"""PyTorch peer for the worker's mixture-of-experts throughput: the model a recipe with model.moe trains
(every block a mixture), trained with plain PyTorch on one GPU.

    python3 tests/bench/moe_baseline.py --baselines DIR --model moe-1b [--mode eager|compile|both]
        [--steps 12] [--micro-batch 2]

Models: moe-1b is Mixtral's block at about 1B active parameters (16 layers, d 2048, 32 heads, 8 kv heads,
8 experts of SwiGLU 2816, top 2, vocab 32000, untied head, sequence 2048, micro-batch 2: 2514M parameters,
853M active); moe-small a quick check (4 layers, d 512, 8 heads, 4 kv heads, 8 experts of 704, top 2,
vocab 32000, sequence 1024, micro-batch 4). Attention, norms, RoPE (theta 1e6, eps 1e-5) and embedding are
DIR/llama_model.py's; each MLP is a mixture as the worker computes it (worker/model/moe_ops.cc): a router
without bias in the activations' dtype, softmax scores in fp32, the top k, the chosen scores divided by
their sum as gates, each gate weighing its expert's output, SwiGLU experts stacked as w1, w3 [E, f, d] and
w2 [E, d, f], a token's k outputs summed (in fp32); DeepSeek-V3's sequence-wise balance loss of every block,
weighed by 0.001, added to the language model's loss; no z-loss.

The experts run as TorchTitan runs them (torchtitan/models/common/moe.py, GroupedExperts and
TokenChoiceTopKRouter, with the local dispatch of torchtitan/models/common/token_dispatcher.py): rows
sorted by expert (a stable argsort), three torch._grouped_mm on the int32 cumulative row counts, the
outputs weighed and put back by scatter_add; one product per expert where torch._grouped_mm is missing.
compile: torch.compile of each block (fullgraph), as TorchTitan's apply_compile does; the embedding, the
head and the loss stay eager. bf16 autocast, fused AdamW lr 3e-4, random tokens, 3 warm-up steps.

Prints the line llama_baseline.py prints (tokens/s, TFLOP/s, MFU against 989, peak memory; params= is
every parameter), with FLOPs per token 6 * the ACTIVE parameters (embedding, head, attention, norms,
routers, top_k experts of each block) + 12 * layers * d * sequence, as the worker counts them; the active
count on a line of its own.
"""
import argparse, math, os, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = {  # name: (layers, d, heads, kv_heads, experts, top_k, expert ffn, vocab, seq, micro_batch)
    "moe-1b": (16, 2048, 32, 8, 8, 2, 2816, 32000, 2048, 2),
    "moe-small": (4, 512, 8, 4, 8, 2, 704, 32000, 1024, 4),
}
ROPE_THETA, NORM_EPS, AUX_LOSS_COEF = 1000000.0, 1e-5, 0.001
GROUPED_MM = hasattr(torch, "_grouped_mm")
lm = None  # llama_model, imported by main() from --baselines (or sys.path)


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts, stacked: w2(silu(w1 x) * w3 x) with w1, w3 [E, f, d] and w2 [E, d, f]."""

    def __init__(self, experts, d, ffn):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn, d))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, d))
        self.w2 = nn.Parameter(torch.empty(experts, d, ffn))

    def forward(self, xs, counts):
        """xs: [rows, d], sorted by expert; counts: [E], the rows of each expert. Returns [rows, d]."""
        if GROUPED_MM:
            ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
            w1, w3, w2 = (w.to(xs.dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
            h = F.silu(torch._grouped_mm(xs, w1, offs=ends)) * torch._grouped_mm(xs, w3, offs=ends)
            return torch._grouped_mm(h, w2, offs=ends)
        outs = []
        for e, x in enumerate(torch.split(xs, counts.tolist())):
            outs.append(F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e]))
        return torch.cat(outs)


class MoE(nn.Module):
    """The mixture in place of the MLP: token-choice top-k routing, the experts, the combination."""

    def __init__(self, d, experts, top_k, ffn):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.grouped = GroupedExperts(experts, d, ffn)

    def forward(self, x):
        """x: [B, T, d]. Returns the mixture's output [B, T, d] and the block's balance loss."""
        B, T, d = x.shape
        E, k = self.experts, self.top_k
        xt = x.reshape(-1, d)
        logits = self.router(xt)  # the activations' dtype under autocast
        scores = logits.float().softmax(-1)
        gates, chosen = torch.topk(scores, k, dim=-1)
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)  # [B*T, E]
        counts = picked.sum(0)
        # DeepSeek-V3's sequence-wise balance loss: per sequence, each expert's share of the assignments
        # (times E / k) by its mean score, summed over the experts; the mean over the sequences.
        share = picked.view(B, T, E).sum(1).float() * (E / (k * T))
        aux = (share * scores.view(B, T, E).mean(1)).sum(-1).mean()
        # Dispatch: the assignments (token t's j-th choice is t*k + j) in expert order, stable.
        order = torch.argsort(chosen.reshape(-1), stable=True)
        token = order // k
        ys = self.grouped(xt.to(logits.dtype)[token], counts)
        # Combine: each gate weighs its expert's output; a token's k outputs summed in fp32.
        weighted = ys.float() * gates.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(xt.shape, dtype=torch.float32, device=xt.device)
        out = out.scatter_add(0, token.unsqueeze(1).expand(-1, d), weighted)
        return out.to(ys.dtype).view(B, T, d), aux


class MoEBlock(nn.Module):
    """llama_model.Block with the mixture in place of its MLP; returns (x, balance loss)."""

    def __init__(self, d, heads, kv_heads, experts, top_k, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.attn_norm = lm.RMSNorm(d, NORM_EPS)
        self.wq = nn.Linear(d, heads * self.hd, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, d, bias=False)
        self.ffn_norm = lm.RMSNorm(d, NORM_EPS)
        self.moe = MoE(d, experts, top_k, ffn)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = lm.apply_rope(self.wq(h).view(B, T, self.heads, self.hd), cos, sin)
        k = lm.apply_rope(self.wk(h).view(B, T, self.kv_heads, self.hd), cos, sin)
        v = self.wv(h).view(B, T, self.kv_heads, self.hd)
        rep = self.heads // self.kv_heads
        q, k, v = q.transpose(1, 2), k.repeat_interleave(rep, dim=2).transpose(1, 2), v.repeat_interleave(rep, dim=2).transpose(1, 2)
        y = lm.attention(q, k, v).transpose(1, 2).reshape(B, T, self.heads * self.hd)
        x = x + self.wo(y)
        out, aux = self.moe(self.ffn_norm(x))
        return x + out, aux


class MoeLlama(nn.Module):
    """llama_model.Llama (untied) of MoE blocks; forward returns the LM loss plus 0.001 * the blocks' balance
    losses. Initialisation as Llama's: matrices N(0, 0.02), wo and the experts' w2 N(0, 0.02/sqrt(2*layers))."""

    def __init__(self, layers, d, heads, kv_heads, experts, top_k, ffn, vocab, seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(MoEBlock(d, heads, kv_heads, experts, top_k, ffn) for _ in range(layers))
        self.norm = lm.RMSNorm(d, NORM_EPS)
        self.output = nn.Linear(d, vocab, bias=False)
        cos, sin = lm.rope_tables(d // heads, seq, ROPE_THETA)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", ".w2")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.tok_embeddings(idx)
        aux = 0.0
        for block in self.layers:
            x, a = block(x, self.cos[:T], self.sin[:T])
            aux = aux + a
        logits = self.output(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1)) + AUX_LOSS_COEF * aux


def parameter_counts(name):
    """(every parameter, the active ones) of `name`, as the worker counts them."""
    L, d, h, kv, E, k, f, V, T, _ = MODELS[name]
    hd = d // h
    block = 2 * d + 2 * h * hd * d + 2 * kv * hd * d + E * d
    total = 2 * V * d + L * (block + 3 * E * f * d) + d
    return total, total - L * 3 * (E - k) * f * d


def run(name, compile_, steps, B):
    L, d, h, kv, E, k, f, V, T, _ = MODELS[name]
    torch.manual_seed(0)
    m = MoeLlama(L, d, h, kv, E, k, f, V, T).cuda()
    N = sum(p.numel() for p in m.parameters())
    active = N - L * 3 * (E - k) * f * d
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    if compile_:
        # TorchTitan's apply_compile: each block, whole graph (the dispatch has no host sync).
        torch._dynamo.config.capture_scalar_outputs = True
        for block in m.layers:
            block.compile(fullgraph=GROUPED_MM)
    x = torch.randint(0, V, (B, T), device="cuda")
    y = torch.randint(0, V, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / steps
    tok = B * T / dt
    tflops = (6 * active + 12 * L * d * T) * tok / 1e12
    print(f"pytorch {name} {'compile' if compile_ else 'eager'} params={N/1e6:.0f}M tok/s={tok:,.0f} "
          f"TFLOP/s={tflops:.0f} MFU(989)={tflops/989:.1%} peak_mem={torch.cuda.max_memory_allocated()/2**30:.1f}GiB", flush=True)
    del m, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main():
    global lm
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baselines", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "baselines"),
                   help="the folder of llama_model.py (default: ../shared/baselines; else sys.path)")
    p.add_argument("--model", default="moe-1b", choices=MODELS)
    p.add_argument("--mode", default="both", choices=["eager", "compile", "both"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=0, help="sequences a step (default: the model's)")
    a = p.parse_args()
    if os.path.isdir(a.baselines):
        sys.path.insert(0, os.path.abspath(a.baselines))
    import llama_model
    lm = llama_model
    torch.backends.cuda.matmul.allow_tf32 = True
    total, active = parameter_counts(a.model)
    print(f"{a.model}: {total/1e6:.0f}M parameters, {active/1e6:.0f}M active (top {MODELS[a.model][5]} of "
          f"{MODELS[a.model][4]} experts); experts by {'torch._grouped_mm' if GROUPED_MM else 'one product each'}",
          flush=True)
    for c in ([False, True] if a.mode == "both" else [a.mode == "compile"]):
        run(a.model, c, a.steps, a.micro_batch or MODELS[a.model][9])


if __name__ == "__main__":
    main()
