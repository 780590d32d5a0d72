#!/usr/bin/env python3
"""A rank killed mid-run: in-place recovery against a restart from a storage checkpoint, side by side.

Both run the quickstart's model through `ltrain launch` on CPU ranks (Gloo), data parallel over
--ranks processes, and rank 1 kills itself after step --kill (LTRAIN_FAULT_KILL):
  - in place: fault.recovery in_place, storage checkpoints off; the survivors keep their processes
    and the replacement takes its state from a peer;
  - restart:  fault.recovery restart with a checkpoint every --every steps; every rank starts again and
    loads the newest commit.
For each, the time from the kill (the clock the killed rank prints just before SIGKILL) to the next
step rank 0 completed (its metrics.jsonl row, on the same host's clock), the steps trained again, the
job's whole time, and whether every step's loss equals an uninterrupted run's (training.deterministic).

With --zero 1 (or 2) the ranks shard the optimizer state, and in place each rank's shard is copied
into the next rank's memory (fault.memory_checkpoint_every, --copy-every; 0: auto). The benchmark then
also measures what the copies cost: uninterrupted runs with copies (in_place) and without (restart, no
checkpoints), alternated --repeat times, each one's steady step time as the trainer prints it
("throughput: ... step_ms", the window's wall time over its steps, copies included).

    tests/bench/inplace_bench.py --ltrain build/cmd/ltrain [--ranks 2] [--steps 120] [--kill 50] [--every 20]
                                 [--zero 1 [--copy-every 0] [--repeat 3]]
"""
import argparse, json, os, re, shutil, statistics, subprocess, sys, tempfile, time

from benchlib import licence_texts

STEP = re.compile(r"^\[rank 0\] step (\d+)/\d+ loss (\S+)")
WINDOW = re.compile(r"^\[rank 0\] throughput: steps \S+ step_ms ([0-9.]+)")
COPIES = re.compile(r"^\[rank 0\] memory copies: (\d+) taken .* ([0-9.]+) ms in all: \+?(-?[0-9.]+)% on the")


def recipe(path, name, data, a, recovery, checkpoints=True):
    every = 0 if recovery == "in_place" or not checkpoints else a.every
    copies = f", memory_checkpoint_every: {a.copy_every}" if recovery == "in_place" and a.zero > 0 else ""
    with open(path, "w") as f:
        f.write(f"""name: {name}
model: {{layers: 2, d_model: 128, heads: 4, seq_len: 64, vocab: 256}}
data: {{path: {data}, tokenizer: byte}}
training: {{steps: {a.steps}, micro_batch: 16, global_batch: {16 * a.ranks}, lr: 3.0e-3, min_lr: 3.0e-4,
           warmup_steps: 20, weight_decay: 0.1, grad_clip: 1.0, seed: 1337, log_every: 1, deterministic: true}}
parallel: {{nodes: 1, nproc_per_node: {a.ranks}, zero: {a.zero}}}
checkpoint: {{every: {every}, keep: 2}}
fault: {{recovery: {recovery}, max_restarts: 1, restart_backoff_s: 0{copies}}}
""")


