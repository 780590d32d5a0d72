#!/usr/bin/env python3
"""PyTorch peer for the Hub families' throughput: transformers' own model of a Hub configuration (random
weights), trained with plain PyTorch on one GPU, as a user of transformers trains it.

    python3 tests/bench/hf_baseline.py --model qwen2.5-0.5b [--mode eager|compile|both] [--steps 30]

Models (sequence 2048, micro-batch 4): qwen2.5-0.5b is Qwen2.5-0.5B's config.json (Qwen2ForCausalLM: 24
layers, d 896, 14 heads, 2 key/value heads, SwiGLU 4864, q/k/v biases, vocab 151936, tied embedding);
qwen3-0.6b Qwen3-0.6B's (Qwen3ForCausalLM: 28 layers, d 1024, 16 heads of 128, 8 key/value heads, 3072,
per-head q/k norms, tied). bf16 autocast, SDPA attention, fused AdamW lr 3e-4, random tokens, the loss
transformers computes from labels. Prints the line llama_baseline.py prints (tokens/s, TFLOP/s as 6N +
12*L*d*T per token, peak memory), so that launch_bench.py reads both alike.
"""
import argparse, time, torch

MODELS = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, head_dim=128,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936),
}


def run(name, compile_, steps, T=2048, B=4):
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **{k: v for k, v in spec.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).cuda().train()
    N = sum(p.numel() for p in m.parameters())
    L, d, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    f = torch.compile(m) if compile_ else m
    x = torch.randint(0, V, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(input_ids=x, labels=x).loss
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
    tflops = (6 * N + 12 * L * d * T) * tok / 1e12
    print(f"pytorch {name} {'compile' if compile_ else 'eager'} params={N/1e6:.0f}M tok/s={tok:,.0f} "
          f"TFLOP/s={tflops:.0f} MFU(989)={tflops/989:.1%} peak_mem={torch.cuda.max_memory_allocated()/2**30:.1f}GiB",
          flush=True)
    del m, opt, f
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-0.5b", choices=MODELS)
    p.add_argument("--mode", default="both", choices=["eager", "compile", "both"])
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    for c in ([False, True] if a.mode == "both" else [a.mode == "compile"]):
        run(a.model, c, a.steps)
