#!/usr/bin/env python3
"""Training on GPUs through `ltrain launch`, each run beside its PyTorch peer under torchrun, in one call.

Every ltrain figure here is the `throughput:` line of an `ltrain launch` job (rank 0's steps after the
third: tokens/s per GPU, MFU against 989 TFLOP/s, peak memory), a user's command with `--set`
overrides on one recipe; every peer figure is the line of `gpt_fsdp.py` or `fsdp_accumulate.py` run
under `torchrun --standalone` on the same GPUs (llama-1b: `llama_baseline.py`, moe: `moe_baseline.py`, one process on the same GPU). Ratios are ltrain against the better peer.

    tests/bench/launch_bench.py --ltrain build-gpu/cmd/ltrain --baselines DIR --data TEXT \\
        [--suite layouts] [--suite zero3 --suite tp --suite llama --suite dp] [--suite llama-1b] [--suite moe]
        [--reference OTHER/ltrain]

Suites (--suite, repeatable; default: layouts):
  layouts  every layout the GPUs here allow (1: one GPU; 2: dp2, dp2 ZeRO-3, tp2, tp2 with sequence
           parallelism, pp2; 4: dp4 ZeRO-3, tp4, tp2 x dp2 under ZeRO-1 and ZeRO-3, pp2 x dp2, tp2 x pp2
           interleaved; 8: dp8 ZeRO-3, tp4 x dp2, tp2 x pp2 x dp2), a GPT of 24 layers (d 1024, 16 heads),
           16 sequences a step, 8 steps each. A layout fails when its job fails, prints no throughput
           line, or its first loss (before any update: the same batch and weights on every layout)
           parts from the one-GPU run's by more than 1%, its second (after one update) by more than
           0.1%, or its last by more than 5%.
  zero3    gpt-7b (32 layers, d 4096) ZeRO-3 over every GPU at micro-batch 2, and at micro-batch 1 with
           accumulation 2, against FSDP2 (gpt_fsdp.py eager and compile; fsdp_accumulate.py)
  tp       gpt-7b, 8 sequences a step (4 GPUs): tp4 and tp2 x dp2 under ZeRO-1 at micro-batch 4, tp2 x dp2
           under ZeRO-3 and pp2 x dp2 (ZeRO-1) at micro-batch 2; on 2 GPUs tp2 at micro-batch 4 only
  large    8 GPUs: gpt-7b, 16 sequences a step, with tp8, tp4 x dp2, tp2 x pp2 x dp2 (interleaved) and dp8
           ZeRO-3 (micro-batch 2), against FSDP2 eager and compile at micro-batch 2 on the 8
  llama    Llama 3 8B's shape, ZeRO-3 over every GPU, micro-batch 1, against FSDP2 with compile
  llama-1b Llama 3.2 1B's shape (recipes/gpu-llama-1b.yaml's model) on one GPU, micro-batch 4, 30 steps,
           against llama_baseline.py (PyTorch eager and compile, one process)
  llama-3b Llama 3.2 3B's shape (28 layers, d 3072, 24 heads, 8 kv heads, SwiGLU 8192, tied) on one GPU,
           micro-batch 2, 30 steps, against llama_baseline.py --model llama-3b
  moe      a Mixtral-style mixture of experts on one GPU (16 layers, d 2048, 32 heads, 8 kv heads, every
           block 8 experts of SwiGLU 2816, top 2, vocab 32000, untied: 2.5B parameters, 0.85B active; the
           default balance, aux_loss 0.001), micro-batch 2, 30 steps, against tests/bench/moe_baseline.py
           --model moe-1b (the same model in PyTorch, experts by torch._grouped_mm, eager and compile)
  gpt-1.3b gpt-1.3b on one GPU (micro-batch 8, 40 steps) against gpt_baseline.py (PyTorch eager and
           compile, one process, 40 steps)
  hub      the same with Llama 3.2 1B's RoPE scaling (llama3), and Qwen2.5 0.5B's and Qwen3 0.6B's shapes
           against transformers' Qwen2ForCausalLM and Qwen3ForCausalLM (hf_baseline.py: bf16 autocast, SDPA,
           fused AdamW), each peer under torch.compile, one GPU, micro-batch 4, 30 steps
  dp       gpt-1.3b (micro-batch 8, recipe defaults) on one GPU and data parallel on 2 and on every GPU
  learning gpt-124m on byte tokens of --learning-data, 200 steps, the default precision, one seed per
           GPU up to 4 or --learning-seeds N (seed k from the parameters and batches of gpt_baseline.py
           with its seeds moved by k),
           against gpt_baseline.py (PyTorch AMP) with the same seeds: the loss at step 200, each
           curve's worst step against the mean of the 10 before it, and the worst step of ltrain's
           mean over the seeds against AMP's mean at the same step; --learning-control adds AMP under
           torch.compile against AMP eager, the same measures (the peer's own spread).
           --learning-model gpt-350m and --learning-steps N train the larger model longer. With
           --ltrain-set (e.g. parallel.precision=fp8), --learning-default also runs each seed at the
           recipe's defaults and compares the two: the mean loss at the end and over the last 20 steps,
           and the steps above 1.5x the mean of the 10 before them that the default run does not also
           have. --learning-runs picks which of ltrain, default and amp run here; --learning-curves
           FILE (an earlier --json) supplies the others' curves
--reference LTRAIN adds gpt-1.3b (or --reference-model) on one GPU through another build's ltrain (an
earlier commit built beside this one), interleaved with this build's, twice each (--reference-rounds),
and prints the ratio. With this build's own ltrain as LTRAIN and --reference-env, it is an A/B of one
setting of the worker: the reference runs add that environment, and both take --ltrain-set.

Exits 1 when a run fails, 77 (skipped) without a GPU. --json FILE writes every figure.
"""
import argparse, json, math, os, re, shutil, subprocess, sys, tempfile, time

