#!/usr/bin/env python3
"""ltrain against the Hugging Face stack, through the ltrain binary as a user runs it.

    python3 tests/bench/hf_check.py --ltrain build/cmd/ltrain --baselines ../shared/baselines \
        --text ../shared/data/tinyshakespeare.txt --parts tokenizer,init,export [--device cuda]

  tokenizer  a byte-level BPE trained with the `tokenizers` package on --text; `ltrain data prepare
             --tokenizer` of the whole text gives the same token ids as tokenizers' encode.
  init       llama_model.Llama's weights saved as safetensors, `model.init_from` in a one-step run
             (data.sampling torch, so that the batch is the one torch.randint draws): ltrain's first loss
             against the reference model's on that batch, in float64.
  hub        Hub models' config.json (Llama 3.2 1B's with its RoPE scaling, Mistral 7B v0.1's; 2 layers,
             random weights)
             built by transformers, imported with `model.init_from` alone: `ltrain generate --score`
             against transformers' log-probabilities.
  export     a Llama (on the tokenizer part's BPE data) and a GPT-2 (on bytes) trained with `ltrain launch`,
             `ltrain export`, loaded with transformers' from_pretrained: per-token log-probabilities of
             held-out text from transformers against `ltrain generate --score`, in fp32 and in bf16.
Prints one line per check and exits 1 if one fails. Needs torch (init), tokenizers (tokenizer) and
transformers (export).
"""
import argparse, json, math, os, shutil, struct, subprocess, sys, tempfile

RESULTS = []


