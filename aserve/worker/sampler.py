"""Turns a step's logits into tokens, one row per request that samples this step.

Order of operations (as in vLLM): raw logprobs are taken first (what ``logprobs``
reports), then stop tokens are masked until ``min_tokens``, ``logit_bias`` is added, then
the penalties, then a
structured output's grammar masks what it does not allow (``aserve.engine.grammar``;
where that leaves nothing, because ``min_tokens`` masked the end the grammar requires,
the grammar wins), then greedy rows take the argmax while the others are divided by
their temperature, filtered by top-k, top-p and min-p, and sampled.

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)``, which picks token i with
probability ``p_i`` and needs no cumulative sums. A request with a ``seed`` draws its
``q`` from a generator seeded by (seed, position), so its tokens do not depend on what
else is in the batch, nor on a preemption that recomputes it. Requests without a seed
share one generator seeded by the engine's seed; every tensor-parallel rank draws the
same numbers in the same order, so all ranks pick the same tokens.

Everything runs on the logits' device (the GPU path samples on the GPU): the per-request
parameters go there as small tensors, the generators are that device's, a grammar's
packed masks are unpacked there (:func:`apply_token_bitmask_torch`), and only the chosen
token ids and the requested logprobs come back, in one transfer each. A seeded request
gives the same tokens on every run and every rank of one device kind; the CPU's and a
GPU's generators draw different numbers, so the same seed gives different tokens on the
two (as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aserve.kernels.token_mask import TokenMaskKernel, apply_token_bitmask_numpy
from aserve.sampling_params import SamplingParams
from aserve.wire.messages import TokenLogprobs


@dataclass
class SamplingRow:
    """What the sampler needs of one request."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    stop_token_ids: list[int]


_MASK = float("-inf")


def _seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    # Mix the position in with a large odd multiplier so (seed, pos) pairs don't collide.
    return torch.Generator(device=device).manual_seed((seed * 0x9E3779B97F4A7C15 + position) & 0x7FFF_FFFF_FFFF_FFFF)


def apply_token_bitmask_torch(logits: torch.Tensor, rows: list[int], bits: np.ndarray) -> int:
    """:func:`aserve.kernels.token_mask.apply_token_bitmask_numpy` in torch, on the logits'
    device (the GPU path): the packed words go over once and are unpacked there. In place;
    returns how many rows were left with nothing finite."""
    vocab = logits.shape[1]
    # A copy: the masks may be a read-only view of the call that brought them.
    words = torch.from_numpy(np.array(bits, dtype=np.int32, order="C")).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [k, <=V]
    if allowed.shape[1] < vocab:  # tokens past the mask's words are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index).masked_fill(~allowed, _MASK)
    dead = torch.isneginf(sub.amax(dim=1))
    # Rows with nothing finite left: 0.0 on what the grammar allows, so the grammar wins.
    sub = torch.where(dead.unsqueeze(1), torch.zeros_like(sub).masked_fill(~allowed, _MASK), sub)
    logits.index_copy_(0, index, sub)
    return int(dead.sum())