from benchlib import gpus, peer_env
from gpu_throughput import SHIFTED_SEEDS, byte_data, parse_worker, peer_source, print_worst_step

GPT = "model: {{layers: {layers}, d_model: {d}, heads: {heads}, seq_len: 2048, vocab: 50304}}\n"
LLAMA = ("model: {arch: llama, layers: 32, d_model: 4096, heads: 32, kv_heads: 8, ffn: 14336, seq_len: 2048,\n"
         "  vocab: 128256, rope_theta: 500000, tie_embeddings: false}\n")
LLAMA_1B = ("model: {arch: llama, layers: 16, d_model: 2048, heads: 32, kv_heads: 8, ffn: 8192, seq_len: 2048,\n"
            "  vocab: 128256, rope_theta: 500000, tie_embeddings: true}\n")
# The Hub families' shapes as model.init_from derives them from their config.json: Llama 3.2 1B's with
# its RoPE scaling, Qwen2.5 0.5B's (q, k and v biases), Qwen3 0.6B's (per-head q/k norms, heads of 128).
LLAMA_3B = ("model: {arch: llama, layers: 28, d_model: 3072, heads: 24, kv_heads: 8, ffn: 8192, seq_len: 2048,\n"
            "  vocab: 128256, rope_theta: 500000, tie_embeddings: true}\n")
LLAMA_1B_SCALED = LLAMA_1B.replace("tie_embeddings: true}", "tie_embeddings: true,\n  rope_scaling: llama3, rope_factor: 32, "
                                   "rope_low_freq_factor: 1, rope_high_freq_factor: 4, rope_original_positions: 8192}")
# A Mixtral-style mixture of experts (a windowless Mistral is a Llama), every block 8 experts, top 2:
# tests/bench/moe_baseline.py's moe-1b.
MOE_1B = ("model: {arch: llama, layers: 16, d_model: 2048, heads: 32, kv_heads: 8, seq_len: 2048, vocab: 32000,\n"
          "  rope_theta: 1000000, norm_eps: 1.0e-5, tie_embeddings: false, moe: {experts: 8, top_k: 2, ffn: 2816}}\n")
QWEN25_05B = ("model: {arch: qwen2, layers: 24, d_model: 896, heads: 14, kv_heads: 2, ffn: 4864, seq_len: 2048,\n"
              "  vocab: 151936, rope_theta: 1000000, norm_eps: 1.0e-6, tie_embeddings: true}\n")
QWEN3_06B = ("model: {arch: qwen3, layers: 28, d_model: 1024, heads: 16, kv_heads: 8, head_dim: 128, ffn: 3072,\n"
             "  seq_len: 2048, vocab: 151936, rope_theta: 1000000, norm_eps: 1.0e-6, tie_embeddings: true}\n")
LOSS_RE = re.compile(r"step (\d+)/\d+ loss ([0-9.naif]+)")  # nan and inf too: the layouts check fails them
SINGLE_RE = re.compile(r"pytorch \S+ (?P<mode>eager|compile) params=\S+ tok/s=(?P<tok>[0-9,]+) TFLOP/s=[0-9.]+ "
                       r"MFU\(989\)=(?P<mfu>[0-9.]+)% peak_mem=(?P<peak>[0-9.]+)GiB")
PEER_RE = re.compile(r"pytorch-fsdp2 world=\d+ \S+ (?P<mode>eager|compile) .*?tok/s/GPU=(?P<tok>[0-9,]+) TFLOP/s/GPU=[0-9.]+ "
                     r"MFU\(989\)=(?P<mfu>[0-9.]+)% peak_mem=(?P<peak>[0-9.]+)GiB")


