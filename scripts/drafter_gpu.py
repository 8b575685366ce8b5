"""Distil EAGLE-3-style MTP heads for the embedded target on an accelerator, in one time-boxed
run (PyTorch; the CPU recipe, `make drafters`, stays the reproducible default).

Inputs: the folder scripts/drafter_gpu_pack.py writes (the target's quantized arrays, token
data, the chat template's pieces, a reference forward). One run, in order:
1. the target, dequantized in fp32 and checked against the reference logits of this
   machine's MLX forward (the run stops if its argmax disagrees: a wrong port trains nothing);
2. data: questions the target writes itself after its chat template's pre-query prefix
   (Magpie: temperature 1, top-p 0.95), its greedy answers, answers sampled at 0.7, and a
   second user turn it writes after a greedy answer, answered greedily; beside the packed
   answers of earlier sessions. Time-boxed, in that order;
3. training: every variant (``--variants``) on the same batches, features computed on the fly
   by the frozen target (final hidden state, the fused layers' outputs, last-layer KV,
   greedy tokens), the head unrolled ``--unroll`` draft steps exactly as MTPHead.step chains
   them at run time (training-time test: step s reads its own step s-1 output); soft labels
   (the target's distribution over the kept vocabulary) or hard ones (its greedy token);
4. held-out: the target's greedy answers to scripts/heldout_prompts.json (never trained on),
   acceptance by draft position and tokens per round tau(k) for the shipped head and every
   variant, as scripts/measure_drafters.py computes them on the CPU.
Output (``--out``): ``<variant>.safetensors`` in MTPHead's own layout (fp16, the kept
vocabulary's ids beside the weights), ``report.json`` (configs, training history, held-out
figures), ``data.npz`` (the generated token data) and ``log.txt``.

    python3 scripts/drafter_gpu.py --pack .gpu --out "$OUT" --minutes 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EOS = 2
NEWLINE = 198  # "\n"
CHAT_START = 1  # <|im_start|>: a sequence that does not begin with it is raw code
SPECIALS = 17  # ids below are the chat template's special tokens
FUSE = (2, 15, 29)
STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3)
LOG: list[str] = []


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LOG.append(line)
    print(line, flush=True)


# ----------------------------------------------------------------------------------------- target

def dequantize(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int = 32) -> np.ndarray:
    """MLX affine quantization: uint32 words hold 32 / bits values, lowest bits first. The
    arithmetic is MLX's own (``mx.dequantize``: two fp16 operations, each rounded), bit for bit."""
    b = w.view(np.uint8)  # little-endian: a word's first byte holds its first values
    q = np.stack([b & 15, b >> 4], axis=-1).reshape(w.shape[0], -1) if bits == 4 else b.reshape(w.shape[0], -1)
    q = q.reshape(w.shape[0], -1, group).astype(np.float16)  # [O, I / group, group]
    out = (q * scales.astype(np.float16)[..., None]).astype(np.float16) + biases.astype(np.float16)[..., None]
    return out.astype(np.float16).astype(np.float32).reshape(w.shape[0], -1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-traditional RoPE (halves rotated); x [B, H, L, d], cos/sin [B or 1, 1, L, d / 2]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Rope:
    def __init__(self, dims: int, theta: float, max_pos: int, device):
        inv = theta ** (-torch.arange(0, dims, 2, dtype=torch.float64, device=device) / dims)
        ang = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv  # [P, d / 2]
        self.cos, self.sin = ang.cos().float(), ang.sin().float()

    def at(self, pos: torch.Tensor):
        """cos/sin [B, 1, L, d / 2] for positions [B, L]."""
        return self.cos[pos][:, None], self.sin[pos][:, None]


class Target:
    """The frozen llama target: full forwards (features), and prefill + decode for generation."""

    def __init__(self, pack: Path, device, dtype):
        cfg = json.loads((pack / "target_config.json").read_text())
        self.D, self.H, self.Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd, self.eps, self.V = cfg.get("head_dim") or self.D // self.H, cfg["rms_norm_eps"], cfg["vocab_size"]
        self.n_layers = cfg["num_hidden_layers"]
        raw = {}
        for part in ("a", "b"):
            with np.load(pack / f"target_{part}.npz") as z:
                raw.update({k: z[k] for k in z.files})
        qcfg = cfg["quantization"]

        def weight(name: str) -> np.ndarray:
            if f"{name}.scales" not in raw:
                return raw[f"{name}.weight"].astype(np.float32)
            bits = qcfg.get(name, qcfg)["bits"]
            return dequantize(raw[f"{name}.weight"], raw[f"{name}.scales"], raw[f"{name}.biases"], bits)

        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        self.fp32 = {"embed": t(weight("model.embed_tokens")), "norm": t(weight("model.norm"))}
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
                self.fp32[f"{i}.{name}"] = t(weight(p + name))
        self.rope = Rope(self.hd, cfg.get("rope_theta", 10000.0), cfg.get("max_position_embeddings", 8192), device)
        self.device = device
        self.set_dtype(dtype)

    def set_dtype(self, dtype) -> None:
        self.dtype = dtype
        w = {k: v.to(dtype) for k, v in self.fp32.items()}
        self.E, self.norm = w["embed"], w["norm"]
        self.layers = []
        for i in range(self.n_layers):
            g = lambda n: w[f"{i}.{n}"]  # noqa: E731
            self.layers.append({"qkv": torch.cat([g("self_attn.q_proj"), g("self_attn.k_proj"), g("self_attn.v_proj")]),
                                "o": g("self_attn.o_proj"), "gu": torch.cat([g("mlp.gate_proj"), g("mlp.up_proj")]),
                                "down": g("mlp.down_proj"), "ln1": g("input_layernorm"), "ln2": g("post_attention_layernorm")})

    def _qkv(self, lw, x, cos, sin):
        B, L, _ = x.shape
        qkv = rms(x, lw["ln1"], self.eps) @ lw["qkv"].T
        q, k, v = qkv.split([self.H * self.hd, self.Hkv * self.hd, self.Hkv * self.hd], dim=-1)
        q = q.view(B, L, self.H, self.hd).transpose(1, 2)
        k = k.view(B, L, self.Hkv, self.hd).transpose(1, 2)
        v = v.view(B, L, self.Hkv, self.hd).transpose(1, 2)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def _mlp(self, lw, x):
        g, u = (rms(x, lw["ln2"], self.eps) @ lw["gu"].T).chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ lw["down"].T

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, keep=(), cache_len: int = 0):
        """Causal forward of right-padded tokens [B, L] from position 0. Returns the final
        hidden [B, L, D] (after the norm), the kept layers' outputs [B, L, n * D], and per layer
        K, V [B, Hkv, max(L, cache_len), d] (RoPE applied; room for decoding after L)."""
        B, L = tokens.shape
        pos = torch.arange(L, device=self.device)[None]
        cos, sin = self.rope.at(pos)
        x = self.E[tokens]
        kept, cache = [], []
        rep = self.H // self.Hkv
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, x, cos, sin)
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
            x = x + a.transpose(1, 2).reshape(B, L, -1) @ lw["o"].T
            x = self._mlp(lw, x)
            if cache_len:
                K = torch.zeros(B, self.Hkv, cache_len, self.hd, device=self.device, dtype=self.dtype)
                Vv = torch.zeros_like(K)
                K[:, :, :L], Vv[:, :, :L] = k, v
                cache.append((K, Vv))
            elif i == self.n_layers - 1:
                cache.append((k, v))
            if i in keep:
                kept.append(x)
        hidden = rms(x, self.norm, self.eps)
        return hidden, (torch.cat(kept, dim=-1) if kept else None), cache

    @torch.no_grad()
    def decode(self, token: torch.Tensor, pos: torch.Tensor, cache: list, top: int) -> torch.Tensor:
        """One token per row [B] at positions [B]; attends cache columns <= pos (< top). Logits [B, V]."""
        B = token.shape[0]
        cos, sin = self.rope.at(pos[:, None])
        x = self.E[token][:, None]  # [B, 1, D]
        rows = torch.arange(B, device=self.device)
        valid = torch.arange(top, device=self.device)[None] <= pos[:, None]  # [B, T]
        bias = torch.zeros(B, top, device=self.device, dtype=torch.float32).masked_fill(~valid, float("-inf"))
        rep = self.H // self.Hkv
        for lw, (K, Vv) in zip(self.layers, cache):
            q, k, v = self._qkv(lw, x, cos, sin)
            K[rows, :, pos], Vv[rows, :, pos] = k[:, :, 0], v[:, :, 0]
            qg = q.view(B, self.Hkv, rep, self.hd)  # q head h reads kv head h // rep
            s = torch.einsum("bgrd,bgtd->bgrt", qg, K[:, :, :top]).float() * self.hd ** -0.5 + bias[:, None, None]
            a = torch.einsum("bgrt,bgtd->bgrd", s.softmax(-1).to(self.dtype), Vv[:, :, :top])
            x = x + a.reshape(B, 1, -1) @ lw["o"].T
            x = self._mlp(lw, x)
        return (rms(x, self.norm, self.eps) @ self.E.T)[:, 0].float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.E.T