def report(name, ok, detail):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def run(argv, env=None):
    env = dict(env or os.environ)
    # On a GPU host the ltrain binaries need the libraries gpu-env.sh put on LD_LIBRARY_PATH, which
    # this Python (PyTorch, transformers) runs without.
    if os.environ.get("LTRAIN_LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["LTRAIN_LD_LIBRARY_PATH"]
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def read_tokens(path):
    with open(path, "rb") as f:
        head = f.read(28)
        count, width = struct.unpack("<Q", head[16:24])[0], struct.unpack("<I", head[24:28])[0]
        data = f.read()
    fmt = "<%d%s" % (count, "H" if width == 2 else "I")
    return list(struct.unpack(fmt, data))


def save_safetensors(tensors, path):
    """The safetensors format by hand (the safetensors package may be missing): header, then bytes."""
    import torch
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        b = t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def recipe(path, model, data, steps, extra):
    lines = [f"name: {os.path.basename(path).split('.')[0]}", "model:"]
    lines += [f"  {k}: {v}" for k, v in model.items()]
    lines += ["data:", f"  path: {data}"]
    lines += ["training:", f"  steps: {steps}"] + [f"  {k}: {v}" for k, v in extra.get("training", {}).items()]
    lines += ["parallel:", "  nodes: 1", "  nproc_per_node: 1"] + [f"  {k}: {v}" for k, v in extra.get("parallel", {}).items()]
    lines += ["checkpoint:"] + [f"  {k}: {v}" for k, v in extra.get("checkpoint", {}).items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def losses(output):
    out = []
    for line in output.splitlines():
        if "] step " in line and " loss " in line:
            out.append(float(line.split(" loss ")[1].split()[0]))
    return out


def tokenizer_part(a, work):
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train([a.text], vocab_size=a.vocab, min_frequency=2, special_tokens=["<|endoftext|>"])
    path = os.path.join(work, "tokenizer.json")
    tok.save(path)
    out = os.path.join(work, "bpe")
    run([a.ltrain, "data", "prepare", "--input", a.text, "--output", out, "--tokenizer", path, "--val-fraction", "0", "-q"])
    ours = read_tokens(os.path.join(out, "train.bin"))
    with open(a.text, encoding="utf-8") as f:
        theirs = tok.encode(f.read()).ids
    first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
    report("tokenizer", ours == theirs,
           f"{len(ours)} ltrain ids vs {len(theirs)} tokenizers ids on {a.text} (vocab {a.vocab}), "
           f"first difference at {first}")
    # The same text again with a validation split, for the export part.
    run([a.ltrain, "data", "prepare", "--input", a.text, "--output", os.path.join(work, "bpe-split"), "--tokenizer", path, "-q"])


def init_part(a, work):
    import torch
    sys.path.insert(0, a.baselines)
    from llama_model import Llama
    data = os.path.join(work, "bytes")
    if not os.path.exists(os.path.join(data, "train.bin")):
        run([a.ltrain, "data", "prepare", "--input", a.text, "--output", data, "-q"])
    L, d, h, kv, ffn, V, T, B = 2, 128, 4, 2, 256, 256, 64, 4
    torch.manual_seed(0)
    ref = Llama(L, d, h, kv, ffn, V, T, tie=False)
    weights = os.path.join(work, "llama.safetensors")
    save_safetensors(ref.state_dict(), weights)
    model = {"arch": "llama", "layers": L, "d_model": d, "heads": h, "kv_heads": kv, "ffn": ffn, "seq_len": T,
             "vocab": V, "tie_embeddings": "false", "init_from": weights}
    for device in ["cpu"] + (["cuda"] if a.device == "cuda" else []):
        path = os.path.join(work, f"init-{device}.yaml")
        recipe(path, model, data + "\n  sampling: torch\n  seed: 7", 1,
               {"training": {"micro_batch": B, "global_batch": B, "lr": 0.0, "min_lr": 0.0, "log_every": 1},
                "parallel": {"device": device, "precision": "fp32"},
                "checkpoint": {"enabled": "false"}})
        out = run([a.ltrain, "launch", path], env=dict(os.environ, LTRAIN_HOME=os.path.join(work, "home")))
        first = losses(out)[0]
        tokens = torch.tensor(read_tokens(os.path.join(data, "train.bin")), dtype=torch.long)
        g = torch.Generator().manual_seed(7)
        starts = torch.randint(0, tokens.numel() - T - 1, (B,), generator=g)
        x = torch.stack([tokens[s:s + T] for s in starts])
        y = torch.stack([tokens[s + 1:s + T + 1] for s in starts])
        with torch.no_grad():
            want = ref.double()(x, y).item()
        ref.float()
        rel = abs(first - want) / want
        report(f"init_from ({device}, fp32)", rel <= 1e-4, f"ltrain first loss {first:.6f}, llama_model.Llama float64 "
               f"{want:.6f}, relative difference {rel:.2e} (tolerance 1e-4)")


def export_part(a, work):
    import torch
    from transformers import AutoModelForCausalLM
    home = dict(os.environ, LTRAIN_HOME=os.path.join(work, "home"))
    bpe = os.path.join(work, "bpe-split")
    byte_data = os.path.join(work, "bytes")
    if not os.path.exists(os.path.join(byte_data, "train.bin")):
        run([a.ltrain, "data", "prepare", "--input", a.text, "--output", byte_data, "-q"])
    models = {
        "llama": ({"arch": "llama", "layers": 4, "d_model": 256, "heads": 8, "kv_heads": 2, "ffn": 704,
                   "seq_len": 256, "vocab": a.vocab, "tie_embeddings": "false"}, bpe),
        "gpt2": ({"layers": 4, "d_model": 256, "heads": 8, "seq_len": 256, "vocab": 256}, byte_data),
    }
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    prompts = [text[-2000 + 300 * i:-2000 + 300 * i + 250] for i in range(4)]  # held-out tail
    for name, (model, data) in models.items():
        path = os.path.join(work, f"{name}.yaml")
        ck = os.path.join(work, f"ck-{name}")
        shutil.rmtree(ck, ignore_errors=True)
        shutil.rmtree(os.path.join(work, f"hf-{name}"), ignore_errors=True)
        recipe(path, model, data, a.steps,
               {"training": {"micro_batch": 16, "global_batch": 16, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 20,
                             "log_every": 50},
                "parallel": {"device": a.device},
                "checkpoint": {"dir": ck, "every": a.steps}})
        out = run([a.ltrain, "launch", path], env=home)
        ls = losses(out)
        hf = os.path.join(work, f"hf-{name}")
        run([a.ltrain, "export", ck, "--output", hf], env=home)
        def ltrain_logprobs(p, dtype):
            got = json.loads(run([a.ltrain, "generate", ck, "--score", "-o", "json", "--prompt", p, "--device",
                                  a.device, "--dtype", dtype], env=home))
            return [got["first_token"]] + got["tokens"], torch.tensor(got["logprobs"], dtype=torch.double)

        def hf_logprobs(m, ids):
            with torch.no_grad():
                logits = m(torch.tensor([ids], device=a.device)).logits.double()
            logp = torch.log_softmax(logits[0, :-1], -1)
            return logp.gather(1, torch.tensor(ids[1:], device=a.device).unsqueeze(1)).squeeze(1).cpu()

        hf32 = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).to(a.device).eval()
        worst = 0.0
        for p in prompts:
            ids, ours = ltrain_logprobs(p, "fp32")
            worst = max(worst, (hf_logprobs(hf32, ids) - ours).abs().max().item())
        report(f"export {name} (fp32)", worst <= 1e-4,
               f"trained {a.steps} steps (loss {ls[0]:.3f} -> {ls[-1]:.3f}), transformers "
               f"{type(hf32).__name__}.from_pretrained in fp32 against ltrain generate --score in fp32: max "
               f"|log-prob difference| {worst:.2e} over {len(prompts)} held-out sequences (tolerance 1e-4)")
        if a.device != "cuda":
            continue
        # bf16: ltrain's bf16 forward against the exact (fp32) log-probabilities of the same weights, and,
        # for scale, transformers' own bf16 forward against them.
        hf16 = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.bfloat16).to(a.device).eval()
        ours_err = theirs_err = between = 0.0
        for p in prompts:
            ids, ours = ltrain_logprobs(p, "bf16")
            exact = hf_logprobs(hf32, ids)
            theirs = hf_logprobs(hf16, ids)
            ours_err = max(ours_err, (ours - exact).abs().max().item())
            theirs_err = max(theirs_err, (theirs - exact).abs().max().item())
            between = max(between, (ours - theirs).abs().max().item())
        report(f"export {name} (bf16)", ours_err <= 2e-2,
               f"max |log-prob difference| against fp32: ltrain bf16 {ours_err:.2e} (tolerance 2e-2), transformers "
               f"bf16 {theirs_err:.2e}; ltrain bf16 against transformers bf16 {between:.2e}")
        del hf32, hf16
        torch.cuda.empty_cache()


