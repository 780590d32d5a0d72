#!/usr/bin/env python3
"""`ltrain data prepare` side by side with Hugging Face `tokenizers` on the .py files of this machine's
Python packages (JSON Lines shards of about 64 MB, a record a file), with a 32,000-entry byte-level
BPE that `tokenizers` trains on the first shard: whether every document's ids are the same, each one's
MB/s on the same cores (`encode_batch` against `ltrain data prepare`), and ltrain's peak RSS.

  tests/bench/tokenizers_bench.py build/cmd/ltrain        (figures in $OUT/data_check.txt too, if set)

Needs python3 with `tokenizers` and numpy (the GPU host has them)."""
import glob, json, os, re, resource, subprocess, sys, time, site
import numpy as np

out = os.environ.get("OUT", "/tmp/ltrain-tokenizers-bench")
work = "/tmp/ltrain-tokenizers-bench/work"
os.makedirs(work, exist_ok=True)
log = open(os.path.join(out, "data_check.txt"), "w")
def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True); log.write(s + "\n"); log.flush()

# The corpus: every .py file of the Python packages, as JSON Lines shards of about 64 MB.
roots = sorted(set(site.getsitepackages() + [os.path.dirname(os.__file__)]))
docs = []
for root in roots:
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            docs.append(text)
total = sum(len(d.encode()) for d in docs)
say(f"corpus: {len(docs)} .py files, {total / 1e6:.1f} MB, from {roots}")
shards, cur, size = [], None, 0
for i, d in enumerate(docs):
    if cur is None or size > 64e6:
        if cur: cur.close()
        p = os.path.join(work, f"part-{len(shards):03d}.jsonl"); shards.append(p); cur = open(p, "w"); size = 0
    line = json.dumps({"text": d}) + "\n"; cur.write(line); size += len(line)
cur.close()
say(f"{len(shards)} shards")

# A 32,000-entry byte-level BPE trained by tokenizers on the first shard.
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
first = [json.loads(l)["text"] for l in open(shards[0])]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
t = time.time()
tok.train_from_iterator(first, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(os.path.join(work, "tokenizer.json"))
say(f"tokenizer trained on the first shard in {time.time() - t:.0f} s, vocab {tok.get_vocab_size()}")
eot = tok.token_to_id("<|endoftext|>")

# tokenizers' encode_batch over the whole corpus, on every core.
cores = os.cpu_count()
t = time.time()
encoded = tok.encode_batch(docs)
hf_s = time.time() - t
say(f"tokenizers encode_batch: {hf_s:.1f} s, {total / 1e6 / hf_s:.1f} MB/s on {cores} cores")

# ltrain data prepare on the shards, the same cores.
ltrain = sys.argv[1]
# Peak RSS of ltrain alone: through a small wrapper (a child forked from this process would count
# this process's memory until its exec).
wrapper = os.path.join(work, "peak.py")
open(wrapper, "w").write("import resource, subprocess, sys, time\n"
                         "t = time.time(); r = subprocess.run(sys.argv[1:])\n"
                         "sys.stderr.write('PEAK_KB %d SECONDS %.3f\\n' % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.time() - t))\n"
                         "sys.exit(r.returncode)\n")
r = subprocess.run([sys.executable, wrapper, ltrain, "data", "prepare", "-q", "--input", *shards, "--output",
                    os.path.join(work, "out"), "--overwrite", "--tokenizer", os.path.join(work, "tokenizer.json"),
                    "--val-fraction", "0"], capture_output=True, text=True)
m = re.search(r"PEAK_KB (\d+) SECONDS ([\d.]+)", r.stderr)
peak_mb = int(m.group(1)) / 1024
lt_s = float(m.group(2))
say(r.stdout.strip(), r.stderr.strip()[-2000:])
if r.returncode != 0:
    say("ltrain failed", r.returncode); sys.exit(1)
say(f"ltrain data prepare: {lt_s:.1f} s, {total / 1e6 / lt_s:.1f} MB/s, peak RSS {peak_mb:.0f} MB")
say(f"ratio: ltrain {hf_s / lt_s:.1f}x tokenizers' encode_batch")

# Ids per document: the shards in order, documents by the index, each ending with <|endoftext|>.
manifest = open(os.path.join(work, "out", "data.yaml")).read()
files = re.findall(r"file: (train-\d+\.bin)", manifest)
ids = np.concatenate([np.memmap(os.path.join(work, "out", f), dtype=np.uint16, mode="r", offset=28) for f in files])
starts = []
offset = 0
for f in files:
    raw = open(os.path.join(work, "out", f.replace(".bin", ".idx")), "rb").read()
    n = int.from_bytes(raw[16:24], "little")
    starts.extend(offset + int.from_bytes(raw[24 + 8 * i:32 + 8 * i], "little") for i in range(n))
    offset += (os.path.getsize(os.path.join(work, "out", f)) - 28) // 2
starts.append(len(ids))
say(f"documents: ltrain {len(starts) - 1}, corpus {len(docs)}; tokens: ltrain {len(ids)}")
bad = 0
for i, e in enumerate(encoded):
    got = ids[starts[i]:starts[i + 1]]
    want = e.ids + [eot]
    if len(got) != len(want) or not np.array_equal(got, np.array(want, dtype=np.uint16)):
        bad += 1
        if bad <= 3:
            k = next((j for j in range(min(len(got), len(want))) if got[j] != want[j]), min(len(got), len(want)))
            say(f"document {i} differs at token {k}: ltrain {[int(x) for x in got[max(0,k-3):k+5]]} tokenizers {want[max(0,k-3):k+5]}")
            if k < len(e.offsets):
                a, b = e.offsets[max(0, k - 2)][0], e.offsets[min(len(e.offsets) - 1, k + 3)][1]
                say("  text there:", repr(docs[i][a:b]))
                say("  ltrain tokens:", [tok.id_to_token(int(x)) for x in got[max(0,k-3):k+5]])
                say("  tokenizers tokens:", [tok.id_to_token(x) for x in want[max(0,k-3):k+5]])
say(f"documents whose ids differ: {bad} of {len(encoded)}")
