#!/usr/bin/env python3
"""Training throughput on GPUs, the ltrain worker against PyTorch, side by side on one host.

Trains the benchmark models of gpt_model.py (GPT-2 architecture, sequence 2048, vocab 50304, bf16) with
the worker and with the PyTorch peers, in this one run on these cards, and prints for each: tokens/s per
GPU, TFLOP/s per GPU (6N + 12*L*d*T per token), MFU against 989 TFLOP/s, peak memory, and the ratio of the
worker to the peer.

    tests/bench/gpu_throughput.py --worker build-gpu/cmd/ltrain-worker --baselines DIR [--suite single]

Suites (--suite, repeatable):
  single    1 GPU: gpt-124m, gpt-350m, gpt-1.3b; the worker, gpt_baseline.py eager and torch.compile
  dp        2 GPUs: gpt-1.3b data parallel; the worker on 1 and 2 GPUs, gpt_ddp.py under torchrun
  layouts   2 GPUs: gpt-1.3b with tp2 and pp2 (1F1B); 4 GPUs (when present): tp2 x dp2
  learning  1 GPU: gpt-124m on byte tokens of --data for 200 steps, the worker's loss against gpt_baseline.py
  profile   1 GPU: one step of the worker (--profile-model, gpt-1.3b; --profile-steps for a window of
            steps; --profile-text for a text's bytes instead of random tokens) under the CUDA profiler,
            kernel time by kind
  large     8 GPUs (4: the same layouts scaled down): a GPT of about 7B (32 layers, d 4096, 32 heads)
            with tp8, tp4 x dp2, tp2 x pp2 x dp2 (interleaved 1F1B) and dp8 ZeRO-3, 20 steps each; then
            gpt-1.3b data parallel on every GPU against gpt_ddp.py

DIR holds gpt_baseline.py, gpt_ddp.py and gpt_model.py. --json FILE writes every figure (rewritten
after each one). Every line is flushed as it is printed: send the output to a file, not through a
pipe that prints only at the end. Exits 77 (skipped) without the GPUs a chosen suite needs.
"""
import argparse, collections, json, os, re, struct, subprocess, sys, tempfile, time

from benchlib import gpus, peer_env

MODELS = {  # name: layers, d_model, heads, micro_batch (gpt_baseline.py's table)
    "gpt-124m": (12, 768, 12, 16),
    "gpt-350m": (24, 1024, 16, 8),
    "gpt-1.3b": (24, 2048, 16, 8),
    "gpt-7b": (32, 4096, 32, 1),  # not in gpt_baseline.py: the worker only (large suite)
}
SEQ, VOCAB = 2048, 50304