# Hub configurations as their config.json files give them (the layers cut to 2, random weights).
HUB_CONFIGS = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 2,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256},
    "mistral-7b-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000},
}


def hub_part(a, work):
    """A model as transformers builds it from a Hub config.json (random weights, save_pretrained),
    imported by `model.init_from` alone (its model section derived from config.json), one step at lr 0,
    then `ltrain generate --score` against transformers' log-probabilities of the same weights; and, for
    scale, how far transformers' own log-probabilities move without the config's rope_scaling."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    home = dict(os.environ, LTRAIN_HOME=os.path.join(work, "home"))
    byte_data = os.path.join(work, "bytes")
    if not os.path.exists(os.path.join(byte_data, "data.yaml")):
        run([a.ltrain, "data", "prepare", "--input", a.text, "--output", byte_data, "-q"])
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    prompts = [text[1000 * i:1000 * i + 900] for i in range(4)]
    for name, config in HUB_CONFIGS.items():
        hf_dir = os.path.join(work, f"hub-{name}")
        shutil.rmtree(hf_dir, ignore_errors=True)
        os.makedirs(hf_dir)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(config, f)
        torch.manual_seed(0)
        cfg = AutoConfig.from_pretrained(hf_dir)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        model.save_pretrained(hf_dir)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:  # as the Hub has it, not as saved back
            json.dump(config, f)
        ck = os.path.join(work, f"ck-{name}")
        shutil.rmtree(ck, ignore_errors=True)
        path = os.path.join(work, f"{name}.yaml")
        recipe(path, {"init_from": hf_dir, "seq_len": 1024}, byte_data, 1,
               {"training": {"micro_batch": 1, "global_batch": 1, "lr": 0.0, "min_lr": 0.0, "log_every": 1},
                "parallel": {"device": a.device, "precision": "fp32"},
                "checkpoint": {"dir": ck, "every": 1}})
        validated = run([a.ltrain, "validate", path], env=home)
        run([a.ltrain, "launch", path], env=home)
        model = model.to(a.device).eval()

        def hf_logprobs(m, ids):
            with torch.no_grad():
                logits = m(torch.tensor([ids], device=a.device)).logits.double()
            logp = torch.log_softmax(logits[0, :-1], -1)
            return logp.gather(1, torch.tensor(ids[1:], device=a.device).unsqueeze(1)).squeeze(1).cpu()

        plain_dir = os.path.join(work, f"hub-{name}-plain")
        os.makedirs(plain_dir, exist_ok=True)
        with open(os.path.join(plain_dir, "config.json"), "w") as f:
            json.dump({k: v for k, v in config.items() if k != "rope_scaling"}, f)
        plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(plain_dir), torch_dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain = plain.to(a.device).eval()
        worst = unscaled = 0.0
        for p in prompts:
            got = json.loads(run([a.ltrain, "generate", ck, "--score", "-o", "json", "--prompt", p, "--device",
                                  a.device, "--dtype", "fp32"], env=home))
            ids = [got["first_token"]] + got["tokens"]
            ours = torch.tensor(got["logprobs"], dtype=torch.double)
            theirs = hf_logprobs(model, ids)
            worst = max(worst, (theirs - ours).abs().max().item())
            unscaled = max(unscaled, (hf_logprobs(plain, ids) - theirs).abs().max().item())
        derived = ("rope_scaling: llama3" in validated) == ("rope_scaling" in config)
        report(f"hub {name} (fp32)", worst <= 1e-4 and derived,
               f"init_from of transformers' {type(model).__name__} built from the Hub's config.json (2 layers, "
               f"random weights): ltrain generate --score against transformers, max |log-prob difference| "
               f"{worst:.2e} over {len(prompts)} sequences of about 900 tokens (tolerance 1e-4)" +
               (f"; transformers without the config's rope_scaling moves by up to {unscaled:.2e}"
                if "rope_scaling" in config else ""))
        del model, plain
        if a.device == "cuda":
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ltrain", required=True)
    p.add_argument("--baselines", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--parts", default="tokenizer,init,export")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--work", default=None)
    a = p.parse_args()
    a.ltrain = os.path.abspath(a.ltrain)
    work = a.work or tempfile.mkdtemp(prefix="ltrain-hf-")
    os.makedirs(work, exist_ok=True)
    parts = a.parts.split(",")
    for name, fn in (("tokenizer", tokenizer_part), ("init", init_part), ("export", export_part), ("hub", hub_part)):
        if name in parts:
            try:
                fn(a, work)
            except Exception as e:  # a part that cannot run fails, and the others still run
                report(name, False, f"{type(e).__name__}: {e}")
    sys.exit(0 if all(RESULTS) else 1)


if __name__ == "__main__":
    main()
