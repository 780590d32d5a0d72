#!/usr/bin/env python3
"""ltrain against the Hugging Face stack, through the ltrain binary as a user runs it.

    python3 tests/bench/hf_check.py --ltrain build/cmd/ltrain --baselines ../shared/baselines \
        --text ../shared/data/tinyshakespeare.txt --parts tokenizer,init,export [--device cuda]

  tokenizer  a byte-level BPE trained with the `tokenizers` package on --text; `ltrain data prepare
             --tokenizer` of the whole text gives the same token ids as tokenizers' encode.
  init       llama_model.Llama's weights saved as safetensors, `model.init_from` in a one-step run
             (data.sampling torch, so that the batch is the one torch.randint draws): ltrain's first loss
             against the reference model's on that batch, in float64.
  hub        Hub models' config.json (Llama 3.2 1B's with its RoPE scaling, Qwen2.5 0.5B's, Qwen3 0.6B's,
             Mistral 7B v0.1's, and the mixtures of experts Qwen3-MoE and Mixtral narrowed; 2 layers, random
             weights) built by transformers and saved with
             save_pretrained, imported with `model.init_from` alone: `ltrain generate --score` against
             transformers' log-probabilities in fp32 and bf16; then trained 50 steps in two layouts,
             exported, loaded by transformers and compared again.
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
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
        "num_hidden_layers": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
        "vocab_size": 151936},
    "mistral-7b-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000},
    # Mixtures of experts: Qwen3-MoE (Qwen3-30B-A3B's block, narrowed) and Mixtral (8x7B's, narrowed).
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 512, "initializer_range": 0.02,
        "intermediate_size": 1536, "max_position_embeddings": 40960, "max_window_layers": 2, "mlp_only_layers": [],
        "moe_intermediate_size": 256, "norm_topk_prob": True, "num_attention_heads": 8, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936},
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 512, "initializer_range": 0.02,
        "intermediate_size": 1024, "max_position_embeddings": 32768, "num_attention_heads": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 4, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32000},
}
# The family (model.arch) ltrain derives from a model_type of its own.
ARCH_OF_MODEL_TYPE = {"qwen3_moe": "qwen3", "mixtral": "mistral"}

# The two layouts each model trains in on one GPU: as it comes, and with full activation checkpointing
# (every block recomputed in backward). Layouts of several ranks run in the CPU equivalence suite.
HUB_LAYOUTS = {"plain": {}, "checkpointed": {"activation_checkpointing": "full"}}


def hub_part(a, work):
    """A model as transformers builds it from a Hub config.json (random weights, save_pretrained, its
    config.json as transformers writes it back), imported by `model.init_from` alone (its model section
    derived from config.json): `ltrain generate --score` against transformers' log-probabilities of the
    same weights, in fp32 and bf16. Then 50 steps of training in two layouts, each exported and loaded by
    transformers, compared the same way; and, for scale, how far transformers' own log-probabilities move
    without the config's rope_scaling."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    home = dict(os.environ, LTRAIN_HOME=os.path.join(work, "home"))
    byte_data = os.path.join(work, "bytes")
    if not os.path.exists(os.path.join(byte_data, "data.yaml")):
        run([a.ltrain, "data", "prepare", "--input", a.text, "--output", byte_data, "-q"])
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    prompts = [text[1000 * i:1000 * i + 900] for i in range(4)]
    names = [n for n in HUB_CONFIGS if not a.hub_models or n in a.hub_models.split(",")]

    def hf_logprobs(m, ids):
        with torch.no_grad():
            logits = m(torch.tensor([ids], device=a.device)).logits.double()
        logp = torch.log_softmax(logits[0, :-1], -1)
        return logp.gather(1, torch.tensor(ids[1:], device=a.device).unsqueeze(1)).squeeze(1).cpu()

    def compare(label, ck, hf32, hf16, use):
        """ltrain generate --score of checkpoint `ck` against transformers' models (fp32 and bf16)."""
        worst = ours16 = theirs16 = between = 0.0
        ours_sq, theirs_sq, counted = 0.0, 0.0, 0
        for p in use:
            got = json.loads(run([a.ltrain, "generate", ck, "--score", "-o", "json", "--prompt", p, "--device",
                                  a.device, "--dtype", "fp32"], env=home))
            ids = [got["first_token"]] + got["tokens"]
            exact = hf_logprobs(hf32, ids)
            worst = max(worst, (exact - torch.tensor(got["logprobs"], dtype=torch.double)).abs().max().item())
            if a.device != "cuda":
                continue
            got16 = json.loads(run([a.ltrain, "generate", ck, "--score", "-o", "json", "--prompt", p, "--device",
                                    a.device, "--dtype", "bf16"], env=home))
            ours = torch.tensor(got16["logprobs"], dtype=torch.double)
            theirs = hf_logprobs(hf16, ids)
            ours16 = max(ours16, (ours - exact).abs().max().item())
            theirs16 = max(theirs16, (theirs - exact).abs().max().item())
            between = max(between, (ours - theirs).abs().max().item())
            ours_sq += ((ours - exact) ** 2).sum().item()
            theirs_sq += ((theirs - exact) ** 2).sum().item()
            counted += len(ids) - 1
        # bf16: ltrain's bf16 against the fp32 log-probabilities of the same weights. Within 2e-2; or, where
        # bf16 itself cannot be that close (transformers' own bf16 is farther), no farther than transformers'
        # bf16 is on the root mean square of the differences, and within 1.5 times its largest difference:
        # the largest of a few thousand roundings is one draw of a heavy tail, the mean is the accuracy.
        ours_rms = (ours_sq / max(counted, 1)) ** 0.5
        theirs_rms = (theirs_sq / max(counted, 1)) ** 0.5
        bf16_ok = ours16 <= 2e-2 or (ours_rms <= theirs_rms and ours16 <= 1.5 * theirs16)
        ok = worst <= 1e-4 and (a.device != "cuda" or bf16_ok)
        detail = (f"ltrain generate --score against transformers {type(hf32).__name__} over {len(use)} sequences of "
                  f"{len(ids) - 1} tokens or so: fp32 max |log-prob difference| {worst:.2e} (tolerance 1e-4)")
        if a.device == "cuda":
            detail += (f"; bf16 against fp32: max ltrain {ours16:.2e}, transformers {theirs16:.2e}; rms ltrain "
                       f"{ours_rms:.2e}, transformers {theirs_rms:.2e} (tolerance: max 2e-2, or rms no more than "
                       f"transformers' and max within 1.5x theirs); ltrain bf16 against transformers bf16 "
                       f"{between:.2e}")
        report(label, ok, detail)

    for name in names:
        config = HUB_CONFIGS[name]
        hf_dir = os.path.join(work, f"hub-{name}")
        shutil.rmtree(hf_dir, ignore_errors=True)
        os.makedirs(hf_dir)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(config, f)
        torch.manual_seed(0)
        cfg = AutoConfig.from_pretrained(hf_dir)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        model.save_pretrained(hf_dir)
        with open(os.path.join(hf_dir, "config.json")) as f:
            saved = json.load(f)
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
        hf16 = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.bfloat16).to(a.device).eval()
        derived = ("rope_scaling: llama3" in validated) == ("rope_scaling" in config and config["rope_scaling"] is not None)
        arch = ARCH_OF_MODEL_TYPE.get(saved["model_type"], saved["model_type"])
        derived = derived and f"arch: {arch}" in validated if arch != "llama" else derived
        keys = ", ".join(k for k in ("rope_parameters", "rope_scaling") if k in saved)
        compare(f"hub {name} import", ck, model, hf16, prompts)
        if not derived:
            report(f"hub {name} derived", False, "ltrain validate did not print the derived model:\n" + validated)
        if config.get("rope_scaling"):
            plain_dir = os.path.join(work, f"hub-{name}-plain")
            os.makedirs(plain_dir, exist_ok=True)
            with open(os.path.join(plain_dir, "config.json"), "w") as f:
                json.dump({k: v for k, v in config.items() if k != "rope_scaling"}, f)
            plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(plain_dir), torch_dtype=torch.float32)
            plain.load_state_dict(model.state_dict())
            plain = plain.to(a.device).eval()
            ids = [0] + list(prompts[0].encode())[:900]
            moved = (hf_logprobs(plain, ids) - hf_logprobs(model, ids)).abs().max().item()
            print(f"hub {name}: its saved config.json carries {keys}; transformers without rope_scaling moves "
                  f"by up to {moved:.2e}", flush=True)
            del plain
        del model, hf16
        # 50 steps in each layout, from the imported weights; then each export against transformers.
        curves = {}
        for layout, sets in HUB_LAYOUTS.items():
            lck = os.path.join(work, f"ck-{name}-{layout}")
            shutil.rmtree(lck, ignore_errors=True)
            lpath = os.path.join(work, f"{name}-{layout}.yaml")
            recipe(lpath, {"init_from": hf_dir, "seq_len": 256}, byte_data, a.hub_steps,
                   {"training": {"micro_batch": 4, "global_batch": 4, "lr": 3e-4, "min_lr": 3e-5,
                                 "warmup_steps": 5, "log_every": 1},
                    "parallel": dict({"device": a.device}, **sets),
                    "checkpoint": {"dir": lck, "every": a.hub_steps}})
            curves[layout] = losses(run([a.ltrain, "launch", lpath], env=home))
            out = os.path.join(work, f"hf-{name}-{layout}")
            shutil.rmtree(out, ignore_errors=True)
            run([a.ltrain, "export", lck, "--output", out], env=home)
            hf32 = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).to(a.device).eval()
            hf16 = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16).to(a.device).eval()
            ls = curves[layout]
            compare(f"hub {name} trained {layout} ({len(ls)} steps, loss {ls[0]:.3f} -> {ls[-1]:.3f}), exported",
                    lck, hf32, hf16, [p[:250] for p in prompts[:2]])
            del hf32, hf16
            # A 7B-wide model's checkpoints and exports fill a host's disk: each goes once compared.
            shutil.rmtree(lck, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
        a_, b_ = curves["plain"], curves["checkpointed"]
        worst = max(abs(x - y) / abs(x) for x, y in zip(a_, b_)) if a_ and len(a_) == len(b_) else float("inf")
        report(f"hub {name} layouts", worst <= 2e-2 and len(a_) == a.hub_steps,
               f"{len(a_)} steps: max relative loss difference between the layouts {worst:.2e} (bf16 where the "
               f"device is a GPU; tolerance 2e-2)")
        shutil.rmtree(ck, ignore_errors=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if "qwen2.5-0.5b" in names:
        finetune(a, work, home, os.path.join(work, "hub-qwen2.5-0.5b"), prompts, compare)


def finetune(a, work, home, hf_dir, prompts, compare):
    """recipes/finetune.yaml on the imported Qwen2.5 directory: {prompt, response} pairs made by `data
    prepare --sft`, the response loss logged as it falls, the export loaded by transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    pairs = os.path.join(work, "pairs.jsonl")
    with open(pairs, "w") as f:
        for i in range(2000):
            f.write(json.dumps({"prompt": f"Question: which line is number {i}?\n",
                                "response": f"Answer: line {i} is the line after {i - 1}."}) + "\n")
    sft = os.path.join(work, "sft")
    shutil.rmtree(sft, ignore_errors=True)
    run([a.ltrain, "data", "prepare", "--sft", "--input", pairs, "--output", sft, "-q"])
    ck = os.path.join(work, "ck-finetune")
    shutil.rmtree(ck, ignore_errors=True)
    out = run([a.ltrain, "launch", "recipes/finetune.yaml", "--set", f"model.init_from={hf_dir}", "--set",
               f"data.path={sft}", "--set", "model.seq_len=256", "--set", "training.steps=60", "--set",
               "training.micro_batch=8", "--set", "training.global_batch=8", "--set", "training.lr=1.0e-4",
               "--set", "training.min_lr=1.0e-5", "--set", "training.log_every=5", "--set", "training.eval_every=0",
               "--set", f"parallel.device={a.device}", "--set", f"checkpoint.dir={ck}", "--set",
               "checkpoint.every=60"], env=home)
    ls = losses(out)
    report("finetune loss", len(ls) >= 2 and ls[-1] < 0.5 * ls[0],
           f"recipes/finetune.yaml on the imported Qwen2.5-0.5B configuration, {len(ls)} logged steps: response "
           f"loss {ls[0] if ls else float('nan'):.3f} -> {ls[-1] if ls else float('nan'):.3f}")
    hf = os.path.join(work, "hf-finetune")
    shutil.rmtree(hf, ignore_errors=True)
    run([a.ltrain, "export", ck, "--output", hf], env=home)
    hf32 = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).to(a.device).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.bfloat16).to(a.device).eval()
    compare("finetune export", ck, hf32, hf16, [p[:250] for p in prompts[:2]])
    del hf32, hf16


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
    p.add_argument("--hub-models", default="", help="comma-separated names of HUB_CONFIGS (default: all)")
    p.add_argument("--hub-steps", type=int, default=50)
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