class Bench:
    def __init__(self, args, workdir):
        self.args, self.workdir = args, workdir
        self.results, self.failures = [], []
        self.count = 0

    def recipe(self, name, model, steps, micro_batch, global_batch, world, parallel="", lr="3.0e-4"):
        """A recipe as a user writes one: the peers' optimizer (AdamW, constant lr, no clipping), no checkpoints."""
        path = os.path.join(self.workdir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"name: {name}\n{model}data: {{path: {self.args.token_dir}}}\n"
                    f"training: {{steps: {steps}, micro_batch: {micro_batch}, global_batch: {global_batch}, lr: {lr},\n"
                    f"  min_lr: {lr}, warmup_steps: 0, lr_schedule: constant, weight_decay: 0.01, beta2: 0.999,\n"
                    f"  grad_clip: 0, seed: 0, log_every: 1}}\n"
                    f"parallel: {{nodes: 1, nproc_per_node: {world}, device: cuda{parallel}}}\n"
                    f"checkpoint: {{enabled: false}}\n")
        return path

    def launch(self, label, recipe_path, sets=(), env=None, ltrain=None, defaults=False):
        """One `ltrain launch` job; its throughput line and losses, or None (recorded as a failure).
        `defaults`: without --ltrain-set's overrides."""
        self.count += 1
        log = os.path.join(self.workdir, f"{self.count:02d}-{re.sub(r'[^A-Za-z0-9.-]+', '_', label)}.log")
        cmd = [ltrain or self.args.ltrain, "launch", recipe_path]
        for s in [*(self.args.ltrain_set if ltrain is None and not defaults else []), *sets]:
            cmd += ["--set", s]
        start = time.time()
        with open(log, "w") as out:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, **self.args.ltrain_env, **(env or {})),
                                    timeout=self.args.run_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = open(log, errors="replace").read()
        r = parse_worker(text)
        losses = [(int(s), float(v)) for s, v in LOSS_RE.findall(text)]
        if rc != 0 or r is None:
            tail = " | ".join(text.strip().splitlines()[-3:])
            print(f"  {label:<44} FAILED (exit {rc}, {time.time() - start:.0f} s): {tail}", flush=True)
            self.failures.append(f"{label}: exit {rc}")
            self.results.append({"label": label, "failed": True, "log": log})
            return None
        r.update(label=label, first_loss=losses[0][1] if losses else None, last_loss=losses[-1][1] if losses else None)
        self.show(r)
        r["curve"] = losses
        self.results.append(r)
        self.dump()
        return r

    def peer(self, label, world, script_args):
        """One PyTorch peer under torchrun; {mode: figures} from its lines."""
        torchrun = shutil.which("torchrun")
        cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"])
        return self.run_peer(label, cmd + ["--standalone", f"--nproc_per_node={world}"] + script_args, PEER_RE)

    def single(self, label, script_args):
        """One PyTorch peer in one process on one GPU (gpt_baseline.py, llama_baseline.py); {mode: figures}."""
        return self.run_peer(label, [sys.executable] + script_args, SINGLE_RE)

    def run_peer(self, label, cmd, pattern):
        """Runs a peer's command; {mode: figures} from the lines `pattern` (named groups mode, tok, mfu, peak) finds."""
        log = os.path.join(self.workdir, f"peer-{re.sub(r'[^A-Za-z0-9.-]+', '_', label)}.log")
        with open(log, "w") as out:
            try:
                subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=peer_env(), timeout=self.args.run_timeout)
            except subprocess.TimeoutExpired:
                pass
        rows = {}
        for m in pattern.finditer(open(log, errors="replace").read()):
            r = {"label": f"{label} {m['mode']}", "tok_s_gpu": float(m["tok"].replace(",", "")),
                 "mfu": float(m["mfu"]), "peak_gib": float(m["peak"])}
            rows[m["mode"]] = r
            self.show(r)
            self.results.append(r)
        if not rows:
            print(f"  {label:<44} FAILED (no figures; {log})", flush=True)
            self.failures.append(f"{label}: no figures")
        self.dump()
        return rows

    def show(self, r):
        loss = f" loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}" if r.get("first_loss") is not None else ""
        print(f"  {r['label']:<44} {r['tok_s_gpu']:>9,.0f} tok/s/GPU  MFU {r['mfu']:5.1f}%  "
              f"peak {r['peak_gib']:5.1f} GiB{loss}", flush=True)

    def ratio(self, what, ours, peers):
        peers = [p for p in peers if p]
        if ours and peers:
            best = max(peers, key=lambda p: p["tok_s_gpu"])
            line = (f"  {what}: {ours['tok_s_gpu'] / best['tok_s_gpu']:.3f} x {best['label']}, "
                    f"peak {ours['peak_gib']:.1f} against {best['peak_gib']:.1f} GiB")
            print(line, flush=True)
            self.results.append({"ratio": what, "value": ours["tok_s_gpu"] / best["tok_s_gpu"]})
            self.dump()

    def dump(self):
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.results, f, indent=1)


def layouts_for(n):
    """(label, world, parallel keys) of every layout the check runs on n GPUs."""
    rows = [("one GPU", 1, "")]
    if n >= 2:
        rows += [("dp2 (defaults)", 2, ""), ("dp2 zero 3", 2, ", zero: 3"), ("tp2", 2, ", tp: 2"),
                 ("tp2 sequence parallel", 2, ", tp: 2, sequence_parallel: true"),
                 ("pp2 1f1b", 2, ", pp: 2, pp_schedule: 1f1b")]
    if n >= 4:
        rows += [("dp4 zero 3", 4, ", zero: 3"), ("tp4", 4, ", tp: 4"), ("tp2 x dp2 zero 1", 4, ", tp: 2, zero: 1"),
                 ("tp2 x dp2 zero 3", 4, ", tp: 2, zero: 3"), ("pp2 x dp2", 4, ", pp: 2"),
                 ("tp2 x pp2 interleaved", 4, ", tp: 2, pp: 2, pp_schedule: interleaved, virtual_stages: 2")]
    if n >= 8:
        rows += [("dp8 zero 3", 8, ", zero: 3"), ("tp4 x dp2", 8, ", tp: 4"),
                 ("tp2 x pp2 x dp2", 8, ", tp: 2, pp: 2")]
    return rows


def suite_layouts(b, n):
    print(f"layouts: a GPT of 24 layers (d 1024, 16 heads), 16 sequences a step, 8 steps, on up to {n} GPUs", flush=True)
    model = GPT.format(layers=24, d=1024, heads=16)
    reference = None
    for label, world, parallel in layouts_for(n):
        path = b.recipe(f"layout-{world}-{b.count}", model, steps=8, micro_batch=2, global_batch=16, world=world,
                        parallel=parallel)
        r = b.launch(f"layout {label}", path)
        if r is None:
            continue
        # The loss after one update, from the same weights and batch on every layout: a gradient lost or
        # counted twice shows here (a stale tp gradient added to step 1's gave 7.826 against 7.866), where
        # the rounding of the layouts' reductions parts them by about 1e-5.
        r["second_loss"] = dict(r.get("curve", [])).get(2)
        if reference is None:
            reference = r
            continue
        for key, bound in (("first_loss", 0.01), ("second_loss", 0.001), ("last_loss", 0.05)):
            ours, ref = r.get(key), reference.get(key)
            if ours is None or ref is None or not math.isfinite(ours) or abs(ours - ref) > bound * ref:
                print(f"    {label}: {key} {ours} against the one-GPU run's {ref} (bound {bound:.1%})", flush=True)
                b.failures.append(f"layout {label}: {key} {ours} against {ref}")