# ------------------------------------------------------------------------------------- generation

def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    if top_p < 1.0:
        sp, idx = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > top_p  # keep the smallest head of the distribution reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        pick = torch.multinomial(sp, 1, generator=gen)
        return idx.gather(-1, pick)[:, 0]
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def generate(target: Target, prompts: list[list[int]], max_new: int, temperature: float, top_p: float,
             width: int, gen: torch.Generator, deadline: float) -> list[tuple[list[int], bool]]:
    """(answer ids, ended with EOS) per prompt, in waves of ``width`` rows sorted by length; a
    wave not started before ``deadline`` is skipped (its rows answer ([], False))."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    dev = target.device
    for w0 in range(0, len(order), width):
        if time.time() > deadline:
            break
        idx = order[w0:w0 + width]
        lens = torch.tensor([len(prompts[i]) for i in idx], device=dev)
        L = int(lens.max())
        host = np.zeros((len(idx), L), dtype=np.int64)
        for r, i in enumerate(idx):
            host[r, :len(prompts[i])] = prompts[i]
        toks = torch.from_numpy(host).to(dev)
        hidden, _, cache = target.forward(toks, cache_len=L + max_new)
        rows = torch.arange(len(idx), device=dev)
        logits = target.logits(hidden[rows, lens - 1]).float()
        done = torch.zeros(len(idx), dtype=torch.bool, device=dev)
        ended = torch.zeros_like(done)
        steps = []
        for t in range(max_new):
            tok = sample(logits, temperature, top_p, gen)
            tok = torch.where(done, torch.zeros_like(tok), tok)
            steps.append(tok)
            ended |= (tok == EOS) & ~done
            done |= tok == EOS
            if t == max_new - 1 or (t % 16 == 15 and bool(done.all())):
                break
            pos = lens + t
            logits = target.decode(tok, pos, cache, int(pos.max()) + 1)
        mat = torch.stack(steps, 1).cpu().numpy()
        fin = ended.cpu().numpy()
        for r, i in enumerate(idx):
            row = mat[r].tolist()
            n = row.index(EOS) if fin[r] else len(row)
            out[i] = (row[:n], bool(fin[r]))
        del cache
    return out


def write_questions(target, pieces, n: int, width: int, gen, deadline, seen: set) -> list[list[int]]:
    """Questions the target writes after its pre-query prefix (whole ones only, none twice)."""
    prefix = pieces["magpie_prefix"].tolist()
    qs: list[list[int]] = []
    while len(qs) < n and time.time() < deadline:
        for ids, ended in generate(target, [prefix] * width, 72, 1.0, 0.95, width, gen, deadline):
            key = tuple(ids)
            if ended and len(ids) >= 4 and min(ids) >= SPECIALS and key not in seen:
                seen.add(key)
                qs.append(ids)
    return qs[:n]


def code_prompts(target, seeds: list[list[int]], n: int, width: int, gen, deadline) -> list[list[int]]:
    """Raw code prompts the target writes itself: a seed ("def", "class", ...) continued at
    temperature 0.8 (top-p 0.95; at 1.0 a 135M model writes noise), cut after its second line
    (a signature and a docstring line, as the held-out code prompts are; no chat template)."""
    prompts = [seeds[i % len(seeds)] for i in range(n)]
    out = []
    for p, (ids, _) in zip(prompts, generate(target, prompts, 48, 0.8, 0.95, width, gen, deadline)):
        lines = [i for i, t in enumerate(ids) if t == NEWLINE]
        if len(lines) >= 2 and min(ids[:lines[1] + 1]) >= SPECIALS:
            out.append(p + ids[:lines[1] + 1])
    return out


def answered(target, prompts, args, temperature, gen, deadline, max_new=None) -> list[list[int]]:
    """prompt + answer (+ EOS where it ended) for each prompt that got an answer."""
    res = generate(target, prompts, max_new or args.max_new, temperature, 1.0, args.width, gen, deadline)
    return [p + a + ([EOS] if ended else []) for p, (a, ended) in zip(prompts, res) if a]


def make_data(target, pieces, args, deadline) -> dict:
    """New sequences (prompt + answer [+ EOS]) by kind, time-boxed, in the order of --phases:
    code (raw code prompts it writes, greedy continuations), greedy (its own questions,
    greedy answers), sampled (the same questions at 0.7), turn2 (a second user turn it writes
    after a greedy answer, answered greedily)."""
    gen = torch.Generator(device=target.device).manual_seed(args.seed)
    q_end, t2 = pieces["question_end"].tolist(), pieces["turn2_open"].tolist()
    prefix = pieces["magpie_prefix"].tolist()
    seen = {tuple(s) for s in pieces["held_questions"]}
    phases = args.phases.split(",")
    out = {name: [] for name in phases}
    prompts: list[list[int]] = []
    if {"greedy", "sampled", "turn2"} & set(phases):
        t0 = time.time()
        qs = write_questions(target, pieces, args.questions, args.width * 2, gen, deadline, seen)
        prompts = [prefix + q + q_end for q in qs]
        log(f"questions: {len(qs)} in {time.time() - t0:.0f} s")
    half = len(prompts) // 2
    for phase in phases:
        t0 = time.time()
        if phase == "code":
            seeds = unflat(pieces["code_seeds"], pieces["code_seeds_offsets"])
            starts = code_prompts(target, seeds, args.code, args.width * 2, gen, deadline)
            out[phase] = answered(target, starts, args, 0.0, gen, deadline, max_new=256)
            out[phase] += answered(target, starts[:len(starts) // 2], args, 0.7, gen, deadline, max_new=256)
        elif phase == "greedy":
            out[phase] = answered(target, prompts, args, 0.0, gen, deadline)
        elif phase == "sampled":
            out[phase] = answered(target, prompts[:half], args, 0.7, gen, deadline)
        elif phase == "turn2":
            # the answer's own EOS is the end of its turn, which the second turn's header begins with
            firsts = [s[:-1] + t2 if t2[0] == EOS else s + t2 for s in out.get("greedy", [])[half:]
                      if s[-1] == EOS and len(s) < args.max_len - 120]
            follow = generate(target, firsts, 72, 1.0, 0.95, args.width, gen, deadline)
            turns = [c + q + q_end for c, (q, ended) in zip(firsts, follow) if ended and len(q) >= 4 and min(q) >= SPECIALS]
            out[phase] = answered(target, turns, args, 0.0, gen, deadline)
        n_tok = sum(map(len, out[phase]))
        log(f"{phase}: {len(out[phase])} sequences ({n_tok:,} tokens with their prompts) in {time.time() - t0:.0f} s")
    return out


# ------------------------------------------------------------------------------------------ heads

class Head(torch.nn.Module):
    """MTPHead (src/specbatch/kernels/drafters/mtp.py) in PyTorch, parameter for parameter."""

    def __init__(self, target: Target, vocab_ids: np.ndarray, fuse: tuple, labels: str):
        super().__init__()
        D, Fi = target.D, target.layers[0]["gu"].shape[0] // 2
        P = torch.nn.Parameter
        self.fuse, self.labels, self.eps = tuple(fuse), labels, target.eps
        self.H, self.Hkv, self.hd = target.H, target.Hkv, target.hd
        z = lambda *s: P(torch.zeros(*s, device=target.device))  # noqa: E731
        params = ({
            "enorm.weight": P(torch.ones(D, device=target.device)), "hnorm.weight": P(torch.ones(D, device=target.device)),
            "eh_proj.weight": z(D, 2 * D), "norm.weight": z(D),
            "block.input_layernorm.weight": z(D), "block.post_attention_layernorm.weight": z(D),
            "block.self_attn.q_proj.weight": z(self.H * self.hd, D), "block.self_attn.k_proj.weight": z(self.Hkv * self.hd, D),
            "block.self_attn.v_proj.weight": z(self.Hkv * self.hd, D), "block.self_attn.o_proj.weight": z(D, self.H * self.hd),
            "block.mlp.gate_proj.weight": z(Fi, D), "block.mlp.up_proj.weight": z(Fi, D), "block.mlp.down_proj.weight": z(D, Fi)}
            | ({"fc.weight": z(D, len(fuse) * D)} if fuse else {}))
        self.p: dict[str, torch.nn.Parameter] = {}  # by MTPHead's own names (torch's may not hold dots)
        for name, param in params.items():
            self.register_parameter(name.replace(".", "__"), param)
            self.p[name] = param
        self.vocab_ids = torch.as_tensor(np.asarray(vocab_ids), dtype=torch.long, device=target.device)

    def init_last(self, target: Target, final_rms: float) -> None:
        """The target's last block, eh_proj summing [emb; h] halves, the target's final norm
        (and a fused head's fc the last fused layer alone, hnorm rescaled to its RMS)."""
        n = target.n_layers - 1
        D = target.D
        names = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
                 "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
                 "mlp.down_proj": "down_proj", "input_layernorm": "input_layernorm",
                 "post_attention_layernorm": "post_attention_layernorm"}
        with torch.no_grad():
            for src, _ in names.items():
                self.p[f"block.{src}.weight"].copy_(target.fp32[f"{n}.{src}"])
            eye = torch.eye(D, device=target.device)
            self.p["eh_proj.weight"].copy_(torch.cat([eye, eye], 1) * 0.5)
            self.p["norm.weight"].copy_(target.fp32["norm"])
            if self.fuse:
                self.p["fc.weight"].copy_(torch.cat([torch.zeros(D, (len(self.fuse) - 1) * D, device=target.device), eye], 1))
                self.p["hnorm.weight"].copy_(target.fp32["norm"] / final_rms)

    def load_mlx(self, path: Path) -> None:
        from safetensors.numpy import load_file
        w = load_file(str(path))
        with torch.no_grad():
            for k, v in self.p.items():
                v.copy_(torch.from_numpy(w[k].astype(np.float32)))
        self.vocab_ids = torch.as_tensor(w["vocab_ids"].astype(np.int64), device=self.vocab_ids.device)

    def save_mlx(self, path: Path) -> None:
        from safetensors.numpy import save_file
        arrays = {k: v.detach().float().cpu().numpy().astype(np.float16) for k, v in self.p.items()}
        arrays["vocab_ids"] = self.vocab_ids.cpu().numpy().astype(np.int32)
        save_file(arrays, str(path), metadata={"format": "mlx"})

    def config(self, target: Target, rope_theta: float, max_pos: int, inter: int) -> dict:
        cfg = {"hidden_size": target.D, "num_attention_heads": self.H, "num_key_value_heads": self.Hkv,
               "head_dim": self.hd, "rms_norm_eps": self.eps, "rope_theta": rope_theta, "rope_traditional": False,
               "max_position_embeddings": max_pos, "intermediate_size": inter, "draft_vocab": int(len(self.vocab_ids))}
        return cfg | ({"fuse_layers": list(self.fuse)} if self.fuse else {})

    def first(self, feats: dict) -> torch.Tensor:
        return feats["layers"] @ self.p["fc.weight"].T if self.fuse else feats["hidden"]

    def unrolled(self, E, tokens, first, keys, values, S: int, rope_: Rope) -> list[torch.Tensor]:
        """Output hidden states [B, N, D] of draft steps 1..S for queries n = 0..N-1 (N = L - 1):
        tokens [B, L + S], first [B, >= N, D], keys/values [B, Hkv, L, d]. As MTPHead.step
        chains at run time: query n of step s sits at position n + s, sees the target's
        columns <= n and its own keys of steps 1..s at n."""
        p, eps = self.p, self.eps
        B, L = keys.shape[0], keys.shape[2]
        N = L - 1
        rep = self.H // self.Hkv
        ctx_k, ctx_v = keys[:, :, :N], values[:, :, :N]
        ar = torch.arange(N, device=keys.device)
        causal, diag = ar[None] <= ar[:, None], torch.eye(N, dtype=torch.bool, device=keys.device)
        h, own_k, own_v, outs = first[:, :N], [], [], []
        for s in range(1, S + 1):
            x = torch.cat([rms(E[tokens[:, s:s + N]], p["enorm.weight"], eps), rms(h, p["hnorm.weight"], eps)], -1)
            x = x @ p["eh_proj.weight"].T
            a = rms(x, p["block.input_layernorm.weight"], eps)
            q = (a @ p["block.self_attn.q_proj.weight"].T).view(B, N, self.H, self.hd).transpose(1, 2)
            k = (a @ p["block.self_attn.k_proj.weight"].T).view(B, N, self.Hkv, self.hd).transpose(1, 2)
            v = (a @ p["block.self_attn.v_proj.weight"].T).view(B, N, self.Hkv, self.hd).transpose(1, 2)
            cos, sin = rope_.at((ar + s)[None])
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            own_k.append(k)
            own_v.append(v)
            mask = torch.cat([causal] + [diag] * s, dim=1)  # [N, N (1 + s)]
            K = torch.cat([ctx_k.to(k.dtype), *own_k], 2).repeat_interleave(rep, 1)
            V = torch.cat([ctx_v.to(v.dtype), *own_v], 2).repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
            x = x + o.transpose(1, 2).reshape(B, N, -1) @ p["block.self_attn.o_proj.weight"].T
            m = rms(x, p["block.post_attention_layernorm.weight"], eps)
            x = x + (F.silu(m @ p["block.mlp.gate_proj.weight"].T) * (m @ p["block.mlp.up_proj.weight"].T)) @ p["block.mlp.down_proj.weight"].T
            h = rms(x, p["norm.weight"], eps)
            outs.append(h)
        return outs