def launch(a, work, name, recovery, kill, checkpoints=True):
    home = os.path.join(work, "home")
    path = os.path.join(work, name + ".yaml")
    recipe(path, name, os.path.join(work, "data"), a, recovery, checkpoints)
    env = dict(os.environ, LTRAIN_HOME=home)
    if kill:
        env["LTRAIN_FAULT_KILL"] = f"{a.kill}:1"
    start = time.time()
    p = subprocess.Popen([a.ltrain, "launch", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, bufsize=1)
    killed_at = None
    losses, trained, lines, step_ms, reported_lost, copies = {}, 0, [], None, None, None
    for line in p.stdout:
        lines.append(line)
        m = re.search(r"is back .*; work lost: (\d+) step", line)
        if m:
            reported_lost = int(m.group(1))
        m = WINDOW.match(line)
        if m:
            step_ms = float(m.group(1))
        m = COPIES.match(line)
        if m:
            copies = {"taken": int(m.group(1)), "ms": float(m.group(2)), "share": float(m.group(3))}
        m = re.search(r"killing itself after step \d+ at ([0-9.]+)", line)
        if m and killed_at is None:
            killed_at = float(m.group(1))
        m = STEP.match(line)
        if m:
            trained += 1
            losses[int(m.group(1))] = m.group(2)
    p.wait(timeout=900)
    metrics = os.path.join(home, "agent-local", "jobs", name + "-1", "metrics.jsonl")
    row = {"ok": p.returncode == 0, "wall_s": time.time() - start, "losses": losses, "trained": trained,
           "step_ms": step_ms, "copies": copies, "tail": "".join(lines[-30:])}
    if kill:
        # Rank 0's steps as it recorded them, each with its time: the first after the kill is the next step.
        after = []
        if killed_at is not None and os.path.exists(metrics):
            with open(metrics) as f:
                # Past the kill in place, or the first of the restarted generation (rank 0 may record the
                # step the killed rank completed after the killed rank's last line).
                after = [r for r in map(json.loads, f) if "loss" in r and r["time"] > killed_at and
                         (r["step"] > a.kill or r.get("generation", 0) > 0)]
        if recovery == "in_place" and killed_at is not None and reported_lost is not None and os.path.exists(metrics):
            # In place the members may go back to older copies (under ZeRO): the job says how many
            # completed steps it trained again, and the next step is the first of those, the last time
            # rank 0 recorded it (it may have recorded it once before, just after the kill).
            with open(metrics) as f:
                rows = [r for r in map(json.loads, f) if "loss" in r and r["time"] > killed_at]
            first = a.kill + 1 - reported_lost
            after = [r for r in rows if r["step"] == first][-1:]
        if after:
            row["kill_to_step_s"] = after[0]["time"] - killed_at
            # The steps trained twice: those after the state the job went on from, up to the kill.
            row["lost"] = a.kill + 1 - after[0]["step"]
        else:
            row["ok"] = False
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ltrain", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill", type=int, default=50)
    p.add_argument("--every", type=int, default=20, help="the restart's checkpoint interval")
    p.add_argument("--zero", type=int, default=0, help="parallel.zero (1 or 2: in place with copies of the shards)")
    p.add_argument("--copy-every", type=int, default=0, help="fault.memory_checkpoint_every (0: auto)")
    p.add_argument("--repeat", type=int, default=3, help="uninterrupted runs with and without copies, each")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="ltrain-inplace-bench-")
    subprocess.run([a.ltrain, "data", "prepare", "--input", *licence_texts(), "--output", os.path.join(work, "data"),
                    "-q"], check=True, capture_output=True)
    plain = launch(a, work, "plain", "restart", kill=False)
    rows = {mode: launch(a, work, mode.replace(" ", "-"), recovery, kill=True)
            for mode, recovery in (("in place", "in_place"), ("restart", "restart"))}
    ok = plain["ok"]
    print(f"{a.ranks} CPU ranks, the quickstart's model, zero {a.zero}, {a.steps} steps, rank 1 killed after step "
          f"{a.kill}; uninterrupted: {plain['wall_s']:.1f} s")
    for mode, r in rows.items():
        if not r["ok"]:
            ok = False
            print(f"{mode}: FAILED\n{r['tail']}")
            continue
        same = all(r["losses"].get(s) == v for s, v in plain["losses"].items())
        ok = ok and same
        print(f"{mode:9s} kill -> next step {r['kill_to_step_s']:.2f} s, steps trained again {r['lost']}, "
              f"job {r['wall_s']:.1f} s, losses {'equal' if same else 'DIFFER from'} the uninterrupted run's")
    if ok:
        i, r = rows["in place"], rows["restart"]
        print(f"ratio in place / restart: kill -> next step {i['kill_to_step_s'] / r['kill_to_step_s']:.2f}, "
              f"job time beyond the uninterrupted run {(i['wall_s'] - plain['wall_s']) / max(r['wall_s'] - plain['wall_s'], 1e-3):.2f}")
    if a.zero > 0:
        # What the copies cost a step: uninterrupted runs with them and without, alternated.
        times = {"with copies": [], "without": []}
        shares = []
        for i in range(a.repeat):
            for mode, recovery in (("with copies", "in_place"), ("without", "restart")):
                r = launch(a, work, f"cost-{recovery.replace('_', '-')}-{i}", recovery, kill=False, checkpoints=False)
                if not r["ok"] or r["step_ms"] is None:
                    ok = False
                    print(f"{mode}: FAILED\n{r['tail']}")
                    continue
                times[mode].append(r["step_ms"])
                if r["copies"]:
                    shares.append(r["copies"])
        if times["with copies"] and times["without"]:
            w, wo = statistics.median(times["with copies"]), statistics.median(times["without"])
            print(f"copies' cost: step_ms with {w:.2f} (runs {', '.join(f'{t:.2f}' for t in times['with copies'])}), "
                  f"without {wo:.2f} (runs {', '.join(f'{t:.2f}' for t in times['without'])}); "
                  f"ratio with / without {w / wo:.3f} ({100 * (w / wo - 1):+.1f}%)")
        if shares:
            # Measured inside each run with copies: rank 0's time in the copies over its steps' own.
            runs = ", ".join(f"{c['share']:+.2f}%" for c in shares)
            print(f"copies' cost inside the runs (rank 0): {statistics.median(c['share'] for c in shares):+.2f}% of the "
                  f"steps' time (runs {runs}; {statistics.median(c['taken'] for c in shares):.0f} copies a run)")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