def suite_zero3(b, n, baselines, here):
    print(f"zero3: gpt-7b ZeRO-3 over {n} GPUs, {2 * n} sequences a step, against FSDP2", flush=True)
    path = b.recipe("gpt-7b-zero3", GPT.format(layers=32, d=4096, heads=32), steps=15, micro_batch=2,
                    global_batch=2 * n, world=n, parallel=", zero: 3")
    mb2 = b.launch("ltrain zero 3, micro-batch 2", path)
    peers = b.peer("FSDP2 micro-batch 2", n, [os.path.join(baselines, "gpt_fsdp.py"), "--model", "gpt-7b",
                                              "--mode", "both", "--micro-batch", "2"])
    b.ratio("zero 3 micro-batch 2", mb2, peers.values())
    acc = b.launch("ltrain zero 3, micro-batch 1 x 2", path, sets=["training.micro_batch=1"])
    peers = b.peer("FSDP2 micro-batch 1 x 2", n, [os.path.join(here, "fsdp_accumulate.py"), "--baselines", baselines,
                                                  "--model", "gpt-7b", "--mode", "compile", "--micro-batch", "1",
                                                  "--accumulation", "2"])
    b.ratio("zero 3 micro-batch 1 x 2", acc, peers.values())


def suite_tp(b, n):
    # On 2 GPUs: tp2 alone, the 4-GPU rows' tensor-parallel part (a proxy, not an acceptance figure).
    world = 4 if n >= 4 else 2
    print(f"tp: gpt-7b, 8 sequences a step, on {world} GPUs", flush=True)
    rows = ((("tp4", 4, ", tp: 4, zero: 1"), ("tp2 x dp2", 4, ", tp: 2, zero: 1"),
             ("tp2 x dp2 zero 3", 2, ", tp: 2, zero: 3"), ("pp2 x dp2", 2, ", pp: 2, zero: 1")) if world == 4
            else (("tp2", 4, ", tp: 2, zero: 1"),))
    for label, micro_batch, parallel in rows:
        path = b.recipe(f"gpt-7b-{re.sub(r'[^a-z0-9]+', '', label)}", GPT.format(layers=32, d=4096, heads=32), steps=12,
                        micro_batch=micro_batch, global_batch=8, world=world, parallel=parallel)
        b.launch(f"ltrain {label}, micro-batch {micro_batch}", path)


def suite_large(b, n, baselines):
    print("large: gpt-7b on 8 GPUs, 16 sequences a step, the 3-D layouts and ZeRO-3 against FSDP2", flush=True)
    model = GPT.format(layers=32, d=4096, heads=32)
    zero3 = None
    for label, micro_batch, parallel in (("tp8", 4, ", tp: 8, zero: 1"), ("tp4 x dp2", 4, ", tp: 4, zero: 1"),
                                         ("tp2 x pp2 x dp2 interleaved", 2,
                                          ", tp: 2, pp: 2, pp_schedule: interleaved, virtual_stages: 2, zero: 1"),
                                         ("dp8 zero 3", 2, ", zero: 3")):
        path = b.recipe(f"gpt-7b-large-{re.sub(r'[^a-z0-9]+', '', label)}", model, steps=12, micro_batch=micro_batch,
                        global_batch=16, world=8, parallel=parallel)
        r = b.launch(f"ltrain {label}, micro-batch {micro_batch}", path)
        if label.startswith("dp8"):
            zero3 = r
    peers = b.peer("FSDP2 on 8, micro-batch 2", 8, [os.path.join(baselines, "gpt_fsdp.py"), "--model", "gpt-7b",
                                                    "--mode", "both", "--micro-batch", "2"])
    b.ratio("dp8 zero 3 micro-batch 2", zero3, peers.values())


def suite_llama(b, n, baselines):
    print(f"llama: Llama 3 8B's shape, ZeRO-3 over {n} GPUs, micro-batch 1, against FSDP2 with compile", flush=True)
    path = b.recipe("llama-8b-zero3", LLAMA, steps=12, micro_batch=1, global_batch=n, world=n, parallel=", zero: 3")
    ours = b.launch("ltrain llama-8b zero 3", path)
    peers = b.peer("FSDP2 llama-8b", n, [os.path.join(baselines, "gpt_fsdp.py"), "--model", "llama-8b", "--mode",
                                         "compile", "--micro-batch", "1"])
    b.ratio("llama-8b zero 3", ours, peers.values())


def suite_llama_1b(b, baselines):
    print("llama-1b: Llama 3.2 1B's shape on one GPU, micro-batch 4, against PyTorch eager and compile", flush=True)
    path = b.recipe("llama-1b", LLAMA_1B, steps=30, micro_batch=4, global_batch=4, world=1)
    ours = b.launch("ltrain llama-1b", path)
    peers = b.single("PyTorch llama-1b", [os.path.join(baselines, "llama_baseline.py"), "--model", "llama-1b",
                                          "--mode", b.args.peer_mode, "--steps", "30"])
    b.ratio("llama-1b", ours, peers.values())