class Sampler:
    def __init__(self, seed: int, token_mask: TokenMaskKernel | None = None) -> None:
        """``token_mask``: the C kernel that applies grammar masks to CPU logits (None:
        numpy; on a GPU torch does it)."""
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.token_mask = token_mask

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """The shared generator, on ``device`` (made there on first use, from the engine's seed)."""
        if self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 allowed: tuple[list[int], np.ndarray] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] for N rows; ``allowed``: (row indices, packed masks [k, words]) of
        rows under a grammar (from the engine core's ``GrammarMasks``). Returns the chosen
        token ids and, for rows that asked, their logprobs (chosen token first, then the
        top-n)."""
        logits = logits.float()
        dev = logits.device
        n_rows = len(rows)
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        raw_data_ptr = logits.data_ptr() if raw_logprobs is not None else -1
        if any(r.params.min_tokens or r.params.has_penalties or r.params.logit_bias for r in rows):
            logits = logits.clone()
            self._apply_min_tokens_and_penalties(logits, rows)
        if allowed is not None:
            if logits.data_ptr() == raw_data_ptr:
                logits = logits.clone()  # the masks must not reach the raw logprobs' source
            logits = self._apply_grammar(logits, *allowed)

        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(n_rows, dtype=torch.long, device=dev)
            if any(greedy):
                g_idx = torch.tensor([i for i, g in enumerate(greedy) if g], device=dev)
                tokens[g_idx] = logits[g_idx].argmax(dim=-1)
            r_idx_list = [i for i, g in enumerate(greedy) if not g]
            r_idx = torch.tensor(r_idx_list, device=dev)
            sub = logits[r_idx]
            sub = sub / torch.tensor([rows[i].params.temperature for i in r_idx_list], device=dev).unsqueeze(1)
            sub = self._filter(sub, [rows[i].params for i in r_idx_list])
            probs = torch.softmax(sub, dim=-1)
            q = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(r_idx_list) if rows[i].params.seed is None]
            if unseeded:
                q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                    generator=self._generator_on(dev))
            for j, i in enumerate(r_idx_list):
                seed = rows[i].params.seed
                if seed is not None:
                    q[j].exponential_(generator=_seeded_generator(seed, len(rows[i].token_ids), dev))
            tokens[r_idx] = (probs / q).argmax(dim=-1)

        token_list = tokens.tolist()  # the step's one transfer of tokens
        logprob_out: list[TokenLogprobs | None] = [None] * n_rows
        if raw_logprobs is not None:
            asked = [i for i in range(n_rows) if want_logprobs[i]]
            found = batched_logprobs(raw_logprobs[asked] if len(asked) < n_rows else raw_logprobs,
                                     [token_list[i] for i in asked], [rows[i].params.logprobs or 0 for i in asked])
            for i, lp in zip(asked, found):
                logprob_out[i] = lp
        return token_list, logprob_out

    def _apply_grammar(self, logits: torch.Tensor, row_index: list[int], bits: np.ndarray) -> torch.Tensor:
        """Mask, in rows ``row_index``, every token the packed masks ``bits`` ([k, words]
        int32, ``aserve.kernels.token_mask``'s layout) do not allow; in place, on the
        C kernel where it is loaded (one call), else through numpy on the same memory;
        on a GPU, in torch there."""
        if not logits.is_contiguous():
            logits = logits.contiguous()
        if logits.device.type != "cpu":
            apply_token_bitmask_torch(logits, row_index, bits)
        elif self.token_mask is not None:
            self.token_mask.apply(logits, row_index, bits)
        else:
            apply_token_bitmask_numpy(logits.numpy(), row_index, bits)
        return logits

    @staticmethod
    def _apply_min_tokens_and_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab, dev = logits.shape[1], logits.device
        for i, row in enumerate(rows):
            p = row.params
            outputs = row.token_ids[row.num_prompt_tokens :]
            if len(outputs) < p.min_tokens and row.stop_token_ids:
                logits[i, [t for t in row.stop_token_ids if t < vocab]] = _MASK
            if p.logit_bias:
                ids = [t for t in p.logit_bias if t < vocab]
                logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], device=dev)
            if not p.has_penalties:
                continue
            if p.repetition_penalty != 1.0:
                # Tokens seen in the prompt or the output: shrink positive logits,
                # grow negative ones (the CTRL rule vLLM and HF use).
                seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=dev)
                seen = seen[seen < vocab]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if outputs and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(torch.tensor(outputs, dtype=torch.long, device=dev), minlength=vocab)[:vocab].float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask tokens outside top-k, top-p and min-p (after temperature)."""
        vocab, dev = logits.shape[1], logits.device
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = ranks >= torch.tensor(top_k, device=dev).unsqueeze(1)
            if any(tp < 1.0 for tp in top_p):
                probs = torch.softmax(sorted_logits.masked_fill(drop, _MASK), dim=-1)
                # Keep the smallest prefix whose mass reaches top_p: drop a token when
                # the mass before it already does. The top token always stays.
                mass_before = probs.cumsum(dim=-1) - probs
                drop |= mass_before >= torch.tensor(top_p, device=dev).unsqueeze(1)
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), _MASK)
        if any(mp > 0.0 for mp in min_p):
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev).unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, _MASK)
        return logits


def batched_logprobs(logprobs: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """Each row's chosen token (``tokens``) with its logprob and rank (1 + how many tokens
    are more likely), then the row's ``top_n`` most likely tokens with ranks 1 .. n; for
    every row of ``logprobs`` ([R, V], on any device) at once: found there, brought to the
    host in one transfer."""
    if not tokens:
        return []
    chosen_ids = torch.tensor(tokens, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)  # [R, 1]
    ranks = (logprobs > chosen).sum(dim=1, keepdim=True).to(logprobs.dtype) + 1
    k = min(max(top_n), logprobs.shape[1])
    parts = [chosen, ranks]
    if k > 0:
        values, indices = logprobs.topk(k, dim=1)
        parts += [values, indices.to(logprobs.dtype)]  # ids < 2**24: exact in float32
    host = torch.cat(parts, dim=1).cpu().tolist()
    out = []
    for row, token, n in zip(host, tokens, top_n):
        n = min(n, k)
        out.append(TokenLogprobs([token] + [int(t) for t in row[2 + k : 2 + k + n]], [row[0]] + row[2 : 2 + n],
                                 [int(row[1])] + list(range(1, n + 1))))
    return out
