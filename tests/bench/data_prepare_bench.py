#!/usr/bin/env python3
"""`ltrain data prepare` on corpora of several sizes: MB/s and peak memory (GNU time's maximum resident
set size), as a user runs it.

The corpus is JSON Lines shards of 256 MB of text each, zstd-compressed, made of documents of real
text: lines drawn at random (seeded) from the licence texts and the Python sources of this machine.
A byte-level BPE is trained on the first shard by ltrain itself (--train-tokenizer), then each size is
prepared with it, from a cold output directory. Prints one line a size and a table at the end.

  tests/bench/data_prepare_bench.py --ltrain build/cmd/ltrain --sizes-gb 1 2 8 --work /var/tmp/ltrain-bench
"""
import argparse, glob, json, os, random, re, shutil, subprocess, sys, time

SHARD_TEXT_BYTES = 256 << 20


def text_pool():
    """Lines of real text: the licence texts and this machine's Python sources."""
    files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    lines = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                lines.extend(l for l in f.read().splitlines() if l.strip())
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) > 2_000_000:
            break
    return lines


def write_corpus(work, gigabytes, pool):
    """JSON Lines shards, zstd-compressed, of `gigabytes` GB of text in all (each shard 256 MB of text)."""
    os.makedirs(work, exist_ok=True)
    rng = random.Random(1234)
    shards, remaining, index = [], int(gigabytes * (1 << 30)), 0
    while remaining > 0:
        path = os.path.join(work, f"part-{index:05d}.jsonl.zst")
        want = min(SHARD_TEXT_BYTES, remaining)
        if not os.path.exists(path):
            zstd = subprocess.Popen(["zstd", "-q", "-1", "-T2", "-o", path], stdin=subprocess.PIPE)
            written = 0
            while written < want:
                doc = "\n".join(rng.choices(pool, k=rng.randint(5, 80)))
                line = json.dumps({"text": doc}) + "\n"
                zstd.stdin.write(line.encode())
                written += len(doc.encode())
            zstd.stdin.close()
            if zstd.wait() != 0:
                sys.exit("zstd failed")
        shards.append(path)
        remaining -= want
        index += 1
    return shards


def timed(argv):
    """Runs argv under GNU time: (seconds, peak RSS in MB, output)."""
    start = time.monotonic()
    done = subprocess.run(["/usr/bin/time", "-f", "peak_kb=%M"] + argv, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    peak = int(re.search(r"peak_kb=(\d+)", done.stderr).group(1)) / 1024
    return seconds, peak, done.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ltrain", required=True)
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 2, 8])
    p.add_argument("--work", default="/var/tmp/ltrain-data-bench")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokenizer-sample", default="32MB")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    for tool in ("zstd", "/usr/bin/time"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is missing (Debian packages zstd, time)")
    pool = text_pool()
    print(f"text pool: {len(pool)} lines", flush=True)
    corpus = write_corpus(os.path.join(args.work, "corpus"), max(args.sizes_gb), pool)
    tokenizer_dir = os.path.join(args.work, "tokenizer")
    seconds, peak, _ = timed([args.ltrain, "data", "prepare", "-q", "--input", corpus[0], "--output", tokenizer_dir,
                              "--overwrite", "--train-tokenizer", "bpe", "--vocab", str(args.vocab),
                              "--tokenizer-sample", args.tokenizer_sample, "--threads", str(args.threads)])
    print(f"BPE of {args.vocab} trained on {args.tokenizer_sample} and the first shard prepared: {seconds:.0f} s",
          flush=True)
    rows = []
    for gb in args.sizes_gb:
        shards = corpus[:max(1, int(round(gb * (1 << 30) / SHARD_TEXT_BYTES)))]
        out = os.path.join(args.work, f"out-{gb:g}gb")
        shutil.rmtree(out, ignore_errors=True)
        seconds, peak, stdout = timed([args.ltrain, "data", "prepare", "-q", "--input", *shards, "--output", out,
                                       "--tokenizer", os.path.join(tokenizer_dir, "tokenizer.json"),
                                       "--threads", str(args.threads)])
        text_mb = float(re.search(r"\(([\d.]+) (GB|MB) of text\)", stdout).group(1)) * (
            1000 if re.search(r"\(([\d.]+) GB of text\)", stdout) else 1)
        tokens = sum(int(n) for n in re.findall(r"(?:train|val) (\d+) tokens", stdout))
        rows.append((gb, text_mb, seconds, text_mb / seconds, peak, tokens))
        print(f"{gb:g} GB: {text_mb:.0f} MB of text in {seconds:.1f} s, {text_mb / seconds:.1f} MB/s, "
              f"peak RSS {peak:.0f} MB, {tokens} tokens", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    print("\n| corpus | text MB | seconds | MB/s | peak RSS MB | tokens |\n| --- | --- | --- | --- | --- | --- |")
    for gb, text_mb, seconds, rate, peak, tokens in rows:
        print(f"| {gb:g} GB | {text_mb:.0f} | {seconds:.1f} | {rate:.1f} | {peak:.0f} | {tokens} |")


if __name__ == "__main__":
    main()