def suite_llama_3b(b, baselines):
    print("llama-3b: Llama 3.2 3B's shape on one GPU, micro-batch 2, against PyTorch eager and compile", flush=True)
    path = b.recipe("llama-3b", LLAMA_3B, steps=30, micro_batch=2, global_batch=2, world=1)
    ours = b.launch("ltrain llama-3b", path)
    peers = b.single("PyTorch llama-3b", [os.path.join(baselines, "llama_baseline.py"), "--model", "llama-3b",
                                          "--mode", b.args.peer_mode, "--steps", "30"])
    b.ratio("llama-3b", ours, peers.values())


def suite_moe(b, baselines, here):
    print("moe: a mixture of experts (moe-1b: 8 experts, top 2, 0.85B of 2.5B parameters active) on one GPU, "
          "micro-batch 2, against PyTorch eager and compile (torch._grouped_mm)", flush=True)
    path = b.recipe("moe-1b", MOE_1B, steps=30, micro_batch=2, global_batch=2, world=1)
    ours = b.launch("ltrain moe-1b", path)
    peers = b.single("PyTorch moe-1b", [os.path.join(here, "moe_baseline.py"), "--baselines", baselines, "--model",
                                        "moe-1b", "--mode", b.args.peer_mode, "--steps", "30", "--micro-batch", "2"])
    b.ratio("moe-1b", ours, peers.values())


def suite_gpt_1_3b(b, baselines):
    print("gpt-1.3b: one GPU, micro-batch 8, against gpt_baseline.py (PyTorch eager and compile, one process)",
          flush=True)
    ours = b.launch("ltrain gpt-1.3b one GPU", gpt_1_3b(b, 1))
    peers = b.single("PyTorch gpt-1.3b", [os.path.join(baselines, "gpt_baseline.py"), "--model", "gpt-1.3b",
                                          "--mode", b.args.peer_mode, "--steps", "40"])
    b.ratio("gpt-1.3b", ours, peers.values())


def suite_hub(b, baselines, here):
    print("hub: Hub families' shapes on one GPU, micro-batch 4, 30 steps: Llama 3.2 1B with its RoPE scaling against "
          "llama_baseline.py, Qwen2.5 0.5B and Qwen3 0.6B against transformers' own models under torch.compile",
          flush=True)
    path = b.recipe("llama-1b-scaled", LLAMA_1B_SCALED, steps=30, micro_batch=4, global_batch=4, world=1)
    ours = b.launch("ltrain llama-1b rope_scaling llama3", path)
    peers = b.single("PyTorch llama-1b", [os.path.join(baselines, "llama_baseline.py"), "--model", "llama-1b",
                                          "--mode", "compile", "--steps", "30"])
    b.ratio("llama-1b with rope_scaling", ours, peers.values())
    for name, model in (("qwen2.5-0.5b", QWEN25_05B), ("qwen3-0.6b", QWEN3_06B)):
        path = b.recipe(name, model, steps=30, micro_batch=4, global_batch=4, world=1)
        ours = b.launch(f"ltrain {name}", path)
        peers = b.single(f"transformers {name}", [os.path.join(here, "hf_baseline.py"), "--model", name,
                                                  "--mode", "compile", "--steps", "30"])
        b.ratio(name, ours, peers.values())


def gpt_1_3b(b, world):
    # The recipe defaults for data parallel: no zero or bucket_mb keys (the launcher picks them).
    return b.recipe(f"gpt-1.3b-dp{world}", GPT.format(layers=24, d=2048, heads=16), steps=40, micro_batch=8,
                    global_batch=8 * world, world=world)


def suite_dp(b, n):
    print(f"dp: gpt-1.3b, micro-batch 8, recipe defaults, on 1, 2 and {n} GPUs", flush=True)
    one = b.launch("ltrain gpt-1.3b one GPU", gpt_1_3b(b, 1))
    for world in sorted({2, n}):
        if world <= n and world > 1:
            r = b.launch(f"ltrain gpt-1.3b dp{world}", gpt_1_3b(b, world))
            if r and one:
                print(f"  dp{world}: {r['tok_s_gpu'] / one['tok_s_gpu']:.3f} of one GPU", flush=True)
                b.results.append({"ratio": f"dp{world} of one GPU", "value": r["tok_s_gpu"] / one["tok_s_gpu"]})


LEARNING_MODEL = "model: {layers: 12, d_model: 768, heads: 12, seq_len: 2048, vocab: 256}\n"


def suite_reference(b, reference, rounds, model):
    same = os.path.realpath(reference) == os.path.realpath(b.args.ltrain)
    extra = b.args.reference_env
    what = " with " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else ""
    print(f"reference: {model} on one GPU, this build against {reference}{what}, interleaved", flush=True)
    if model == "gpt-1.3b":
        path = gpt_1_3b(b, 1)
    elif model == "llama-1b":
        path = b.recipe("llama-1b", LLAMA_1B, steps=30, micro_batch=4, global_batch=4, world=1)
    else:
        # The learning suite's model and batch, on the bench's tokens.
        path = b.recipe("gpt-124m-bytes", LEARNING_MODEL, steps=100, micro_batch=16, global_batch=16, world=1)
    ours, theirs = [], []
    # The other build keeps its job records apart (its database may be of another schema).
    home = os.path.join(b.workdir, "reference-home")
    os.makedirs(home, exist_ok=True)
    for _ in range(rounds):
        # The same build takes this build's recipe overrides (its launch passes ltrain=None).
        theirs.append(b.launch("reference build, one GPU", path, sets=b.args.reference_set,
                               env={"LTRAIN_HOME": home, **extra}, ltrain=None if same else reference))
        ours.append(b.launch("this build, one GPU", path))
    for i, (a, r) in enumerate(zip(ours, theirs)):
        if a and r:
            print(f"  round {i + 1}: {a['tok_s_gpu'] / r['tok_s_gpu']:.3f} of the reference build", flush=True)
            b.results.append({"ratio": f"{model} against the reference, round {i + 1}",
                              "value": a["tok_s_gpu"] / r["tok_s_gpu"]})