# ------------------------------------------------------------------------------------- batches

def to_batch(target: Target, seqs: list[list[int]], S: int, keep) -> dict:
    """Right-padded tokens [B, L + S] and the frozen target's features over them."""
    dev = target.device
    L = max(len(s) for s in seqs)
    host = np.zeros((len(seqs), L + S), dtype=np.int64)
    for i, s in enumerate(seqs):
        host[i, :len(s)] = s
    tokens = torch.from_numpy(host).to(dev)
    lengths = torch.tensor([len(s) for s in seqs], device=dev)
    hidden, layers, cache = target.forward(tokens[:, :L], keep=keep)
    greedy = torch.cat([target.logits(hidden[i:i + 8]).argmax(-1) for i in range(0, len(seqs), 8)])  # [B, L]
    keys, values = cache[-1]
    hidden = F.pad(hidden, (0, 0, 0, S))  # [B, L + S, D]: labels read positions up to L - 1 + S
    N = L - 1
    n = torch.arange(N, device=dev)[None]
    greedy_ok = torch.zeros(len(seqs), L + S, dtype=torch.bool, device=dev)
    greedy_ok[:, 1:L] = tokens[:, 1:L] == greedy[:, :-1]  # token m is the target's greedy choice
    gpad = F.pad(greedy, (0, S + 1), value=-1)  # [B, L + S + 1]
    masks, m = [], torch.ones(len(seqs), N, dtype=torch.bool, device=dev)
    for s in range(1, S + 1):
        if s >= 2:
            m = m & greedy_ok[:, s:s + N]  # later steps continue on the target's greedy tokens only
        masks.append(m & (n + s <= lengths[:, None] - 1))
    return {"tokens": tokens, "hidden": hidden, "layers": layers, "keys": keys, "values": values,
            "greedy": gpad, "masks": masks, "lengths": lengths}