def write_tokens(path, tokens, vocab):
    """A token file as `ltrain data prepare` writes it (common/token_data.h)."""
    with open(path, "wb") as f:
        f.write(b"LTRNTOK1" + struct.pack("<IIQI", 1, vocab, len(tokens) // 2, 2))
        f.write(tokens)


def random_data(root, vocab, count=8_000_000):
    os.makedirs(root, exist_ok=True)
    import random
    rnd = random.Random(0)
    raw = bytearray(count * 2)
    for i in range(count):
        struct.pack_into("<H", raw, 2 * i, rnd.randrange(vocab))
    write_tokens(os.path.join(root, "train.bin"), bytes(raw), vocab)
    write_tokens(os.path.join(root, "val.bin"), bytes(raw[: 2 * 100_000]), vocab)
    return root


def byte_data(root, text_file):
    os.makedirs(root, exist_ok=True)
    data = open(text_file, "rb").read()
    raw = b"".join(struct.pack("<H", b) for b in data)
    write_tokens(os.path.join(root, "train.bin"), raw, 256)
    write_tokens(os.path.join(root, "val.bin"), raw[: 2 * 10_000], 256)
    return root


# Runs gpt_baseline.py (argv[1:]) with its parameter seed and its batch generator's seed moved by k.
SHIFTED_SEEDS = """
import runpy, sys, torch
_manual_seed, _Generator = torch.manual_seed, torch.Generator
torch.manual_seed = lambda s: _manual_seed(s + {k})
class _Shifted:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
    def manual_seed(self, s):
        return _Generator(*self.args, **self.kwargs).manual_seed(s + {k})
torch.Generator = _Shifted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


PRECISION = "bf16"
SEED = 0


def peer_source(source, every_step, optimizer):
    """gpt_baseline.py's source changed to print its loss after every step (every_step) and to train with
    OPTIMIZERS[optimizer] as the worker does: AdamW with decay on matrices and embeddings only, the linear
    warm-up, the cosine decay, clipping. None when the script is not the one these edits know."""
    if every_step:
        if "if i % 10 == 0 or i == steps - 1:" not in source:
            return None
        source = source.replace("if i % 10 == 0 or i == steps - 1:", "if True:")
    if optimizer == "peer":
        return source
    o = OPTIMIZERS[optimizer]
    old_opt = "    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)\n"
    old_step = "        loss.backward()\n        opt.step()\n"
    if old_opt not in source or old_step not in source:
        return None
    new_opt = f"""    import math
    groups = [{{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": {o["decay"]}}},
              {{"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}}]
    opt = torch.optim.AdamW(groups, lr={o["lr"]}, betas=(0.9, {o["beta2"]}), fused=True)

    def lr_at(i):  # ltrain's schedule (worker/plan/lr_schedule.cc), i counted from 0
        if i < {o["warmup"]}:
            return {o["lr"]} * (i + 1) / {o["warmup"]}
        if "{o["schedule"]}" == "constant":
            return {o["lr"]}
        progress = min(1.0, (i - {o["warmup"]}) / max(1, steps - {o["warmup"]}))
        return {o["min_lr"]} + 0.5 * (1 + math.cos(math.pi * progress)) * ({o["lr"]} - {o["min_lr"]})
    done = [0]
"""
    new_step = f"""        loss.backward()
        if {o["clip"]} > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), {o["clip"]})
        for group in opt.param_groups:
            group["lr"] = lr_at(done[0])
        done[0] += 1
        opt.step()
"""
    return source.replace(old_opt, new_opt).replace(old_step, new_step)


def print_worst_step(label, curve):
    """The step whose loss is the largest multiple of the mean of the 10 steps before it (a one-step jump)."""
    if len(curve) < 11 or any(b - a != 1 for (a, _), (b, _) in zip(curve, curve[1:])):
        return  # needs the loss of every step
    ratio, step, loss = max((curve[i][1] / (sum(x for _, x in curve[i - 10:i]) / 10), curve[i][0], curve[i][1])
                            for i in range(10, len(curve)))
    print(f"  {label}: worst step against the mean of the 10 before it {ratio:.2f} (step {step}, loss {loss:.3f})",
          flush=True)


# The optimizer keys of the benchmark recipes. peer: the peers' optimizer (AdamW lr 3e-4, betas 0.9/0.999,
# weight decay 0.01, no clipping, no schedule). recipe: ltrain's recipe defaults (warm-up 10, clipping at
# 1.0, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings) at the peers' constant lr 3e-4.
# recipe-cosine: every optimizer key at its recipe default (lr 1e-3 with cosine decay to 1e-4 too).
OPTIMIZERS = {
    "peer": dict(lr=3e-4, min_lr=3e-4, warmup=0, schedule="constant", decay=0.01, beta2=0.999, clip=0),
    "recipe": dict(lr=3e-4, min_lr=3e-4, warmup=10, schedule="constant", decay=0.1, beta2=0.95, clip=1.0),
    "recipe-cosine": dict(lr=1e-3, min_lr=1e-4, warmup=10, schedule="cosine", decay=0.1, beta2=0.95, clip=1.0),
}


def recipe(path, model, data, steps, world, micro_batch=None, vocab=VOCAB, log_every=5, data_keys="", warmup=0,
           optimizer="peer", **parallel):
    layers, d, heads, mb = MODELS[model]
    mb = micro_batch or mb
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    dp = world // (tp * pp)
    accumulation = parallel.pop("accumulation", 1)
    extra = "".join(f", {k}: {v}" for k, v in parallel.items())
    o = OPTIMIZERS[optimizer]
    with open(path, "w") as f:
        # `warmup` (peer optimizer): a linear ramp over that many steps first.
        f.write(f"""name: bench
model: {{layers: {layers}, d_model: {d}, heads: {heads}, seq_len: {SEQ}, vocab: {vocab}}}
data: {{path: {data}{data_keys}}}
training: {{steps: {steps}, micro_batch: {mb}, global_batch: {mb * dp * accumulation}, lr: {o["lr"]}, min_lr: {o["min_lr"]},
  warmup_steps: {warmup or o["warmup"]}, lr_schedule: {o["schedule"]}, weight_decay: {o["decay"]}, beta1: 0.9,
  beta2: {o["beta2"]}, grad_clip: {o["clip"]}, seed: {SEED}, log_every: {log_every}}}
parallel: {{nodes: 1, nproc_per_node: {world}, device: cuda, precision: {PRECISION}{extra}}}
checkpoint: {{enabled: false}}
""")
    return path


def run_worker(worker, recipe_path, world, workdir, extra_env=None, timeout=900):
    """Starts `world` ranks by hand (file rendezvous) and returns rank 0's output."""
    rdzv = tempfile.mkdtemp(dir=workdir, prefix="rdzv-")
    procs = []
    for rank in range(world):
        env = dict(os.environ, LTRAIN_RANK=str(rank), LTRAIN_LOCAL_RANK=str(rank), LTRAIN_WORLD_SIZE=str(world),
                   LTRAIN_LOCAL_WORLD_SIZE=str(world), LTRAIN_RDZV="file://" + rdzv, LTRAIN_RDZV_SCOPE="bench",
                   LTRAIN_JOB_ID="bench")
        env.update(extra_env or {})
        out = open(os.path.join(rdzv, f"rank-{rank}.log"), "w+")
        procs.append((subprocess.Popen([worker, "--recipe", recipe_path], stdout=out, stderr=subprocess.STDOUT,
                                       env=env), out))
    deadline = time.time() + timeout
    codes = []
    for p, _ in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            codes.append(-9)
    logs = []
    for _, out in procs:
        out.seek(0)
        logs.append(out.read())
        out.close()
    return codes, logs


LOSS_RE = r"step (\d+)/\d+ loss ([0-9.]+)"  # the worker's step lines: step and loss


def parse_worker(log):
    m = re.search(r"throughput: steps (\d+)-(\d+) step_ms ([0-9.]+) tok/s (\d+) tok/s/device (\d+) "
                  r"tflops/device ([0-9.]+) mfu ([0-9.]+)% peak_mem_gib ([0-9.]+)", log)
    if not m:
        return None
    losses = [float(l) for _, l in re.findall(LOSS_RE, log)]
    return {"tok_s_gpu": float(m.group(5)), "tflops_gpu": float(m.group(6)), "mfu": float(m.group(7)),
            "peak_gib": float(m.group(8)), "step_ms": float(m.group(3)),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}


def parse_peer(out):
    rows = {}
    # gpt_ddp.py prints no peak memory: it is then reported as 0.
    for m in re.finditer(r"pytorch(?:-ddp world=\d+)? (\S+) (eager|compile) .*?tok/s(?:/GPU)?=([0-9,]+) "
                         r"TFLOP/s(?:/GPU)?=([0-9.]+)(?:.*?peak_mem=([0-9.]+)GiB)?", out):
        rows[(m.group(1), m.group(2))] = {"tok_s_gpu": float(m.group(3).replace(",", "")),
                                           "tflops_gpu": float(m.group(4)), "mfu": float(m.group(4)) / 9.89,
                                           "peak_gib": float(m.group(5) or 0)}
    return rows


def show(label, r):
    if r is None:
        print(f"  {label:<34} FAILED", flush=True)
        return
    loss = ""
    if r.get("first_loss") is not None:
        loss = f" loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}"
    print(f"  {label:<34} {r['tok_s_gpu']:>10,.0f} tok/s/GPU {r['tflops_gpu']:>6.1f} TFLOP/s/GPU "
          f"MFU {r['mfu']:5.1f}% peak {r['peak_gib']:5.1f} GiB{loss}", flush=True)


def ratio(a, b):
    return a["tok_s_gpu"] / b["tok_s_gpu"] if a and b else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--baselines", required=True)
    ap.add_argument("--suite", action="append", choices=["single", "dp", "layouts", "learning", "profile", "large"])
    ap.add_argument("--models", default="gpt-124m,gpt-350m,gpt-1.3b")
    ap.add_argument("--profile-model", default="gpt-1.3b", help="the profile suite's model")
    ap.add_argument("--profile-vocab", type=int, default=VOCAB,
                    help="the profile suite's vocabulary (random tokens below it; 256 for the learning suite's "
                         "byte vocabulary)")
    ap.add_argument("--profile-text", metavar="FILE",
                    help="the profile suite trains on this text's bytes instead of random tokens (real text's "
                         "skewed token counts cost what uniform ones do not, e.g. in the embedding's gradient)")
    ap.add_argument("--profile-steps", default="5",
                    help="the profile suite's steps, STEP or FIRST-LAST (LTRAIN_PROFILE); a window shows the "
                         "gaps between steps")
    ap.add_argument("--steps", type=int, default=15, help="worker steps (the first 3 are warm-up)")
    ap.add_argument("--data", help="text file for the learning suite")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--precision", default="auto",
                    choices=["auto", "bf16", "bf16-autocast", "bf16-fp32-residual", "fp32", "fp8"],
                    help="the worker's parallel.precision (default auto, the recipe default)")
    ap.add_argument("--layouts", default="tp2,pp2,tp2dp2",
                    help="which of the layouts suite's runs (tp2, pp2 on 2 GPUs; tp2dp2 on 4)")
    ap.add_argument("--dp-env", action="append",
                    help="dp suite: one more dp2 run of the worker with these variables (NAME=V[,NAME=V...])")
    ap.add_argument("--dp-parallel", action="append",
                    help="dp suite: one more dp run of the worker with these recipe parallel keys "
                         "(KEY=V[,KEY=V...], e.g. zero=1 or bucket_mb=200)")
    ap.add_argument("--dp-profile", metavar="KEY=V[,KEY=V...]",
                    help="dp suite: also profile one dp step with these recipe parallel keys (e.g. zero=0 or "
                         "zero=1,bucket_mb=400) and show how much of the collectives it hides")
    ap.add_argument("--seed", type=int, default=0, help="the worker's training.seed (initialization and data order)")
    ap.add_argument("--peer-seeds", default="0",
                    help="learning suite: gpt_baseline.py also with its seeds moved by these amounts "
                         "(comma-separated; 0 is the script as it is)")
    ap.add_argument("--learning-seeds", default="0",
                    help="learning suite: the worker's seeds, comma-separated (0 starts where PyTorch does)")
    ap.add_argument("--log-every", type=int, default=10, help="learning suite: the worker's loss every this many steps")
    ap.add_argument("--peer-every-step", action="store_true",
                    help="learning suite: gpt_baseline.py's loss after every step too (a copy that prints each one)")
    ap.add_argument("--learning-optimizer", default="peer", choices=sorted(OPTIMIZERS),
                    help="learning suite: peer (default): both sides train with gpt_baseline.py's optimizer (AdamW "
                         "3e-4, betas 0.9/0.999, decay 0.01, no clipping, no schedule); recipe: both with ltrain's "
                         "recipe defaults (warm-up 10, clipping at 1.0, betas 0.9/0.95, decay 0.1 on matrices and "
                         "embeddings) at lr 3e-4 held; recipe-cosine: the same at lr 1e-3 with cosine decay to 1e-4. "
                         "Other than peer, the PyTorch side is a copy of gpt_baseline.py with that optimizer")
    ap.add_argument("--sampling", default="torch", choices=["torch", "hash"],
                    help="learning suite: the worker's data.sampling. torch (default): the batches that "
                         "gpt_baseline.py draws for the same seed; hash: batches of the worker's own")
    ap.add_argument("--run-timeout", type=int, default=900,
                    help="seconds before a worker run is killed and its ranks' logs printed (default 900)")
    ap.add_argument("--no-peer", action="store_true", help="the worker only (for quick iterations; no ratios)")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    a.baselines = os.path.abspath(a.baselines)
    global PRECISION, SEED
    PRECISION, SEED = a.precision, a.seed
    a.worker = os.path.abspath(a.worker)
    suites = a.suite or ["single"]
    need = max({"single": 1, "dp": 2, "layouts": 2, "learning": 1, "profile": 1, "large": 4}[s] for s in suites)
    have = gpus()
    if have < need:
        print(f"skipped: {need} GPU(s) needed, {have} here")
        return 77
    work = a.workdir or tempfile.mkdtemp(prefix="ltrain-bench-")
    os.makedirs(work, exist_ok=True)
    data = random_data(os.path.join(work, "data-random"), VOCAB)
    results = {}
    peer = os.path.join(a.baselines, "gpt_baseline.py")

    def worker_run(key, model, world, **kw):
        env = kw.pop("env", None)
        path = recipe(os.path.join(work, key + ".yaml"), model, kw.pop("data", data), kw.pop("steps", a.steps), world, **kw)
        t0 = time.time()
        codes, logs = run_worker(a.worker, path, world, work, env, timeout=a.run_timeout)
        r = parse_worker(logs[0])
        if any(codes) or r is None:
            print(f"worker {key}: exit codes {codes}\n" + logs[0][-3000:], flush=True)
            for i, log in enumerate(logs[1:], 1):
                if codes[i]:
                    print(f"rank {i}:\n" + log[-2000:], flush=True)
            r = None
        else:
            r["wall_s"] = round(time.time() - t0, 1)
        results[key] = r
        save()
        return r, logs

    def save():
        # After every figure, so that a run cut short still leaves what it measured.
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)

    if "single" in suites:
        print("== 1 GPU: worker against gpt_baseline.py (eager, torch.compile) ==", flush=True)
        for model in a.models.split(","):
            w, _ = worker_run(f"worker-1gpu-{model}", model, 1)
            if a.no_peer:
                show(f"{model} ltrain worker", w)
                continue
            p = subprocess.run([sys.executable, peer, "--model", model, "--mode", "both"], capture_output=True,
                               text=True, env=peer_env(), cwd=a.baselines, timeout=1200)
            rows = parse_peer(p.stdout)
            if not rows:
                print(p.stdout[-2000:] + p.stderr[-3000:], flush=True)
            eager, comp = rows.get((model, "eager")), rows.get((model, "compile"))
            results[f"pytorch-eager-1gpu-{model}"], results[f"pytorch-compile-1gpu-{model}"] = eager, comp
            print(f"{model}:", flush=True)
            show("ltrain worker", w)
            show("pytorch eager", eager)
            show("pytorch torch.compile", comp)
            re_, rc = ratio(w, eager), ratio(w, comp)
            print(f"  ratio worker/eager {re_:.3f}  worker/compile {rc:.3f}" if re_ and rc else "  ratio: n/a", flush=True)
            results[f"ratio-1gpu-{model}"] = {"eager": re_, "compile": rc}

    def data_parallel(n):
        """gpt-1.3b on n GPUs: the worker on 1 and n GPUs, gpt_ddp.py under torchrun (eager, compile)."""
        print(f"== {n} GPUs, data parallel, gpt-1.3b ==", flush=True)
        shaping = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "CUDA_DEVICE_MAX", "TORCH_NCCL"))}
        print("  environment: " + (" ".join(f"{k}={v}" for k, v in sorted(shaping.items())) or "no NCCL_* variables"),
              flush=True)
        one = results.get("worker-1gpu-gpt-1.3b")
        if one is None:
            one, _ = worker_run("worker-1gpu-gpt-1.3b", "gpt-1.3b", 1)
        many, _ = worker_run(f"worker-dp{n}-gpt-1.3b", "gpt-1.3b", n)
        rows = {}
        if not a.no_peer:
            p = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", str(n),
                                os.path.join(a.baselines, "gpt_ddp.py"), "--model", "gpt-1.3b", "--mode", "both"],
                               capture_output=True, text=True, env=peer_env(), cwd=a.baselines, timeout=1200)
            rows = parse_peer(p.stdout)
            if not rows:
                print(p.stdout[-2000:] + p.stderr[-3000:], flush=True)
        ddp_e, ddp_c = rows.get(("gpt-1.3b", "eager")), rows.get(("gpt-1.3b", "compile"))
        results[f"pytorch-ddp-eager-{n}gpu-gpt-1.3b"], results[f"pytorch-ddp-compile-{n}gpu-gpt-1.3b"] = ddp_e, ddp_c
        show("ltrain worker, 1 GPU", one)
        show(f"ltrain worker, dp{n}", many)
        if not a.no_peer:
            show("pytorch DDP eager", ddp_e)
            show("pytorch DDP + torch.compile", ddp_c)
        scaling, rc = ratio(many, one), ratio(many, ddp_c)
        print(f"  dp{n} per-GPU / 1 GPU {scaling:.3f}" if scaling else "  scaling: n/a", flush=True)
        if not a.no_peer:
            print(f"  ratio worker dp{n} / DDP+compile {rc:.3f}" if rc else "  ratio: n/a", flush=True)
        results[f"ratio-dp{n}-gpt-1.3b"] = {"scaling": scaling, "ddp_compile": rc, "ddp_eager": ratio(many, ddp_e)}
        pairs = lambda variant: dict(kv.split("=", 1) for kv in variant.split(","))
        if a.dp_profile is not None:
            trace = os.path.join(work, f"worker-dp{n}-step.json")
            worker_run(f"worker-dp{n}-profile-gpt-1.3b", "gpt-1.3b", n, steps=6, env={"LTRAIN_PROFILE": f"5:{trace}"},
                       **pairs(a.dp_profile))
            if os.path.exists(trace):
                print(f"  profile of one dp{n} step, {a.dp_profile} (rank 0):", flush=True)
                summarize_overlap(trace)
        # More dp runs of the worker: recipe parallel keys, then environment variables.
        variants = [(v, pairs(v)) for v in a.dp_parallel or []] + [(v, {"env": pairs(v)}) for v in a.dp_env or []]
        for variant, kw in variants:
            r, _ = worker_run(f"worker-dp{n}-{variant}-gpt-1.3b", "gpt-1.3b", n, **kw)
            show(f"ltrain worker, dp{n}, {variant}", r)
            if r and one:
                vs_ddp = ratio(r, ddp_c)
                print(f"    dp{n} per-GPU / 1 GPU {ratio(r, one):.3f}" +
                      (f"  ratio worker dp{n} / DDP+compile {vs_ddp:.3f}" if vs_ddp else ""), flush=True)
                results[f"ratio-dp{n}-{variant}-gpt-1.3b"] = {"scaling": ratio(r, one), "ddp_compile": vs_ddp}

    if "dp" in suites:
        data_parallel(2)

    if "large" in suites:
        # The GPT of about 7B with 3D layouts on every GPU of the host (8; on a 4-GPU host the same
        # layouts scaled to 4), 20 steps each, then gpt-1.3b data parallel on all of them.
        n = 8 if have >= 8 else 4
        print(f"== {n} GPUs: gpt-7b layouts, 20 steps each ==", flush=True)
        # Every layout steps on 8 sequences (micro-batch 1, accumulation filling the rest) after a
        # 5-step warm-up. At lr 3e-4 from step 0 with one or two sequences a step, tp4 and tp2 x dp2
        # ended 20 steps above where they began on 4 GPUs, while the layouts stepping on 4 and 8
        # sequences went down.
        base = dict(warmup=5)
        pipeline = dict(pp=2, pp_schedule="interleaved", virtual_stages=2)
        acc = lambda dp: dict(accumulation=8 // dp)
        if n == 8:
            layouts = [("tp8", dict(tp=8, **acc(1))), ("tp4 x dp2, ZeRO-1", dict(tp=4, zero=1, **acc(2))),
                       ("tp2 x pp2 x dp2, interleaved", dict(tp=2, **pipeline, **acc(2))),
                       ("dp8 ZeRO-3", dict(zero=3, **acc(8)))]
        else:
            # tp2 x dp2 holds half of the model's 16 bytes a parameter on each GPU: ZeRO-1 shards the
            # optimizer's part so that it fits 80 GB.
            layouts = [("tp4", dict(tp=4, **acc(1))), ("tp2 x dp2, ZeRO-1", dict(tp=2, zero=1, **acc(2))),
                       ("tp2 x pp2, interleaved", dict(tp=2, **pipeline, **acc(1))), ("dp4 ZeRO-3", dict(zero=3, **acc(4)))]
        for label, kw in layouts:
            key = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
            show(f"gpt-7b {label}", worker_run(f"worker-{key}-gpt-7b", "gpt-7b", n, steps=20, **base, **kw)[0])
        data_parallel(n)

    if "layouts" in suites:
        print("== gpt-1.3b layouts (no peer) ==", flush=True)
        runs = a.layouts.split(",")
        if "tp2" in runs:
            show("tp2", worker_run("worker-tp2-gpt-1.3b", "gpt-1.3b", 2, tp=2)[0])
        if "pp2" in runs:
            show("pp2 1F1B, 8 micro-batches", worker_run("worker-pp2-gpt-1.3b", "gpt-1.3b", 2, pp=2, pp_schedule="1f1b",
                                                        micro_batch=4, accumulation=8)[0])
        if "tp2dp2" in runs and have >= 4:
            show("tp2 x dp2", worker_run("worker-tp2dp2-gpt-1.3b", "gpt-1.3b", 4, tp=2)[0])

    if "learning" in suites:
        if not a.data:
            print("learning: --data is needed", flush=True)
            return 2
        print("== learning: gpt-124m, byte tokens, 200 steps ==", flush=True)
        bytes_dir = byte_data(os.path.join(work, "data-bytes"), a.data)
        curves = {}
        for seed in [int(x) for x in a.learning_seeds.split(",")]:
            # Seed k starts from the parameters of gpt_baseline.py with its seeds moved by k (and with
            # --sampling torch sees its batches: its generator's seed is 1234 + k).
            SEED = seed
            keys = f", sampling: torch, seed: {1234 + seed}" if a.sampling == "torch" else ""
            _, logs = worker_run(f"worker-learning-gpt-124m-seed{seed}", "gpt-124m", 1, data=bytes_dir, steps=200,
                                 vocab=256, log_every=a.log_every, data_keys=keys, optimizer=a.learning_optimizer)
            curves[seed] = [(int(st), float(l)) for st, l in re.findall(LOSS_RE, logs[0])]
            print(f"  worker seed {seed}:", " ".join(f"{st}:{l:.3f}" for st, l in curves[seed]), flush=True)
            print_worst_step(f"worker seed {seed}", curves[seed])
        SEED = a.seed
        if not a.no_peer:
            learning_peer = peer
            if a.peer_every_step or a.learning_optimizer != "peer":
                # A copy of the script printing its loss after every step, not every 10th (the spike
                # check), and/or training with the worker's optimizer settings.
                learning_peer = os.path.join(work, "gpt_baseline_learning.py")
                source = peer_source(open(peer).read(), a.peer_every_step, a.learning_optimizer)
                if source is None:
                    print("learning: --peer-every-step or --learning-optimizer does not know this gpt_baseline.py",
                          flush=True)
                    return 2
                with open(learning_peer, "w") as f:
                    f.write(source)

            learning_env = peer_env()  # the copy imports gpt_model from the baselines' folder
            learning_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(a.baselines),
                                                                       learning_env.get("PYTHONPATH")]))

            def peer_curve(k):
                """gpt_baseline.py's loss curve; k != 0: with its two seeds (parameters, batches) moved by k."""
                shift = [] if k == 0 else ["-c", SHIFTED_SEEDS.format(k=k)]
                q = subprocess.run([sys.executable, *shift, learning_peer, "--model", "gpt-124m", "--data", os.path.abspath(a.data),
                                    "--steps", "200", "--mode", "eager"], capture_output=True, text=True, env=learning_env,
                                   cwd=a.baselines, timeout=1200)
                return q, [(int(st), float(l)) for st, l in re.findall(r"step (\d+) loss ([0-9.]+)", q.stdout)]

            # Seed 0 is the script as it is; the others move its seeds, to set each worker seed beside the
            # peer run that starts from the same parameters (and batches), and to show the peer's spread.
            peer_runs = {}
            for k in sorted({0} | {int(x) for x in a.peer_seeds.split(",") if x}):
                q, losses = peer_curve(k)
                label = "pytorch:" if k == 0 else f"pytorch, seeds + {k}:"
                print(f"  {label}", " ".join(f"{st + 1}:{l:.3f}" for st, l in losses), flush=True)
                print_worst_step(label.rstrip(":"), [(st + 1, l) for st, l in losses])
                if not losses:
                    print(q.stdout[-2000:] + q.stderr[-2000:], flush=True)
                    continue
                peer_runs[k] = losses
                results[f"learning-pytorch-seeds+{k}"] = losses[-1][1]
            for seed, curve in curves.items():
                k = seed if seed in peer_runs else 0
                if curve and k in peer_runs:
                    wl, pl = curve[-1][1], peer_runs[k][-1][1]
                    print(f"  loss at step 200: worker (seed {seed}) {wl:.4f} pytorch (seeds + {k}) {pl:.4f} "
                          f"difference {100 * (wl - pl) / pl:+.2f}%", flush=True)
                    results[f"learning-seed{seed}"] = {"worker": wl, "pytorch": pl, "pytorch_seeds_moved_by": k,
                                                       "relative": (wl - pl) / pl}

    if "profile" in suites:
        m = a.profile_model
        last = int(a.profile_steps.split("-")[-1])
        print(f"== profile: {m}, step(s) {a.profile_steps} of the worker ==", flush=True)
        trace = os.path.join(work, "worker-step.json")
        extra = {}
        if a.profile_vocab != VOCAB:
            extra = {"vocab": a.profile_vocab,
                     "data": random_data(os.path.join(work, f"data-random-{a.profile_vocab}"), a.profile_vocab)}
        if a.profile_text:
            extra = {"vocab": a.profile_vocab, "data": byte_data(os.path.join(work, "data-text"), a.profile_text)}
        worker_run(f"worker-profile-{m}", m, 1, steps=last + 1, env={"LTRAIN_PROFILE": f"{a.profile_steps}:{trace}"},
                   **extra)
        if os.path.exists(trace):
            summarize_trace(trace)
            results["profile_trace"] = trace

    save()
    return 0