# The learning suite's models: gpt_baseline.py's shapes at its micro-batches, byte vocabulary.
LEARNING_MODELS = {"gpt-124m": (LEARNING_MODEL, 16),
                   "gpt-350m": ("model: {layers: 24, d_model: 1024, heads: 16, seq_len: 2048, vocab: 256}\n", 8)}


def learning_curves(files):
    """{label: curve} of the runs in earlier --json files."""
    curves = {}
    for path in files:
        for r in json.load(open(path)):
            if "label" in r and r.get("curve"):
                curves[r["label"]] = [tuple(x) for x in r["curve"]]
    return curves


def suite_learning(b, n, baselines, text):
    a = b.args
    seeds = list(range(a.learning_seeds or min(n, 4)))
    name, steps = a.learning_model, a.learning_steps
    model, micro_batch = LEARNING_MODELS[name]
    runs = set(a.learning_runs.split(","))
    sets = " ".join(a.ltrain_set) or "the recipe's defaults"
    print(f"learning: {name}, byte tokens of {text}, {steps} steps, seeds {seeds}, ltrain with {sets}, "
          f"against PyTorch AMP" + (" and ltrain at the defaults" if a.learning_default else ""), flush=True)
    tokens = byte_data(os.path.join(b.workdir, "learning-tokens"), text)
    earlier = learning_curves(a.learning_curves or [])
    ours, plain = {}, {}
    for k in seeds:
        # The batches of gpt_baseline.py's generator (seed 1234 + k) over the same bytes.
        path = b.recipe(f"learning-{name}-seed{k}", model, steps=steps, micro_batch=micro_batch,
                        global_batch=micro_batch, world=1)
        keys = [f"data.path={tokens}", "data.sampling=torch", f"data.seed={1234 + k}", f"training.seed={k}"]
        for side, label, defaults, wanted in ((ours, f"ltrain learning seed {k}", False, "ltrain"),
                                             (plain, f"ltrain default learning seed {k}", True, "default")):
            if wanted == "default" and not a.learning_default:
                continue
            if wanted in runs:
                r = b.launch(label, path, sets=keys, defaults=defaults)
                if r:
                    side[k] = r["curve"]
            elif label in earlier:
                side[k] = earlier[label]
                print(f"  {label}: the curve of --learning-curves", flush=True)
            if k in side:
                print_worst_step(label, side[k])
    if "amp" in runs:
        # The peers, one seed a GPU at once; a copy of gpt_baseline.py that prints every step's loss.
        source = peer_source(open(os.path.join(baselines, "gpt_baseline.py")).read(), True, "peer")
        if source is None:
            b.failures.append("learning: this gpt_baseline.py prints its loss differently")
            return
        copy = os.path.join(b.workdir, "gpt_baseline_every_step.py")
        with open(copy, "w") as f:
            f.write(source)
        theirs = learning_peers(b, n, baselines, copy, text, seeds, "eager", name, steps)
    else:
        theirs = {k: earlier[f"PyTorch AMP learning seed {k}"] for k in seeds
                  if f"PyTorch AMP learning seed {k}" in earlier}
    compare_learning(b, "ltrain", ours, theirs, seeds, report=True)
    if a.learning_default:
        compare_learning(b, "ltrain at the defaults", plain, theirs, seeds, report=False)
        compare_with_default(b, ours, plain, seeds)
    if a.learning_control and "amp" in runs:
        # The peer against itself: the same recipe under torch.compile (other kernels, other roundings).
        compiled = learning_peers(b, n, baselines, copy, text, seeds, "compile", name, steps)
        compare_learning(b, "PyTorch AMP compiled", compiled, theirs, seeds, report=False)
    b.dump()


# How a learning curve ends: (what, the loss it takes of a curve [(step, loss), ...]).
END_OF_CURVE = (("at the last step", lambda c: c[-1][1]),
                ("over the last 20 steps", lambda c: sum(x for _, x in c[-20:]) / len(c[-20:])))


def spikes(curve, factor=1.5, window=10):
    """The steps whose loss is above `factor` times the mean of the `window` steps before them."""
    return {curve[i][0] for i in range(window, len(curve))
            if curve[i][1] > factor * sum(x for _, x in curve[i - window:i]) / window}


def compare_with_default(b, ours, plain, seeds):
    """The --ltrain-set runs against the default runs of the same seeds: the mean loss at the end and over the
    last 20 steps, and the spikes the default runs do not also have."""
    both = [k for k in seeds if k in ours and k in plain]
    if not both:
        return
    for what, take in END_OF_CURVE:
        mine, theirs = (sum(take(c[k]) for k in both) / len(both) for c in (ours, plain))
        print(f"  mean loss {what}: ltrain {mine:.4f}, ltrain at the defaults {theirs:.4f} "
              f"({100 * (mine - theirs) / theirs:+.2f}%)", flush=True)
        b.results.append({"ratio": f"learning: mean loss {what} against ltrain at the defaults",
                          "value": mine / theirs})
    for k in both:
        own, base = spikes(ours[k]), spikes(plain[k])
        extra = sorted(own - base)
        print(f"  seed {k}: steps above 1.5x the mean of the 10 before: ltrain {sorted(own) or 'none'}, at the "
              f"defaults {sorted(base) or 'none'}; ltrain's alone: {extra or 'none'}", flush=True)
        b.results.append({"label": f"learning seed {k}: spikes the defaults do not have", "steps": extra})
        if extra:
            b.failures.append(f"learning seed {k}: steps {extra} above 1.5x their running mean, not at the defaults")


