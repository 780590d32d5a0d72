#!/usr/bin/env python3
"""Restart time, ltrain against torchrun, side by side on one host.

Both run a 2-process job (NCCL on 2 GPUs, or Gloo on CPUs with --backend gloo); rank 1 dies at step 20;
each tool restarts both processes. The figure is the wall time from the crash to the first completed step
after the restart.

    tests/bench/restart_bench.py --ltrain build/cmd/ltrain --baselines DIR [--backend nccl|gloo] [--repeat N]

DIR holds torchrun_recovery.py (the peer). Exits 77 (skipped) when the backend cannot run here.
"""
import argparse, json, os, re, shutil, signal, subprocess, sys, tempfile, time

from benchlib import gpus, licence_texts, peer_env


def torchrun_once(baselines, backend, env):
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
           os.path.join(baselines, "torchrun_recovery.py"), backend]
    t_start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    crash = first = None
    first_step0 = None
    for line in p.stdout.splitlines():
        m = re.search(r"CRASH t=([0-9.]+)", line)
        if m:
            crash = float(m.group(1))
        m = re.search(r"FIRST_STEP restart=(\d+) t=([0-9.]+)", line)
        if m and m.group(1) == "0":
            first_step0 = float(m.group(2))
        if m and m.group(1) == "1":
            first = float(m.group(2))
    if crash is None or first is None:
        return {"ok": False, "why": (p.stdout + p.stderr)[-2000:]}
    return {"ok": True, "restart_s": first - crash, "launch_to_first_step_s": first_step0 - t_start}


def ltrain_once(ltrain, backend, data_dir, home):
    os.makedirs(home, exist_ok=True)
    recipe = os.path.join(home, "restart.yaml")
    device = "cuda" if backend == "nccl" else "cpu"
    with open(recipe, "w") as f:
        f.write(f"""name: restart
model: {{layers: 2, d_model: 256, heads: 4, seq_len: 64, vocab: 256}}
data: {{path: {data_dir}}}
training: {{steps: 40, micro_batch: 8, global_batch: 16, log_every: 1}}
parallel: {{nodes: 1, nproc_per_node: 2, device: {device}}}
checkpoint: {{every: 5, keep: 2}}
fault: {{max_restarts: 1, restart_backoff_s: 0}}
""")
    env = dict(os.environ, LTRAIN_HOME=home)
    t_start = time.time()
    p = subprocess.Popen([ltrain, "launch", recipe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, bufsize=1)
    crash = first = first_step0 = None
    restarted = False
    lines = []
    for line in p.stdout:
        now = time.time()
        lines.append(line)
        if first_step0 is None and line.startswith("[rank 0] step 1/"):
            first_step0 = now
        if crash is None and line.startswith("[rank 0] step 20/"):
            status = subprocess.run([ltrain, "status", "restart-1", "--output", "json"], capture_output=True,
                                    text=True, env=env)
            ranks = json.loads(status.stdout).get("ranks", [])
            pid = int(next(r["pid"] for r in ranks if r["rank"] == 1))
            crash = time.time()
            os.kill(pid, signal.SIGKILL)
        if crash is not None and "generation 1: placed" in line:
            restarted = True
        if restarted and first is None and re.match(r"\[rank 0\] step \d+/", line):
            first = now
    p.wait(timeout=300)
    if p.returncode != 0 or crash is None or first is None:
        return {"ok": False, "why": "".join(lines[-40:])}
    return {"ok": True, "restart_s": first - crash, "launch_to_first_step_s": first_step0 - t_start}


def main():
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--ltrain", required=True)
    a.add_argument("--baselines", required=True)
    a.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    a.add_argument("--repeat", type=int, default=3)
    a.add_argument("--data", help="a text file to train on (default: the licence texts of /usr/share/common-licenses)")
    args = a.parse_args()
    if args.backend == "nccl" and gpus() < 2:
        print("skipped: fewer than 2 GPUs")
        return 77
    if shutil.which("torchrun") is None:
        print("skipped: torchrun is not installed")
        return 77
    work = tempfile.mkdtemp(prefix="ltrain-restart-bench-")
    data_dir = os.path.join(work, "data")
    inputs = [args.data] if args.data else licence_texts()
    subprocess.run([args.ltrain, "data", "prepare", "--overwrite", "--input", *inputs, "--output", data_dir], check=True,
                   capture_output=True)
    env = peer_env()
    if args.backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "lo"
    rows = []
    for i in range(args.repeat):
        t = torchrun_once(args.baselines, args.backend, env)
        l = ltrain_once(args.ltrain, args.backend, data_dir, os.path.join(work, f"home{i}"))
        rows.append((t, l))
        tr = f"{t['restart_s']:.2f} s" if t["ok"] else "FAILED"
        lr = f"{l['restart_s']:.2f} s" if l["ok"] else "FAILED"
        print(f"try {i + 1}: crash -> first step after restart: torchrun {tr}, ltrain {lr}", flush=True)
        if not l["ok"]:
            print("ltrain output:\n" + l["why"], flush=True)
        if not t["ok"]:
            print("torchrun output (tail):\n" + t["why"][-3000:], flush=True)
    ok_t = [t["restart_s"] for t, _ in rows if t["ok"]]
    ok_l = [l["restart_s"] for _, l in rows if l["ok"]]
    print(f"\nbackend {args.backend}, {args.repeat} tries: torchrun restarted {len(ok_t)}/{args.repeat}, "
          f"ltrain {len(ok_l)}/{args.repeat}")
    if ok_l:
        print(f"ltrain   crash -> first step: median {sorted(ok_l)[len(ok_l) // 2]:.2f} s (min {min(ok_l):.2f}, max {max(ok_l):.2f})")
    if ok_t:
        print(f"torchrun crash -> first step: median {sorted(ok_t)[len(ok_t) // 2]:.2f} s (min {min(ok_t):.2f}, max {max(ok_t):.2f})")
    if ok_l and ok_t:
        ratio = sorted(ok_l)[len(ok_l) // 2] / sorted(ok_t)[len(ok_t) // 2]
        print(f"ratio ltrain/torchrun: {ratio:.2f} (target <= 0.50)")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if len(ok_l) == args.repeat else 1


if __name__ == "__main__":
    sys.exit(main())