def step_terms(head: Head, target: Target, b: dict, W: torch.Tensor, pos_of: torch.Tensor, S: int) -> list:
    """Per step s: (loss sum, top-1 hits, count) over its masked queries."""
    first = head.first(b)
    outs = head.unrolled(target.E, b["tokens"], first, b["keys"], b["values"], S, target.rope)
    N = outs[0].shape[1]
    terms = []
    for s, h in enumerate(outs, start=1):
        logp = (h @ W.T.to(h.dtype)).float().log_softmax(-1)  # [B, N, Vk]
        m = b["masks"][s - 1]
        want = pos_of[b["greedy"][:, s:s + N].clamp(min=0)]  # -1 outside the kept vocabulary
        if head.labels == "soft":
            with torch.no_grad():
                p = (b["hidden"][:, s:s + N] @ W.T.to(b["hidden"].dtype)).float().softmax(-1)
            loss = -(p * logp).sum(-1)
        else:
            loss = -logp.gather(-1, want.clamp(min=0)[..., None])[..., 0] * (want >= 0)
        hit = (logp.argmax(-1) == want)
        mf = m.float()
        terms.append(((loss * mf).sum(), (hit.float() * mf).sum(), mf.sum()))
    return terms


def length_batches(seqs: list[list[int]], budget: int, rng: np.random.Generator) -> list[list[list[int]]]:
    order = rng.permutation(len(seqs))
    out = []
    for i in range(0, len(order), 2048):  # sorted within windows: little padding, still shuffled
        win = sorted(order[i:i + 2048], key=lambda j: len(seqs[j]))
        cur: list[int] = []
        for j in win:
            if cur and (len(cur) + 1) * len(seqs[j]) > budget:
                out.append([seqs[k] for k in cur])
                cur = []
            cur.append(j)
        if cur:
            out.append([seqs[k] for k in cur])
    return [out[i] for i in rng.permutation(len(out))]


