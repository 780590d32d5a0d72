#!/usr/bin/env python3
"""Checkpoint save and load, ltrain against the disk and torch.distributed.checkpoint, in one run.

Suites (--suite, default all):
  save       2 GPUs: the disk's fsync'd write and its read bandwidth (dd), dcp_save.py under torchrun
             (gpt-1.3b + AdamW, 2 ranks), then `ltrain launch recipes/gpu-node-gpt-1.3b.yaml` on 2 GPUs
             (data parallel, ZeRO-1) for 60 steps with a checkpoint every 20, and a second launch that
             resumes from its last checkpoint (saving into another directory, as a resumed job does, so
             it reads into its pinned snapshot memory); prints each save's time and bandwidth, the time training
             was blocked per async save, the restore time, and their ratios to the disk and to DCP.
  kill-7b    4 GPUs: the large suite's GPT of about 7B (32 layers, d 4096, 32 heads), as dp4 ZeRO-3 and as
             tp2 x pp2 (--layout picks one): an uninterrupted run of 9 steps without checkpoints, and the
             same run with a checkpoint every 5 (about 84 GB each; only the newest is kept) whose rank 1
             is SIGKILLed as soon as the save of step 5 has committed, and one restart; the losses of
             steps 6-9 after the restart must be the uninterrupted run's, as printed (to the last
             digit). --tiny runs the same on 4 CPU processes with a small model (Gloo), to check the
             procedure anywhere.
  lost-work  2 GPUs: a gpt-124m-shaped job (12 layers, d 768, vocab 50304, 16 x 2048 tokens per GPU and
             step, as gpu-host.md's gpt-124m) with a checkpoint every 50
             steps and 2 restarts; rank 1 is killed 30 steps after the save of step 50; the job must
             resume from step 50 and succeed.

    tests/bench/checkpoint_bench.py --ltrain build/cmd/ltrain --baselines DIR [--dir CHECKPOINT_DISK_DIR]

DIR holds dcp_save.py and gpt_model.py (the peer). --dir is where every checkpoint and dd file goes
(default: a temporary directory on the disk of the current directory). Exits 77 (skipped) without 2
GPUs or torchrun.
"""
import argparse, json, os, re, shutil, signal, subprocess, sys, tempfile, time

from benchlib import gpus, licence_texts, peer_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drop_caches():
    """True when the page cache could be dropped (root on a host that allows it)."""
    subprocess.run(["sync"])
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dd_bandwidth(work):
    """GB/s of an fsync'd 4 GiB write and of reading it back (cache dropped, else O_DIRECT)."""
    path = os.path.join(work, "dd.bin")
    p = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", "count=256", "conv=fsync"],
                       capture_output=True, text=True)
    write = parse_dd(p.stderr)
    dropped = drop_caches()
    flags = [] if dropped else ["iflag=direct"]
    p = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", *flags], capture_output=True, text=True)
    read = parse_dd(p.stderr)
    os.remove(path)
    return write, read, "page cache dropped" if dropped else "O_DIRECT (the page cache could not be dropped)"


def parse_dd(text):
    m = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", text)
    return int(m.group(1)) / float(m.group(2)) / 1e9 if m else None


def dcp_save(baselines, work):
    out = os.path.join(work, "dcp")
    p = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", os.path.join(baselines, "dcp_save.py"),
                        "--baselines", baselines, "--dir", out], capture_output=True, text=True, env=peer_env(),
                       timeout=900)
    shutil.rmtree(out, ignore_errors=True)
    m = re.search(r"dcp state ([0-9.]+) GB: save ([0-9.]+) s", p.stdout)
    a = re.search(r"async_save blocked ([0-9.]+) s, total ([0-9.]+) s", p.stdout)
    if not m:
        return {"ok": False, "why": (p.stdout + p.stderr)[-3000:]}
    return {"ok": True, "gb": float(m.group(1)), "save_s": float(m.group(2)),
            "async_blocked_s": float(a.group(1)) if a else None, "async_total_s": float(a.group(2)) if a else None}


