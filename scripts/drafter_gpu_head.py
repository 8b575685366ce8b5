"""The MTP head in PyTorch, for scripts/drafter_gpu.py: ``MTPHead`` parameter for parameter
(saved and loaded in its own safetensors layout), unrolled as ``MTPHead.step`` chains at run
time, and the batches it trains on (the frozen target's features computed on the fly)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from drafter_gpu_target import Rope, Target, rms, rope


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

    @classmethod
    def from_folder(cls, target: Target, folder: Path) -> "Head":
        """A head as ``save_head`` wrote it (``mtp_config.json`` says whether it fuses layers)."""
        cfg = json.loads((folder / "mtp_config.json").read_text())
        head = cls(target, np.zeros(int(cfg["draft_vocab"]), dtype=np.int64), tuple(cfg.get("fuse_layers") or ()), "hard")
        head.load_mlx(folder / "mtp.safetensors")
        return head

    def load_mlx(self, path: Path) -> None:
        from safetensors.numpy import load_file
        w = load_file(str(path))
        if set(self.p) != set(w) - {"vocab_ids"}:  # a fused head read as a plain one would draft nonsense
            raise ValueError(f"{path} holds {sorted(set(w) - {'vocab_ids'})}, this head {sorted(self.p)}")
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
