"""Decoding for scripts/drafter_data.py (the project's plain batch loop), and drafter
features captured while it generates (its --capture).

The decode forwards already compute, at every answer position, what the feature pass
(scripts/drafter_common.py) would compute again: the final hidden state, the kept layers'
outputs and the greedy token; the prefill computes them over the prompt, and the batch
cache ends up holding each row's last-layer KV. ``CaptureRunner`` keeps them per request,
so a chunk's features are written beside its answers and the extraction pass skips it.

A request's sequence is its prompt and answer without the answer's last token: that token
is never fed (a row stops when it is emitted), and it stays the label of the position
before it. Chunks have the feature pass's format (right-padded, by length).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from specbatch.kernels.runner import ModelRunner

FP16_MAX = 65000.0  # a middle layer's outliers reach 2.5e4 (measured)


def _half(x: mx.array) -> np.ndarray:
    return np.array(mx.clip(x, -FP16_MAX, FP16_MAX).astype(mx.float16))


def decode(runner, tokenizer, jobs: list[tuple[list[int], object]], width: int, deadline: float | None = None):
    """Requests for ``jobs`` (prompt ids, SamplingParams), decoded plain by the project's batch
    loop, ``width`` rows at once; a finished row's slot is refilled at once (bursts of up to 8
    prompts of similar length share one left-padded prefill). ``deadline``: stop there."""
    from specbatch.kernels.loops.batch import BatchLoop
    from specbatch.runtime.request import Request
    requests = [Request.create(ids, params, tokenizer) for ids, params in jobs]
    queue = sorted(requests, key=lambda r: len(r.prompt))
    loop, index = BatchLoop(runner), {id(r): i for i, r in enumerate(requests)}
    capture = runner if isinstance(runner, CaptureRunner) else None
    while queue or loop.width:
        if deadline is not None and time.time() > deadline:
            break
        if loop.settled:
            _reap(loop, capture, index)
            free = width - loop.width
            if queue and (free >= max(1, width // 8) or loop.width < width // 2):
                take, queue = queue[:free], queue[free:]
                for i in range(0, len(take), 8):
                    _admit(loop, take[i:i + 8], capture, index)
        if loop.width:
            if capture is not None:
                capture.ids = [index[id(r.request)] for r in loop.rows]
            loop.plain_round()
            if capture is not None:
                capture.flush()
    loop.settle()
    return requests


def _reap(loop, capture, index: dict) -> None:
    if capture is not None:  # a finished row's last-layer KV, before its rows leave the cache
        for i, row in enumerate(loop.rows):
            if row.request.finished:
                capture.finish(index[id(row.request)], loop.kv.layers[-1].extract(i))
    loop.reap()


def _admit(loop, burst: list, capture, index: dict) -> None:
    if capture is not None:
        capture.ids = [index[id(r)] for r in burst]
        capture.prompt_len.update({index[id(r)]: len(r.prompt) for r in burst})
    loop.admit_many(burst)


def answer_ids(request) -> list[int]:
    """The generated ids without the stop token (the drafter scripts append EOS themselves)."""
    toks = list(request.tokens)
    return toks[:-1] if request.finish_reason == "stop" and toks and toks[-1] in request.eos_ids else toks


class CaptureRunner(ModelRunner):
    """A ``ModelRunner`` that keeps, per request, its positions' features (host copies)."""

    def __init__(self, model, layers=()):
        super().__init__(model)
        if layers:
            self.keep_layers(layers)
        self.ids: list[int] = []  # the request of each row of the next forward (set by the loop's driver)
        self.prompt_len: dict[int, int] = {}  # request -> its prompt's length
        self.prompt: dict[int, tuple] = {}  # request -> (hidden [P, D], layers [P, nD] | None, greedy [P])
        self.steps: dict[int, list] = defaultdict(list)  # request -> per fed answer token (hidden, layers, greedy)
        self.kv: dict[int, tuple] = {}  # request -> last-layer (keys, values) [Hkv, T, d]
        self._lazy: list[tuple] = []  # decode steps not copied to the host yet

    def forward_last(self, tokens: mx.array, cache: list) -> mx.array:
        """A prefill: every prompt position, its greedy token one row at a time (the
        head's [L, V] logits of a whole burst would take a gigabyte)."""
        logits = super().forward_last(tokens, cache)
        for b, rid in enumerate(self.ids):
            pad = int(tokens.shape[1]) - self.prompt_len[rid]
            h = self.hidden[b, pad:]  # [P, D]
            greedy = mx.argmax(self.head(h), axis=-1).astype(mx.int32)
            layers = None if self.layer_hidden is None else _half(self.layer_hidden[b, pad:])
            self.prompt[rid] = (_half(h), layers, np.array(greedy))
        return logits

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        logits = super().forward(tokens, cache)
        if tokens.shape[1] == 1 and self.ids:  # a decode step: lazy until the next one is dispatched
            layers = None if self.layer_hidden is None else self.layer_hidden[:, -1]
            self._lazy.append((list(self.ids), self.hidden[:, -1], layers, mx.argmax(logits[:, -1], axis=-1)))
        return logits

    def flush(self, keep_last: bool = True) -> None:
        """Copy the computed decode steps to the host (the one in flight stays, so the copy
        never waits on it)."""
        done, self._lazy = (self._lazy[:-1], self._lazy[-1:]) if keep_last else (self._lazy, [])
        for ids, h, layers, g in done:
            h, g = _half(h), np.array(g)
            layers = None if layers is None else _half(layers)
            for b, rid in enumerate(ids):
                self.steps[rid].append((h[b], None if layers is None else layers[b], g[b]))

    def finish(self, rid: int, last_layer_kv) -> None:
        """A finished row's last-layer KV (an mlx-lm ``KVCache`` of that row)."""
        self.kv[rid] = (_half(last_layer_kv.keys[0]), _half(last_layer_kv.values[0]))

    def sequence(self, rid: int, tokens: list[int]) -> dict | None:
        """The request's features over ``tokens`` (prompt + answer but its last), or None
        where a part was not captured (a row done at its first token, a time box)."""
        if rid not in self.prompt or rid not in self.kv:
            return None
        self.flush(keep_last=False)
        ph, pl, pg = self.prompt[rid]
        steps = self.steps[rid][:len(tokens) - len(ph)]
        if len(ph) + len(steps) != len(tokens) or self.kv[rid][0].shape[1] < len(tokens):
            return None
        seq = {"tokens": np.array(tokens, dtype=np.int32),
               "hidden": np.concatenate([ph, np.array([s[0] for s in steps]).reshape(-1, ph.shape[1])]),
               "greedy": np.concatenate([pg, np.array([s[2] for s in steps], dtype=np.int32)]),
               "keys": self.kv[rid][0][:, :len(tokens)], "values": self.kv[rid][1][:, :len(tokens)]}
        if pl is not None:
            seq["layers"] = np.concatenate([pl, np.array([s[1] for s in steps]).reshape(-1, pl.shape[1])])
        return seq

    def reset(self) -> None:
        self.ids, self._lazy = [], []
        self.prompt, self.steps, self.kv, self.prompt_len = {}, defaultdict(list), {}, {}