# ---------------------------------------------------------------------------------- evaluation

def accept(heads: dict, target: Target, seqs: list[list[int]], prompt_lens: list[int], kinds: list[str],
           K: int, keep, amp) -> dict:
    """Chain acceptance on the target's greedy answers, per head: acceptance per draft position
    (conditional on the earlier ones) and tau(k) = 1 + E[accepted], k = 1..K (as
    scripts/measure_drafters.py computes them)."""
    oks, ks = {name: [] for name in heads}, []
    for s, pl, kind in zip(seqs, prompt_lens, kinds):
        b = to_batch(target, [s], K, keep)
        L = len(s)
        n = np.arange(L - 1)
        greedy = b["greedy"][0].cpu().numpy()
        want = np.stack([greedy[n + j] for j in range(1, K + 1)], 1)
        gok = np.zeros(L + K + 1, bool)
        gok[1:L] = np.asarray(s[1:]) == greedy[:L - 1]
        sel = (n + 1 >= pl) & (n + K <= L - 1)
        ks += [kind] * int(sel.sum())
        for name, head in heads.items():
            W = target.E[head.vocab_ids]
            with torch.no_grad(), amp():
                outs = head.unrolled(target.E, b["tokens"], head.first(b), b["keys"], b["values"], K, target.rope)
                preds = torch.stack([head.vocab_ids[(h[0] @ W.T.to(h.dtype)).argmax(-1)] for h in outs], 1)  # [N, K]
            ok = preds.cpu().numpy() == want
            for j in range(2, K + 1):  # the chain continues on the target's greedy tokens only
                ok[:, j - 1:] &= gok[n + j][:, None]
            oks[name].append(ok[sel])
    ks = np.array(ks)
    res = {}
    for name in heads:
        ok = np.concatenate(oks[name])
        res[name] = {}
        for part, sel in (("all", np.ones(len(ks), bool)), ("chat", ks == "chat"), ("code", ks == "code")):
            run = np.cumprod(ok[sel], axis=1)
            prev = np.concatenate([np.ones((len(run), 1)), run[:, :-1]], 1)
            res[name][part] = {"starts": int(sel.sum()),
                               "accept_by_position": [round(float(run[:, j].sum() / max(1, prev[:, j].sum())), 3) for j in range(K)],
                               "tau_by_k": [round(1 + float(run[:, :k].sum(1).mean()), 3) for k in range(1, K + 1)]}
    return res


