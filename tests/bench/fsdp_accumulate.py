#!/usr/bin/env python3
"""FSDP2 with gradient accumulation, TorchTitan's way: the peer for ZeRO-3 runs whose global batch takes
more than one micro-batch per GPU.

    torchrun --standalone --nproc_per_node N tests/bench/fsdp_accumulate.py --baselines DIR \\
        --model gpt-7b --micro-batch 1 --accumulation 2 [--mode eager|compile]

The model, its sharding and its mixed precision are those of DIR/gpt_fsdp.py (each block its own
fully_shard unit, bf16 parameters for compute, fp32 reduction, fp32 sharded masters and AdamW state);
only the step differs: `--accumulation` micro-batches, each backward reduce-scattering its gradients
into the fp32 sharded gradients (FSDP2's default, as TorchTitan accumulates), then one AdamW step.
Prints the line gpt_fsdp.py prints (tokens/s per GPU over all micro-batches, TFLOP/s, MFU against
989 TFLOP/s, peak memory), with accumulation=N added.
"""
import argparse, os, sys, time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baselines", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "baselines"),
                   help="the folder of gpt_fsdp.py, gpt_model.py and llama_model.py (default: ../shared/baselines)")
    p.add_argument("--model", default="gpt-7b")
    p.add_argument("--mode", default="eager", choices=["eager", "compile"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per backward")
    p.add_argument("--accumulation", type=int, default=2, help="backwards per optimizer step")
    a = p.parse_args()
    sys.path.insert(0, os.path.abspath(a.baselines))
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    import gpt_fsdp
    from gpt_model import GPT
    from llama_model import Llama, rope_tables

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    T, V = 2048, 50304
    spec = gpt_fsdp.SHARDED_MODELS[a.model]
    with torch.device("meta"):
        if a.model.startswith("llama"):
            L, d, h, kv, ffn, V, tie, _ = spec
            m = Llama(L, d, h, kv, ffn, V, T, tie=tie)
            blocks = m.layers
        else:
            L, d, h, _ = spec
            m = GPT(L, d, h, V, T)
            blocks = m.blocks
    B = a.micro_batch
    N = sum(q.numel() for q in m.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        if a.mode == "compile":
            block.compile()
        fully_shard(block, mp_policy=mp, reshard_after_forward=True)
    fully_shard(m, mp_policy=mp)
    m.to_empty(device="cuda")
    with torch.no_grad():
        for name, q in m.named_parameters():
            if name.endswith("bias"):
                q.zero_()
            elif q.dim() == 1:
                q.fill_(1.0)
            else:
                q.normal_(0.0, 0.02)
        if hasattr(m, "cos"):
            m.cos, m.sin = rope_tables(d // h, T, device="cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    batches = [(torch.randint(0, V, (B, T), device="cuda"), torch.randint(0, V, (B, T), device="cuda"))
               for _ in range(a.accumulation)]

    def step():
        for x, y in batches:
            (m(x, y) / a.accumulation).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.time()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / a.steps
    tok = B * a.accumulation * T / dt
    tflops = (6 * N + 12 * L * d * T) * tok / 1e12
    if rank == 0:
        print(f"pytorch-fsdp2 world={world} {a.model} {a.mode} ac=none micro_batch={B} accumulation={a.accumulation} "
              f"params={N/1e9:.2f}B tok/s/GPU={tok:,.0f} TFLOP/s/GPU={tflops:.0f} MFU(989)={tflops/989:.1%} "
              f"peak_mem={torch.cuda.max_memory_allocated()/2**30:.1f}GiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
