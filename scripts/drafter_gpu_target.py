"""The embedded target in PyTorch, for scripts/drafter_gpu.py: MLX's dequantization bit for
bit, the llama forward (causal, right-padded rows from position 0, keeping chosen layers'
outputs and the last layer's KV) and a batched decode loop for generation (rows of any
prompt length, each writing its own KV column; sampling greedy, at a temperature, or top-p).
Numpy and torch only: the accelerator machine has no MLX."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EOS = 2  # <|im_end|>


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
            logits = target.decode(tok, pos, cache, L + t + 1)  # pos <= L + t: known here, no host sync
        mat = torch.stack(steps, 1).cpu().numpy()
        fin = ended.cpu().numpy()
        for r, i in enumerate(idx):
            row = mat[r].tolist()
            n = row.index(EOS) if fin[r] else len(row)
            out[i] = (row[:n], bool(fin[r]))
        del cache
    return out