def validate(heads, target, val, S, keep, amp, budget) -> dict:
    sums = {name: np.zeros((S, 3)) for name in heads}
    for group in length_batches(val, budget, np.random.default_rng(0)):
        b = to_batch(target, group, S, keep)
        for name, (head, _) in heads.items():
            W, pos_of = head.out_rows
            with torch.no_grad(), amp():
                sums[name] += np.array([[float(t) for t in term] for term in step_terms(head, target, b, W, pos_of, S)])
    return {name: {"loss": (v[:, 0] / v[:, 2]).round(4).tolist(), "top1": (v[:, 1] / v[:, 2]).round(4).tolist()}
            for name, v in sums.items()}


# -------------------------------------------------------------------------------------- main

def check_port(target: Target, data) -> None:
    """fp32 logits and fused layers against this project's MLX forward (packed with the data)."""
    toks = torch.tensor(data["ref_tokens"].astype(np.int64), device=target.device)[None]
    hidden, layers, _ = target.forward(toks, keep=FUSE)
    logits = target.logits(hidden[0, -4:]).float().cpu().numpy()
    ref = data["ref_logits"]
    diff = float(np.abs(logits - ref).max())
    same = bool((logits.argmax(-1) == ref.argmax(-1)).all())
    ldiff = float(np.abs(layers[0, -4:].float().cpu().numpy() - data["ref_layers"]).max() / np.abs(data["ref_layers"]).max())
    log(f"port check (fp32): logits max |diff| {diff:.2e} (scale {np.abs(ref).max():.1f}), argmax equal {same}, "
        f"layers rel diff {ldiff:.2e}")
    if not same or diff > 1e-3 * np.abs(ref).max():
        raise SystemExit("the target's port disagrees with the reference forward: not training")