def write_chunks(seqs: list[dict], name: str, folder: Path, max_tokens: int = 4096) -> None:
    """The sequences as the feature pass writes them (length-sorted right-padded batches of
    at most ``max_tokens`` padded tokens), then the marker that makes it skip ``name``."""
    folder.mkdir(parents=True, exist_ok=True)
    order = sorted(seqs, key=lambda s: len(s["tokens"]))
    groups, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s["tokens"]) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    groups += [cur] if cur else []
    for i, group in enumerate(groups):
        L = len(group[-1]["tokens"])
        out = {"lengths": np.array([len(s["tokens"]) for s in group], dtype=np.int32)}
        for key in group[0]:
            first = group[0][key]
            axis = 1 if key in ("keys", "values") else 0  # [Hkv, T, d]: positions on axis 1
            shape = list(first.shape)
            shape[axis] = L
            arr = np.zeros((len(group), *shape), dtype=first.dtype)
            for j, s in enumerate(group):
                idx = (j, slice(None), slice(0, s[key].shape[1])) if axis == 1 else (j, slice(0, len(s[key])))
                arr[idx] = s[key]
            out[key] = arr
        tmp = folder / f"{name}_{i:04d}.tmp.npz"
        np.savez(tmp, **out)
        tmp.replace(folder / f"{name}_{i:04d}.npz")
    (folder / f"{name}.captured").write_text(str(len(groups)))