def launch(ltrain, args, home, on_line=None, timeout=1800):
    env = dict(os.environ, LTRAIN_HOME=home)
    p = subprocess.Popen([ltrain, "launch", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, bufsize=1)
    lines = []
    deadline = time.time() + timeout
    for line in p.stdout:
        lines.append(line)
        sys.stdout.write("  | " + line)
        if on_line:
            on_line(line, env)
        if time.time() > deadline:
            p.kill()
            break
    p.wait()
    return p.returncode, "".join(lines)


# "checkpoint step-20 written to DIR in 9512 ms (15.8 GB, 1.66 GB/s)"
SAVE_RE = re.compile(r"checkpoint step-(\d+) written to \S+ in (\d+) ms(?: \(([0-9.]+) GB)?(?:[^;\n]*; removed (\S+) in (\d+) ms)?")
BLOCKED_RE = re.compile(r"checkpoint: the training thread was blocked ([0-9.]+) ms in (\d+) (\w+) save\(s\)"
                        r"[^;\n]*(?:; after the last step it waited ([0-9.]+) ms)?")
# "resumed from DIR/step-60 at step 60 ... in 9.1 s (15.79 GB of the checkpoint, 1.74 GB/s; the ranks read
# 21.05 GB in 8.2 s on average, and rank 0 placed its part in 0.8 s)"
RESUME_RE = re.compile(r"resumed from \S+ at step (\d+).* in ([0-9.]+) s \(([0-9.]+) GB of the checkpoint"
                       r"(?:.*the ranks read ([0-9.]+) GB in ([0-9.]+) s)?(?:.*placed its part in ([0-9.]+) s)?")


def save_suite(a, work, data):
    print("== save: the disk, torch.distributed.checkpoint and ltrain (gpt-1.3b, 2 GPUs) ==", flush=True)
    write_gbs, read_gbs, read_how = dd_bandwidth(work)
    print(f"disk: write {write_gbs:.2f} GB/s (dd bs=16M count=256 conv=fsync), read {read_gbs:.2f} GB/s ({read_how})",
          flush=True)
    dcp = dcp_save(a.baselines, work)
    if dcp["ok"]:
        print(f"dcp: {dcp['gb']:.2f} GB saved in {dcp['save_s']:.1f} s; async_save blocked {dcp['async_blocked_s']} s, "
              f"total {dcp['async_total_s']} s", flush=True)
    else:
        print("dcp failed:\n" + dcp["why"], flush=True)
    home = os.path.join(work, "home")
    ck = os.path.join(work, "ltrain-ck")
    common = [os.path.join(REPO, "recipes", "gpu-node-gpt-1.3b.yaml"), "--set", f"data.path={data}",
              "--set", "parallel.nproc_per_node=2"]
    rc, out = launch(a.ltrain, common + ["--set", "training.steps=60", "--set", "checkpoint.every=20",
                                         "--set", f"checkpoint.dir={ck}"], home)
    saves = [(int(s), int(ms) / 1000.0, float(gb) if gb else None, removed, int(rms) / 1000.0 if rms else None)
             for s, ms, gb, removed, rms in SAVE_RE.findall(out)]
    write_after, _, _ = dd_bandwidth(work)
    print(f"disk after the run: write {write_after:.2f} GB/s (the same dd)", flush=True)
    blocked = BLOCKED_RE.search(out)
    ok = rc == 0 and len(saves) == 3
    print(f"ltrain train + save: exit {rc}, {'SUCCEEDED' if rc == 0 else 'FAILED'}", flush=True)
    cached = drop_caches()
    rc2, out2 = launch(a.ltrain, common + ["--set", "training.steps=61", "--set", f"checkpoint.resume_from={ck}",
                                           "--set", f"checkpoint.dir={os.path.join(work, 'ltrain-ck2')}"], home)
    resumed = RESUME_RE.search(out2)
    print("\nresults (one host, one run):")
    for step, s, gb, removed, removed_s in saves:
        gbs = gb / s if gb else None
        line = f"  ltrain save step-{step}: {s:.1f} s"
        if gb:
            line += f", {gb:.1f} GB, {gbs:.2f} GB/s = {gbs / write_gbs:.2f}x the disk's write"
        if dcp["ok"]:
            line += f"; {s / dcp['save_s']:.2f}x DCP's save time"
        if removed:
            line += f" (then removed {removed} in {removed_s:.1f} s)"
        print(line)
    if blocked:
        per = float(blocked.group(1)) / int(blocked.group(2)) / 1000
        line = f"  ltrain training blocked per {blocked.group(3)} save: {per:.2f} s"
        if dcp["ok"] and dcp["async_blocked_s"] is not None:
            line += f" (DCP async_save: {dcp['async_blocked_s']:.1f} s)"
        if blocked.group(4):
            line += f"; after the last step it waited {float(blocked.group(4)) / 1000:.1f} s for the last commit"
        print(line)
    if resumed:
        s, gb = float(resumed.group(2)), float(resumed.group(3))
        print(f"  ltrain restore: {s:.1f} s, {gb:.1f} GB, {gb / s:.2f} GB/s = {gb / s / read_gbs:.2f}x the disk's read "
              f"({'page cache dropped first' if cached else 'the page cache may still hold the files'})")
        if resumed.group(5):
            print(f"    of which reading: {float(resumed.group(5)):.1f} s on average per rank "
                  f"({float(resumed.group(4)):.1f} GB read by the ranks)"
                  + (f", placing: {float(resumed.group(6)):.1f} s" if resumed.group(6) else ""))
    else:
        print("  ltrain restore: no 'resumed from' line (exit %d)" % rc2)
        ok = False
    return ok and rc2 == 0


def lost_work_suite(a, work, data):
    print("== lost-work: gpt-124m shape, checkpoint every 50, rank 1 killed at step 80 ==", flush=True)
    home = os.path.join(work, "home-lost")
    recipe = os.path.join(work, "lost.yaml")
    with open(recipe, "w") as f:
        f.write(f"""name: lost
model: {{layers: 12, d_model: 768, heads: 12, seq_len: 2048, vocab: 50304}}
data: {{path: {data}}}
training: {{steps: 120, micro_batch: 16, global_batch: 32, log_every: 10}}
parallel: {{nodes: 1, nproc_per_node: 2, device: cuda, precision: bf16}}
checkpoint: {{every: 50, keep: 2, dir: {os.path.join(work, 'lost-ck')}}}
fault: {{max_restarts: 2, restart_backoff_s: 0}}
""")
    state = {"killed": False}

    def on_line(line, env):
        if not state["killed"] and line.startswith("[rank 0] step 80/"):
            status = subprocess.run([a.ltrain, "status", "lost-1", "--output", "json"], capture_output=True,
                                    text=True, env=env)
            ranks = json.loads(status.stdout).get("ranks", [])
            os.kill(int(next(r["pid"] for r in ranks if r["rank"] == 1)), signal.SIGKILL)
            state["killed"] = True

    rc, out = launch(a.ltrain, [recipe], home, on_line)
    m = re.search(r"resumed from \S+/step-(\d+) at step (\d+)", out)
    resumed = int(m.group(2)) if m else 0
    print(f"\nresults: exit {rc}; killed at step 80; resumed from step {resumed} (the save of step 50 "
          f"{'was' if resumed == 50 else 'was NOT'} the one resumed); lost {80 - resumed} steps")
    return rc == 0 and state["killed"] and resumed == 50


def kill_suite(a, work, data):
    tiny = a.tiny
    print(f"== kill-7b: {'a tiny GPT on 4 CPU processes' if tiny else 'gpt-7b on 4 GPUs'}, killed once the save "
          "of step 5 has committed, resumed from step 5 ==", flush=True)
    model = ("{layers: 4, d_model: 64, heads: 4, seq_len: 64, vocab: 256}" if tiny else
             "{layers: 32, d_model: 4096, heads: 32, seq_len: 2048, vocab: 50304}")
    device = "cpu" if tiny else "cuda"
    precision = "fp32" if tiny else "bf16"
    layouts = [(key, p) for key, p in (("dp4-zero3", "zero: 3"), ("tp2-pp2", "tp: 2, pp: 2"))
               if a.layout in ("all", key)]
    ok = True
    loss_re = re.compile(r"\[rank 0\] step (\d+)/\d+ loss (\S+)")
    for key, parallel in layouts:
        losses = {}
        for kind in ("uninterrupted", "killed"):
            name = f"k{key.replace('-', '')}{kind[0]}"
            ck_dir = os.path.join(work, name + "-ck")
            recipe = os.path.join(work, f"{name}.yaml")
            # The reference needs no checkpoint; the killed run keeps one (a 7B checkpoint is about 84 GB).
            checkpoint = f"{{every: 5, keep: 1, dir: {ck_dir}}}" if kind == "killed" else "{enabled: false}"
            with open(recipe, "w") as f:
                f.write(f"""name: {name}
model: {model}
data: {{path: {data}}}
training: {{steps: 9, micro_batch: 1, global_batch: 8, log_every: 1, warmup_steps: 2, deterministic: true}}
parallel: {{nodes: 1, nproc_per_node: 4, device: {device}, precision: {precision}, {parallel}}}
checkpoint: {checkpoint}
fault: {{max_restarts: 1, restart_backoff_s: 0}}
""")
            state = {"killed": False, "losses": {}}

            def on_line(line, env, kind=kind, name=name, state=state):
                m = loss_re.match(line)
                if m:
                    state["losses"][int(m.group(1))] = m.group(2)  # the restart's lines replace the first's
                if kind == "killed" and not state["killed"] and "checkpoint step-5 written" in line:
                    status = subprocess.run([a.ltrain, "status", f"{name}-1", "--output", "json"],
                                            capture_output=True, text=True, env=env)
                    ranks = json.loads(status.stdout).get("ranks", [])
                    os.kill(int(next(r["pid"] for r in ranks if r["rank"] == 1)), signal.SIGKILL)
                    state["killed"] = True
                    print(f"  killed rank 1 after the commit of step 5 (the last step printed: "
                          f"{max(state['losses'], default=0)})", flush=True)

            rc, out = launch(a.ltrain, [recipe], os.path.join(work, "home-" + name), on_line)
            shutil.rmtree(ck_dir, ignore_errors=True)
            m = re.search(r"resumed from \S+/step-(\d+) at step (\d+) .*?\) in ([0-9.]+) s", out)
            losses[kind] = state["losses"]
            print(f"{key} {kind}: exit {rc}" + (f"; resumed from step {m.group(2)} in {m.group(3)} s" if m else ""),
                  flush=True)
            ok = ok and rc == 0 and (kind == "uninterrupted" or (state["killed"] and m and m.group(2) == "5"))
        after = range(6, 10)
        same = all(losses["killed"].get(s) is not None and losses["killed"].get(s) == losses["uninterrupted"].get(s)
                   for s in after)
        print(f"{key}: losses of steps 6-9 after the restart "
              f"{'equal' if same else 'DIFFER FROM'} the uninterrupted run's: "
              + ", ".join(f"{s}: {losses['killed'].get(s)} / {losses['uninterrupted'].get(s)}" for s in after), flush=True)
        ok = ok and same
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ltrain", required=True)
    ap.add_argument("--baselines", required=True)
    ap.add_argument("--dir", help="where the checkpoints and the dd file go")
    ap.add_argument("--suite", default="all", choices=["all", "save", "lost-work", "kill-7b"])
    ap.add_argument("--tiny", action="store_true", help="kill-7b: a small model on 4 CPU processes")
    ap.add_argument("--layout", default="all", choices=["all", "dp4-zero3", "tp2-pp2"], help="kill-7b: the layouts run")
    ap.add_argument("--data", help="a text file to train on (default: the licence texts of /usr/share/common-licenses)")
    a = ap.parse_args()
    need = 0 if a.tiny else 4 if a.suite == "kill-7b" else 2
    if need and gpus() < need:
        print(f"skipped: fewer than {need} GPUs")
        return 77
    if a.suite in ("all", "save") and shutil.which("torchrun") is None:
        print("skipped: torchrun is not installed")
        return 77
    work = tempfile.mkdtemp(prefix="ltrain-checkpoint-bench-", dir=a.dir or os.getcwd())
    data = os.path.join(work, "data")
    inputs = [a.data] if a.data else licence_texts()
    subprocess.run([a.ltrain, "data", "prepare", "--overwrite", "--input", *inputs, "--output", data], check=True,
                   capture_output=True)
    ok = True
    if a.suite in ("all", "save"):
        ok = save_suite(a, work, data) and ok
    if a.suite in ("all", "lost-work"):
        ok = lost_work_suite(a, work, data) and ok
    if a.suite == "kill-7b":
        ok = kill_suite(a, work, data) and ok
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