def unflat(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [flat[offsets[i]:offsets[i + 1]].astype(np.int64).tolist() for i in range(len(offsets) - 1)]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", type=Path, default=Path(".gpu"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="the whole run's time box")
    ap.add_argument("--gen-minutes", type=float, default=2.0, help="time box of the data phase")
    ap.add_argument("--eval-reserve", type=float, default=50.0, help="seconds kept for held-out evaluation and saving")
    ap.add_argument("--questions", type=int, default=8192)
    ap.add_argument("--code", type=int, default=4096, help="raw code prompts to write and continue")
    ap.add_argument("--code-repeat", type=int, default=1, help="times each raw-code sequence appears in the data")
    ap.add_argument("--phases", default="greedy,sampled,turn2", help="data phases in order (code,greedy,sampled,turn2)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="a previous run's --out: variants found there (<name>.safetensors) continue from its weights")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--extra-data", type=Path, nargs="*", default=[], help="earlier runs' data.npz, trained on too")
    ap.add_argument("--shipped", type=Path, default=Path("src/specbatch/demo_models/mtp/mtp.safetensors"),
                    help="the head measured beside the new ones (skipped where absent)")
    ap.add_argument("--width", type=int, default=1024, help="rows per generation wave")
    ap.add_argument("--max-new", type=int, default=448)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--held-new", type=int, default=160, help="greedy tokens per held-out answer")
    ap.add_argument("--variants", default="fused-soft,plain-soft,fused-hard")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=float, default=90.0, help="seconds between checkpoints into --out")
    ap.add_argument("--limit-old", type=int, default=0, help="packed sequences used (0: all; a smoke test's cut)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.time()
    end = t_start + args.minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(args.seed)
    if cuda:
        log(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else (lambda: torch.autocast("cpu", enabled=False))
    data = np.load(args.pack / "data.npz")
    target = Target(args.pack, dev, torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False  # the check compares fp32 with fp32
    check_port(target, data)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        target.set_dtype(torch.bfloat16)
    held = unflat(data["held"], data["held_offsets"])
    pieces = {k: data[k] for k in ("magpie_prefix", "question_end", "turn2_open", "code_seeds", "code_seeds_offsets")
              if k in data.files}
    chat_held = [h for h, code in zip(held, data["held_code"]) if not code]
    q0, q1 = len(pieces["magpie_prefix"]), len(pieces["question_end"])
    pieces["held_questions"] = [h[q0:len(h) - q1] for h in chat_held]
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "log": LOG}

    # held-out answers first (small), then the training data
    t0 = time.time()
    answers = generate(target, held, args.held_new, 0.0, 1.0, len(held), torch.Generator(device=dev), end)
    held_seqs = [h + a for h, (a, _) in zip(held, answers)]
    kinds = ["code" if c else "chat" for c in data["held_code"]]
    log(f"held-out answers: {sum(len(a) for a, _ in answers)} tokens in {time.time() - t0:.1f} s")
    new = make_data(target, pieces, args, min(end, time.time() + args.gen_minutes * 60))
    old = unflat(data["train"], data["train_offsets"])
    if args.limit_old:
        old = old[:args.limit_old]
    for path in args.extra_data:  # an earlier run's generated data (its data.npz)
        with np.load(path) as z:
            for kind in [k for k in z.files if not k.endswith("_offsets")]:
                old += unflat(z[kind], z[f"{kind}_offsets"])
        log(f"with {path}: {len(old)} earlier sequences")
    seqs = [s[:args.max_len] for s in old + [seq for kind in new.values() for seq in kind]]
    seqs = [s for s in seqs if len(s) >= 8]
    seqs += [s for s in seqs if s[0] != CHAT_START] * (args.code_repeat - 1)  # raw code: rare in the chat data
    save_data(args.out / "data.npz", new)
    rng = np.random.default_rng(args.seed)
    val_idx = set(rng.choice(len(seqs), size=max(8, len(seqs) // 50), replace=False).tolist())
    val = [s for i, s in enumerate(seqs) if i in val_idx]
    train = [s for i, s in enumerate(seqs) if i not in val_idx]
    log(f"train {len(train)} seqs / {sum(map(len, train)):,} tokens; val {len(val)} seqs / {sum(map(len, val)):,}")
    report["data"] = {k: [len(v), int(sum(map(len, v)))] for k, v in new.items()} | {
        "packed": [len(old), int(sum(map(len, old)))], "train_tokens": int(sum(map(len, train)))}

    # the kept vocabulary: the most frequent greedy tokens over the training data (its answers)
    counts = np.bincount(np.concatenate([np.asarray(s, dtype=np.int64) for s in train]), minlength=target.V)
    vocab_ids = np.sort(np.lexsort((np.arange(target.V), -counts))[:args.vocab])
    pos_of = torch.full((target.V,), -1, dtype=torch.long, device=dev)
    pos_of[torch.as_tensor(vocab_ids, device=dev)] = torch.arange(len(vocab_ids), device=dev)
    sample = to_batch(target, train[:16], args.unroll, FUSE)
    final_rms = float(sample["hidden"][:, :64].float().pow(2).mean(-1).sqrt().mean())
    heads = {}
    for name in args.variants.split(","):
        fuse = FUSE if name.startswith("fused") else ()
        head = Head(target, vocab_ids, fuse, "soft" if name.endswith("soft") else "hard")
        head.init_last(target, final_rms)
        if args.init_from is not None and (args.init_from / f"{name}.safetensors").exists():
            head.load_mlx(args.init_from / f"{name}.safetensors")  # its weights and kept vocabulary
            pos = torch.full((target.V,), -1, dtype=torch.long, device=dev)
            pos[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=dev)
            head.out_rows = (target.E[head.vocab_ids], pos)
            log(f"{name}: continuing from {args.init_from}")
            heads[name] = (head, torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95)))
            continue
        head.out_rows = (target.E[torch.as_tensor(vocab_ids, device=dev)], pos_of)
        opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
        heads[name] = (head, opt)
    everyone = {}
    if args.shipped.exists():
        everyone["shipped"] = Head(target, vocab_ids, (), "soft")
        everyone["shipped"].load_mlx(args.shipped)
    report["history"] = []
    train_loop(heads, target, train, val, args, amp, end - args.eval_reserve, report)

    # held-out acceptance, the shipped head beside the new ones
    everyone |= {n: h for n, (h, _) in heads.items()}
    report["heldout"] = accept(everyone, target, held_seqs, [len(h) for h in held], kinds, 5, FUSE, amp)
    for name, res in report["heldout"].items():
        log(f"held-out {name}: all {json.dumps(res['all'])}; chat tau {res['chat']['tau_by_k']}; "
            f"code tau {res['code']['tau_by_k']}")
    save_heads(heads, target, args, report)
    log(f"done in {time.time() - t_start:.0f} s")


def save_heads(heads, target, args, report) -> None:
    cfg = json.loads((args.pack / "target_config.json").read_text())
    report["configs"] = {}
    for name, (head, _) in heads.items():
        head.save_mlx(args.out / f"{name}.safetensors")
        report["configs"][name] = head.config(target, cfg.get("rope_theta", 10000.0), cfg.get("max_position_embeddings", 8192),
                                              target.layers[0]["gu"].shape[0] // 2)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    (args.out / "log.txt").write_text("\n".join(LOG) + "\n")


def save_data(path: Path, new: dict) -> None:
    arrays = {}
    for kind, seqs in new.items():
        if seqs:
            arrays[kind] = np.concatenate([np.asarray(s, dtype=np.uint16) for s in seqs])
            arrays[f"{kind}_offsets"] = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    np.savez_compressed(path, **arrays)
    log(f"saved new data: {path.stat().st_size / 2**20:.1f} MiB")


def train_loop(heads, target, train, val, args, amp, stop: float, report) -> None:
    """Every head on the same batches until ``stop``: linear warm-up, cosine on elapsed time."""
    S = args.unroll
    rng = np.random.default_rng(args.seed + 1)
    t0, last_save, step, tokens = time.time(), time.time(), 0, 0
    budget = max(1.0, stop - t0)
    running = {name: [] for name in heads}
    while time.time() < stop:
        for group in length_batches(train, args.batch_tokens, rng):
            el = time.time() - t0
            if time.time() >= stop:
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, el / budget))))
            b = to_batch(target, group, S, FUSE)
            for name, (head, opt) in heads.items():
                W, pos_of = head.out_rows
                for g in opt.param_groups:
                    g["lr"] = lr
                with amp():
                    terms = step_terms(head, target, b, W, pos_of, S)
                    loss = sum(STEP_WEIGHTS[s] * t[0] / t[2].clamp(min=1.0) for s, t in enumerate(terms))
                if not torch.isfinite(loss):
                    continue
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                running[name].append(float(loss))
            step += 1
            tokens += sum(map(len, group))
            if step % 50 == 0 or time.time() - last_save > args.save_every:
                entry = {"step": step, "seconds": round(time.time() - t0, 1), "tokens": tokens,
                         "loss": {n: round(float(np.mean(r[-50:])), 4) for n, r in running.items() if r}}
                if time.time() - last_save > args.save_every:
                    entry["val"] = validate(heads, target, val, S, FUSE, amp, args.batch_tokens)
                    save_heads(heads, target, args, report)
                    last_save = time.time()
                report["history"].append(entry)
                log(json.dumps(entry))
    entry = {"step": step, "seconds": round(time.time() - t0, 1), "tokens": tokens,
             "val": validate(heads, target, val, S, FUSE, amp, args.batch_tokens)}
    report["history"].append(entry)
    log(json.dumps(entry))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        import traceback
        log(traceback.format_exc())
        raise
    finally:
        out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
        if out is not None and out.exists():
            (out / "log.txt").write_text("\n".join(LOG) + "\n")