KINDS = [("gemm", r"gemm|cutlass|sm90_xmma|cublas|nvjet|splitK"), ("attention", r"flash|fmha|attention"),
         ("optimizer", r"adam|multi_tensor|foreach"), ("nccl", r"nccl"), ("layer_norm", r"layer_norm|LayerNorm"),
         ("softmax/cross-entropy", r"softmax|nll|log_softmax|cross_entropy"), ("gelu", r"gelu|GeluCUDA"),
         ("copy/cast", r"copy|cast|Memcpy|Memset"), ("reduce", r"reduce"), ("elementwise", r"elementwise|vectorized")]


def kernel_time_by_kind(kernels):
    by_kind = collections.Counter()
    for e in kernels:
        name = e.get("name", "")
        for kind, pattern in KINDS:
            if re.search(pattern, name, re.I):
                by_kind[kind] += e["dur"]
                break
        else:
            by_kind["other"] += e["dur"]
    return by_kind


def summarize_trace(path):
    events = json.load(open(path)).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        print("  no kernels in the trace", flush=True)
        return
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    by_kind, by_name = kernel_time_by_kind(kernels), collections.Counter()
    for e in kernels:
        by_name[e.get("name", "")[:90]] += e["dur"]
    span = end - start
    print(f"  on the GPU: {span / 1000:.1f} ms from first to last kernel, kernels busy {busy / 1000:.1f} ms "
          f"({100 * busy / span:.1f}%), {len(kernels)} kernels", flush=True)
    for kind, us in by_kind.most_common():
        print(f"  {kind:<24} {us / 1000:8.2f} ms {100 * us / busy:5.1f}%", flush=True)
    # The operator that launched each kernel (the CPU op with the kernel's External id).
    op_of = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "args" in e and "External id" in e["args"]:
            op_of.setdefault(e["args"]["External id"], e.get("name", "?"))
    by_op = collections.Counter()
    for e in kernels:
        ext = e.get("args", {}).get("External id")
        by_op[op_of.get(ext, "?")] += e["dur"]
    print("  kernel time by launching operator:", flush=True)
    for name, us in by_op.most_common(30):
        print(f"    {us / 1000:8.2f} ms  {name}", flush=True)
    print("  top kernels:", flush=True)
    for name, us in by_name.most_common(30):
        print(f"    {us / 1000:8.2f} ms  {name}", flush=True)


