"""Anchor figures: a char-level GPT (nanoGPT shakespeare-char shape) trained in PyTorch under each
precision preset, on data/shakespeare.txt (or $DATA). Prints per preset: median step ms, tokens/s,
loss at fixed steps, and whether the run stayed finite. The same model and data are the project's
training benchmark, so the two can be set side by side.

RECIPE=nanogpt (the default) is nanoGPT's recipe, the one the project's `mantissa train` follows:
head tied to the token embedding, N(0, 0.02) weights with the two residual projections scaled by
1/sqrt(2 L), zero biases, tanh GELU, AdamW betas (0.9, 0.99), eps 1e-8, weight decay 0.1 on 2-d
parameters only, gradient norm clipped to 1.0, constant lr 1e-3, batches from the first 90% of
the text. RECIPE=torch-default is PyTorch's default initialisation with an untied head, betas
(0.9, 0.999), decay on every parameter and no clipping (the 2026-11-22 H100 figures used it).
Its losses are not comparable with the project's; its step times are.
CONFIG=tiny runs the project's `tiny` shape (2 layers, 2 heads, 64 wide, T 32, B 16), which a CPU
can run (DEVICE=cpu). CONFIG=gpt2 runs `mantissa train --config gpt2`'s: GPT-2 124M (12 layers,
12 heads, 768 wide, T 1024, B 8, vocabulary 50304) on GPT-2's tokens of the corpus (tiktoken where
it is installed, else uniform random ids: the step time is the same), bf16-mixed eager and
compiled unless PRESETS says otherwise. PRESETS=a,b,... picks presets; STEPS the steps of each.
"""
import json, math, os, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = int(os.environ.get("STEPS", 300))
RECIPE = os.environ.get("RECIPE", "nanogpt")
CONFIG = os.environ.get("CONFIG", "small")
B, T, L, H, D = {"tiny": (16, 32, 2, 2, 64), "gpt2": (8, 1024, 12, 12, 768)}.get(CONFIG, (64, 256, 6, 6, 384))
dev = os.environ.get("DEVICE", "cuda")
GELU = "tanh" if RECIPE == "nanogpt" else "none"
here = os.path.dirname(os.path.abspath(__file__))
path = os.environ.get("DATA") or os.path.join(here, "..", "..", "data", "shakespeare.txt")
text = open(path).read()
if CONFIG == "gpt2":
    try:
        import tiktoken
        ids = tiktoken.get_encoding("gpt2").encode_ordinary(text)
    except ImportError:
        ids = torch.randint(50257, (len(text) // 3,), generator=torch.Generator().manual_seed(0)).tolist()
    data, V = torch.tensor(ids, dtype=torch.long), 50304
else:
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data, V = torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)
if RECIPE == "nanogpt":
    data = data[: int(0.9 * len(data))]


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        s.qkv, s.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        s.fc, s.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(s, x):
        b, t, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(D, 2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
        att = att.masked_fill(torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D)
        x = x + s.proj(y)
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate=GELU))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok, s.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        s.blocks = nn.ModuleList(Block() for _ in range(L))
        s.ln, s.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        if RECIPE == "nanogpt":
            s.head.weight = s.tok.weight
            for name, p in s.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

    def forward(s, idx, tgt):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks:
            x = blk(x)
        logits = s.head(s.ln(x))
        return F.cross_entropy(logits.float().view(-1, V), tgt.view(-1))


def batch(g):
    ix = torch.randint(len(data) - T - 1, (B,), generator=g)
    x = torch.stack([data[i:i + T] for i in ix]).to(dev, non_blocking=True)
    y = torch.stack([data[i + 1:i + T + 1] for i in ix]).to(dev, non_blocking=True)
    return x, y


def run(preset, compile_):
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1337)
    g = torch.Generator().manual_seed(1337)
    torch.set_float32_matmul_precision("high" if preset == "32-true-high" else "highest")
    model = GPT().to(dev)
    if preset == "16-true":
        model = model.half()
    if preset == "bf16-true":
        model = model.bfloat16()
    eps = 1e-8 if "true" not in preset or preset.startswith("32") else 1e-4
    if RECIPE == "nanogpt":
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=eps)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=eps)
    scaler = torch.amp.GradScaler(dev, enabled=(preset == "16-mixed"))
    fwd = torch.compile(model) if compile_ else model
    amp = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(preset)
    times, losses, all_losses = [], {}, []
    finite = True
    for step in range(STEPS):
        x, y = batch(g)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=amp, enabled=amp is not None):
            loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if RECIPE == "nanogpt":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        lv = loss.item()
        all_losses.append(lv)
        times.append(time.perf_counter() - t0)
        if not math.isfinite(lv):
            finite = False
        if step in (0, 50, 100, 200, STEPS - 1):
            losses[step] = lv
    timed = times[min(10, STEPS // 3):]
    ms = sorted(timed)[len(timed) // 2] * 1e3
    tail = [v for v in all_losses[-50:] if math.isfinite(v)]
    row = dict(preset=preset, compiled=compile_, step_ms=ms, tok_s=B * T / ms * 1e3, losses=losses, finite=finite,
               mean_loss_last50=sum(tail) / max(len(tail), 1),
               peak_mib=torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None,
               params=sum(p.numel() for p in model.parameters()))
    print(f"{preset:14s} compile={int(compile_)} step {ms:7.2f} ms  {B*T/ms*1e3:10.0f} tok/s  finite={finite}  losses {losses}  mean of last 50 {row['mean_loss_last50']:.4f}  peak {row['peak_mib'] or 0:.0f} MiB", flush=True)
    return row


print(torch.__version__, torch.cuda.get_device_name() if dev == "cuda" else dev, f"recipe={RECIPE} config={CONFIG} V={V} chars={len(text)}", flush=True)
rows = []
default = "bf16-mixed" if CONFIG == "gpt2" else "32-true,32-true-high,bf16-mixed,16-mixed,bf16-true,16-true"
for preset in os.environ.get("PRESETS", default).split(","):
    rows.append(run(preset, False))
if dev == "cuda":
    for preset in ["bf16-mixed"]:
        rows.append(run(preset, True))
name = "torch_gpt2.json" if CONFIG == "gpt2" else "torch_gpt.json"
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w"), indent=1)