def learning_peers(b, n, baselines, copy, text, seeds, mode, name="gpt-124m", steps=200):
    """{seed: curve} of gpt_baseline.py (PyTorch AMP, `mode` eager or compile), the seeds at once, one a GPU."""
    env = peer_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [baselines, env.get("PYTHONPATH")]))
    procs = {}
    for k in seeds:
        shift = [] if k == 0 else ["-c", SHIFTED_SEEDS.format(k=k)]
        out = open(os.path.join(b.workdir, f"peer-learning-{mode}-seed{k}.log"), "w+")
        procs[k] = (subprocess.Popen([sys.executable, *shift, copy, "--model", name, "--data", text, "--steps",
                                      str(steps), "--mode", mode], stdout=out, stderr=subprocess.STDOUT,
                                     env=dict(env, CUDA_VISIBLE_DEVICES=str(k % n)), cwd=baselines), out)
    label = "PyTorch AMP" if mode == "eager" else f"PyTorch AMP {mode}"
    curves = {}
    for k, (p, out) in procs.items():
        p.wait(timeout=b.args.run_timeout)
        out.seek(0)
        curve = [(int(st) + 1, float(l)) for st, l in re.findall(r"step (\d+) loss ([0-9.]+)", out.read())]
        if len(curve) < steps:
            b.failures.append(f"{label} seed {k}: {len(curve)} steps")
            continue
        curves[k] = curve
        print_worst_step(f"{label} seed {k}", curve)
        b.results.append({"label": f"{label} learning seed {k}", "curve": curve})
    return curves


def compare_learning(b, name, ours, theirs, seeds, report):
    """Prints `name`'s curves against PyTorch AMP's (eager): the loss at the last step (and the mean over the last
    20) and the worst step of the mean
    over the seeds; `report` puts the ratios in the results as the suite's verdict."""
    both = [k for k in seeds if k in ours and k in theirs]
    if not both:
        return
    for k in both:
        print(f"  seed {k}: loss at the last step {name} {ours[k][-1][1]:.4f}, PyTorch AMP {theirs[k][-1][1]:.4f}",
              flush=True)
    prefix = "learning" if report else f"learning control ({name})"
    for what, take in END_OF_CURVE:
        mine, amp = (sum(take(c[k]) for k in both) / len(both) for c in (ours, theirs))
        print(f"  mean loss {what}: {name} {mine:.4f}, PyTorch AMP {amp:.4f} ({100 * (mine - amp) / amp:+.2f}%)",
              flush=True)
        b.results.append({"ratio": f"{prefix}: mean loss {what} against PyTorch AMP", "value": mine / amp})
    # Every step against PyTorch AMP's as it runs: the seeds' mean loss at each step, ours over AMP's
    # (a spike of our own shows here; one that AMP takes at the same step does not).
    worst = against_peer_by_step(ours, theirs, both)
    if worst:
        ratio, step = worst
        print(f"  every step, mean over the seeds: {name}'s worst against PyTorch AMP's {ratio:.3f} (step {step})",
              flush=True)
        b.results.append({"ratio": f"{prefix}: worst step's mean loss against PyTorch AMP's", "value": ratio,
                          "step": step})
        for k in both:
            r, st = against_peer_by_step(ours, theirs, [k])
            print(f"  seed {k}: {name}'s worst step against PyTorch AMP's at the same step {r:.3f} (step {st})",
                  flush=True)