def union(intervals):
    """Merged [start, end) intervals, sorted."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def summarize_overlap(path):
    """Data parallel: how much of the collectives' time the computation hides, and how much slower
    the computation's kernels run while a collective runs beside them."""
    events = json.load(open(path)).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    comm = [e for e in kernels if "nccl" in e.get("name", "").lower()]
    compute = [e for e in kernels if "nccl" not in e.get("name", "").lower()]
    if not comm or not compute:
        print("  no collectives or no computation in the trace", flush=True)
        return
    comm_u = union((e["ts"], e["ts"] + e["dur"]) for e in comm)
    compute_u = union((e["ts"], e["ts"] + e["dur"]) for e in compute)
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)

    def covered(iv, by):
        total, j = 0.0, 0
        for a, b in iv:
            while j < len(by) and by[j][1] <= a:
                j += 1
            k = j
            while k < len(by) and by[k][0] < b:
                total += min(b, by[k][1]) - max(a, by[k][0])
                k += 1
        return total

    comm_time = sum(b - a for a, b in comm_u)
    hidden = covered(comm_u, compute_u)
    idle = (end - start) - sum(b - a for a, b in compute_u)
    print(f"  step {(end - start) / 1000:.1f} ms; collectives {comm_time / 1000:.1f} ms, of which hidden behind "
          f"computation {hidden / 1000:.1f} ms, exposed {(comm_time - hidden) / 1000:.1f} ms; the compute stream idle "
          f"{idle / 1000:.1f} ms", flush=True)
    print("  kernel time by kind (collectives included): " + ", ".join(
        f"{kind} {us / 1000:.2f} ms" for kind, us in kernel_time_by_kind(kernels).most_common()), flush=True)
    # Where the computation waits: the longest gaps between its kernels, with their neighbours.
    ordered = sorted(compute, key=lambda e: e["ts"])
    gaps, reach, last = [], ordered[0]["ts"] + ordered[0]["dur"], ordered[0]
    for e in ordered[1:]:
        if e["ts"] > reach:
            gaps.append((e["ts"] - reach, reach, last.get("name", "")[:45], e.get("name", "")[:45]))
        if e["ts"] + e["dur"] >= reach:
            reach, last = e["ts"] + e["dur"], e
    gaps.sort(reverse=True)
    print("  longest waits of the computation (at ms into the step, after -> before):", flush=True)
    for length, at, before, after in gaps[:10]:
        busy = covered([(at, at + length)], comm_u)
        print(f"    {length / 1000:6.2f} ms at {(at - start) / 1000:7.2f}, collectives running {busy / 1000:5.2f} ms: "
              f"{before} -> {after}", flush=True)
    # The same kernel, alone and beside a collective.
    alone, beside = collections.defaultdict(list), collections.defaultdict(list)
    for e in compute:
        overlap = covered([(e["ts"], e["ts"] + e["dur"])], comm_u)
        (beside if overlap > 0.5 * e["dur"] else alone)[e.get("name", "")[:70]].append(e["dur"])
    slower = []
    for name, durs in beside.items():
        if alone.get(name):
            base = sum(alone[name]) / len(alone[name])
            slower.append((sum(d - base for d in durs), name, len(durs), base, sum(durs) / len(durs)))
    slower.sort(reverse=True)
    print(f"  kernels slowed by the collectives beside them: {sum(x[0] for x in slower) / 1000:.1f} ms in all", flush=True)
    for extra, name, n, base, mean in slower[:8]:
        print(f"    {extra / 1000:7.2f} ms  {n:4d} x {base:8.1f} -> {mean:8.1f} us  {name}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