def against_peer_by_step(ours, theirs, seeds):
    """(largest ratio, its step) of ltrain's mean loss over `seeds` at a step to PyTorch AMP's at the same step,
    over the steps every curve has; None when they share none."""
    steps = set.intersection(*(set(s for s, _ in c[k]) for k in seeds for c in (ours, theirs)))
    if not steps:
        return None
    by_step = [{k: dict(c[k]) for k in seeds} for c in (ours, theirs)]
    mean = lambda side, s: sum(side[k][s] for k in seeds) / len(seeds)
    return max((mean(by_step[0], s) / mean(by_step[1], s), s) for s in sorted(steps))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ltrain", required=True, help="the ltrain binary (its ltrain-worker beside it)")
    ap.add_argument("--baselines", help="the folder of gpt_fsdp.py and gpt_model.py (the peers)")
    ap.add_argument("--data", default="/usr/share/common-licenses",
                    help="text file(s) or a folder of them, made into byte tokens with `ltrain data prepare`")
    ap.add_argument("--suite", action="append", choices=["layouts", "zero3", "tp", "large", "llama", "llama-1b", "llama-3b", "moe", "gpt-1.3b",
                                                    "hub", "dp", "learning"])
    ap.add_argument("--learning-data", help="the learning suite's text (../shared/data/tinyshakespeare.txt)")
    ap.add_argument("--learning-seeds", type=int, default=0,
                    help="the learning suite's seeds (default: one a GPU, up to 4); more than the GPUs run "
                         "their PyTorch peers two or more to a GPU")
    ap.add_argument("--learning-model", default="gpt-124m", choices=sorted(LEARNING_MODELS),
                    help="the learning suite's model (default gpt-124m, micro-batch 16; gpt-350m at 8)")
    ap.add_argument("--learning-steps", type=int, default=200, help="the learning suite's steps (default 200)")
    ap.add_argument("--learning-default", action="store_true",
                    help="the learning suite also runs ltrain at the recipe's defaults (without --ltrain-set) "
                         "and compares the --ltrain-set runs with them")
    ap.add_argument("--learning-runs", default="ltrain,default,amp",
                    help="which of the learning suite's runs happen here (comma-separated: ltrain, default, "
                         "amp); the others' curves come from --learning-curves")
    ap.add_argument("--learning-curves", action="append", metavar="FILE",
                    help="an earlier --json of the learning suite: the curves of the runs not made here")
    ap.add_argument("--learning-control", action="store_true",
                    help="the learning suite also runs gpt_baseline.py under torch.compile and prints it against "
                         "the eager runs, as ltrain's are: how far the peer parts from itself with other kernels")
    ap.add_argument("--reference", help="another build's ltrain: gpt-1.3b on one GPU through both")
    ap.add_argument("--reference-rounds", type=int, default=2, help="--reference: runs of each build (default 2)")
    ap.add_argument("--reference-model", action="append", choices=["gpt-1.3b", "gpt-124m", "llama-1b"],
                    help="--reference: the model (repeatable; default gpt-1.3b; gpt-124m is the learning "
                         "suite's, byte vocab, 16 sequences a step, 100 steps; llama-1b the llama-1b suite's)")
    ap.add_argument("--reference-set", action="append", default=[], metavar="KEY=VALUE",
                    help="--reference: a recipe override for the reference build's runs (repeatable; another "
                         "build does not take --ltrain-set, whose keys it may not know)")
    ap.add_argument("--reference-env", action="append", default=[], metavar="NAME=VALUE",
                    help="--reference: set in the environment of the reference build's runs only (repeatable); "
                         "with this build as the reference, an A/B of a worker setting")
    ap.add_argument("--gpus", type=int, default=0, help="use this many GPUs (default: every one)")
    ap.add_argument("--ltrain-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the environment of every ltrain launch (repeatable; `ltrain-worker --help` "
                         "lists the worker's variables)")
    ap.add_argument("--ltrain-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override (`ltrain launch --set`) for every ltrain job of this build "
                         "(repeatable; e.g. parallel.precision=bf16)")
    ap.add_argument("--peer-mode", default="both", choices=["eager", "compile", "both"],
                    help="llama-1b, llama-3b, moe and gpt-1.3b: the one-process peers' modes (default both)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--run-timeout", type=int, default=900, help="seconds one job or peer may take")
    ap.add_argument("--workdir", help="recipes, tokens and logs (default: a new temporary folder)")
    args = ap.parse_args()
    args.ltrain_env = dict(kv.split("=", 1) for kv in args.ltrain_env)
    args.reference_env = dict(kv.split("=", 1) for kv in args.reference_env)
    suites = args.suite or ([] if args.reference else ["layouts"])
    n = args.gpus or gpus()
    if n == 0:
        print("skipped: 1 GPU(s) needed, 0 here", flush=True)
        return 77
    if any(s in suites for s in ("zero3", "large", "llama", "llama-1b", "llama-3b", "moe", "gpt-1.3b", "hub",
                                 "learning")) and not args.baselines:
        ap.error("--suite zero3, large, llama, llama-1b, llama-3b, moe, gpt-1.3b, hub and learning need --baselines "
                 "(the folder of the peers)")
    if "learning" in suites and not args.learning_data:
        ap.error("--suite learning needs --learning-data")
    workdir = args.workdir or tempfile.mkdtemp(prefix="ltrain-launch-bench-")
    os.makedirs(workdir, exist_ok=True)
    texts = [os.path.join(args.data, f) for f in sorted(os.listdir(args.data))] if os.path.isdir(args.data) else [args.data]
    args.token_dir = os.path.join(workdir, "tokens")
    prepare = subprocess.run([args.ltrain, "data", "prepare", "--quiet", "--overwrite", "--input", *texts, "--output",
                              args.token_dir],
                             capture_output=True, text=True)
    if prepare.returncode != 0:
        print(f"launch_bench: ltrain data prepare failed: {prepare.stderr.strip()}", flush=True)
        return 1
    b = Bench(args, workdir)
    here = os.path.dirname(os.path.abspath(__file__))
    baselines = os.path.abspath(args.baselines) if args.baselines else None
    print(f"launch_bench: {n} GPU(s), logs in {workdir}", flush=True)
    for s in suites:
        if s == "layouts":
            suite_layouts(b, n)
        elif s == "zero3":
            suite_zero3(b, n, baselines, here)
        elif s == "tp" and n >= 2:
            suite_tp(b, n)
        elif s == "large" and n >= 8:
            suite_large(b, n, baselines)
        elif s == "llama":
            suite_llama(b, n, baselines)
        elif s == "llama-1b":
            suite_llama_1b(b, baselines)
        elif s == "llama-3b":
            suite_llama_3b(b, baselines)
        elif s == "moe":
            suite_moe(b, baselines, here)
        elif s == "gpt-1.3b":
            suite_gpt_1_3b(b, baselines)
        elif s == "hub":
            suite_hub(b, baselines, here)
        elif s == "dp" and n >= 2:
            suite_dp(b, n)
        elif s == "learning":
            suite_learning(b, n, baselines, os.path.abspath(args.learning_data))
        else:
            print(f"{s}: skipped: needs more GPUs than {n}", flush=True)
    if args.reference:
        for model in args.reference_model or ["gpt-1.3b"]:
            suite_reference(b, args.reference, args.reference_rounds, model)
    if b.failures:
        print(f"launch_bench: {len(b.failures)} failed: " + "; ".join(b.failures), flush=True)
        return 1
    print("launch_bench: every run passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
