"""Per-row token choice and text for the cached engine.

`SamplingParams` is what one request asks for; `Sampler` applies it to a batch's logits row by
row (repetition penalty, temperature, top-k, top-p, one seeded generator per row) and does the
draft/verify arithmetic of speculative decoding; `RowText` turns a row's tokens into text deltas
that never split a character or show part of a stop string, and says when a row ends;
`TokenEvent` is what the engine hands out per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import UserError


def positions_run(prompt_tokens: int, new_tokens: int) -> int:
    """Positions (cache columns) a prompt and its new tokens go through the model: the prompt's
    and every new token's but the last, which is sampled and never fed back. This, not prompt +
    new tokens, is what must fit the context: a prompt of the whole context can still be scored
    (its prompt log-probabilities) or continued by one token."""
    return prompt_tokens + max(new_tokens, 1) - 1


PROMPT_MODES = ("standard", "soft", "fused")
"""A feedback model's prompt modes (SamplingParams.prompt_mode)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples; every field is checked here (UserError names it)."""

    max_new_tokens: int = 64
    """Tokens to generate at most (the eos token and stop strings end earlier)."""
    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Sample only from the smallest set of tokens whose probability reaches top_p (1 = off)."""
    repetition_penalty: float = 1.0
    """CTRL penalty on tokens already in the prompt or output: positive logits / p, negative * p (1 = off)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the output already holds ([-2, 2]; 0 = off)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the output already holds it ([-2, 2]; 0 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's: (token id, bias in [-100, 100]) pairs added to those tokens' logits before
    sampling (after the penalties; -100 in effect bans a token, 100 all but forces it). A dict
    {id: bias} is accepted and stored sorted; at most 300 tokens."""
    stop: tuple[str, ...] = ()
    """Generation ends when the text contains one of these; the text is cut before it."""
    seed: int = 0
    """Seeds sampling and a random initial loop state; the same seed gives the same output."""
    stop_at_eos: bool = True
    """End a row when it emits the tokenizer's eos token."""
    logprobs: int | None = None
    """Report each generated token's log-probability under the model (log-softmax of the logits,
    before penalties, logit bias, temperature, top-k and top-p) and the `logprobs` likeliest tokens' (None = off;
    0 = the chosen token's only; at most 20)."""
    prompt_logprobs: int | None = None
    """Report each prompt token's log-probability given the ones before it (None for the first)
    and the `prompt_logprobs` likeliest tokens' at its position, from the prefill that also
    chooses the first token (on the row's first event; None = off; at most 20)."""
    prompt_mode: str | None = None
    """A feedback model's prompt mode (model/feedback.py): standard = no feedback at all; soft = the prompt
    read plainly, feedback from the prompt's last position on; fused = an extra prefill pass that reads
    pass 1's top states shifted by one (about 2x the prefill work), then feedback. None = the engine's
    (soft for a feedback model, standard otherwise)."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str, value: Any) -> UserError:
            return UserError(f"{name} {value!r}: {allowed}")

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1", self.max_new_tokens)
        if not is_num(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "must be a number in [0, 100] (0 = greedy)", self.temperature)
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)", self.top_k)
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]", self.top_p)
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be a number in (0, 100] (1 = off)", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be a number in [-2, 2] (0 = off)", getattr(self, name))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise bad("logit_bias", "must be (token id, bias) pairs or a dict {id: bias}", self.logit_bias) from None
        if (len(bias) > 300 or len({t for t, _ in bias}) < len(bias)
                or not all(is_int(t) and t >= 0 and is_num(b) and -100 <= b <= 100 for t, b in bias)):
            raise bad("logit_bias", "must map at most 300 distinct token ids >= 0 to biases in [-100, 100]",
                      self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be at most 16 non-empty strings", self.stop)
        object.__setattr__(self, "stop", stop)
        if not is_int(self.seed):
            raise bad("seed", "must be an integer", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not is_int(n) or not 0 <= n <= 20):
                raise bad(name, "must be an integer in [0, 20] or None (off)", n)
        if self.prompt_mode not in (None, *PROMPT_MODES):
            raise bad("prompt_mode", f"must be one of {', '.join(PROMPT_MODES)}", self.prompt_mode)
        object.__setattr__(self, "temperature", float(self.temperature))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_output(self) -> bool:
        """Whether the presence or frequency penalty needs the output's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


class Sampler:
    """Per-row sampling: repetition, presence and frequency penalties, logit bias, temperature,
    top-k, top-p, a seeded generator per row."""

    def __init__(self, plist: list[SamplingParams], prompts: list[list[int]], vocab: int, device: torch.device):
        self.plist, self.V, self.device = list(plist), vocab, device
        self.gens = [torch.Generator().manual_seed(sp.seed) for sp in plist]
        self.seen: Tensor | None = None            # (B, V) tokens in each row's prompt and output
        self.penalty: Tensor | None = None         # (B, 1)
        self.counts: Tensor | None = None          # (B, V) times each token is in each row's output
        self.pres_freq: Tensor | None = None       # (B, 2) presence and frequency penalties
        self.bias: Tensor | None = None            # (B, V) each row's logit bias
        self._prompts = [list(p) for p in prompts]
        self._update_kinds()

    def _update_kinds(self) -> None:
        self.plain = all(sp.greedy and sp.repetition_penalty == 1.0 and not sp.counts_output and not sp.logit_bias
                         for sp in self.plist)
        if self.seen is None and any(sp.repetition_penalty != 1.0 for sp in self.plist):
            self.seen = torch.zeros(len(self.plist), self.V, dtype=torch.bool, device=self.device)
            for b, p in enumerate(self._prompts):
                self.seen[b, torch.tensor(p, dtype=torch.long)] = True
            self.penalty = torch.tensor([[sp.repetition_penalty] for sp in self.plist], device=self.device)
        if self.counts is None and any(sp.counts_output for sp in self.plist):
            self.counts = torch.zeros(len(self.plist), self.V, device=self.device)
            self.pres_freq = torch.tensor([[sp.presence_penalty, sp.frequency_penalty] for sp in self.plist],
                                          device=self.device)
        if self.bias is None and any(sp.logit_bias for sp in self.plist):
            self.bias = torch.zeros(len(self.plist), self.V, device=self.device)
            for b, sp in enumerate(self.plist):
                self._set_bias(b, sp)

    def _set_bias(self, b: int, sp: SamplingParams) -> None:
        assert self.bias is not None
        self.bias[b] = 0
        if sp.logit_bias:
            ids, vals = zip(*sp.logit_bias)
            self.bias[b, torch.tensor(ids, device=self.device)] = torch.tensor(vals, device=self.device)

    def set_row(self, b: int, sp: SamplingParams, prompt: list[int]) -> None:
        """Row b now serves a new request (its own parameters, seed, seen tokens and counts)."""
        self.plist[b], self.gens[b], self._prompts[b] = sp, torch.Generator().manual_seed(sp.seed), list(prompt)
        if self.seen is not None and self.penalty is not None:
            self.seen[b] = False
            self.seen[b, torch.tensor(prompt, dtype=torch.long)] = True
            self.penalty[b] = sp.repetition_penalty
        if self.counts is not None and self.pres_freq is not None:
            self.counts[b] = 0
            self.pres_freq[b] = torch.tensor([sp.presence_penalty, sp.frequency_penalty])
        if self.bias is not None:
            self._set_bias(b, sp)
        self._update_kinds()

    def reorder(self, order: list[int]) -> None:
        """Row b now samples for the request row order[b] served (DecodeBatch.compact): its params,
        generator (mid-stream: the draws continue where they were), seen tokens, counts and bias."""
        self.plist, self.gens, self._prompts = ([xs[b] for b in order] for xs in (self.plist, self.gens, self._prompts))
        for name in ("seen", "penalty", "counts", "pres_freq", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[torch.tensor(order, device=t.device)])

    def __call__(self, logits: Tensor, rows: list[int] | None = None) -> Tensor:
        """(B', V) logits of `rows` (default all rows) -> (B',) next tokens."""
        if self.plain:
            return logits.argmax(-1)
        rows = list(range(len(self.plist))) if rows is None else rows
        logits = logits.float()
        if self.seen is not None and self.penalty is not None:
            logits = penalise(logits, self.seen[rows], self.penalty[rows])
        if self.counts is not None and self.pres_freq is not None:
            logits = penalise_counts(logits, self.counts[rows], self.pres_freq[rows])
        if self.bias is not None:
            logits = logits + self.bias[rows]
        out = logits.argmax(-1)
        for j, b in enumerate(rows):
            sp = self.plist[b]
            if not sp.greedy:
                probs = sampling_probs(logits[j], sp)
                out[j] = torch.multinomial(probs.cpu(), 1, generator=self.gens[b])[0]
        return out

    def observe(self, tokens: Tensor, rows: list[int] | None = None) -> None:
        """Tokens (B',) of `rows` (default all) join their rows' seen sets."""
        idx = torch.arange(tokens.shape[0]) if rows is None else torch.tensor(rows)
        if self.seen is not None:
            self.seen[idx, tokens] = True
        if self.counts is not None:
            self.counts[idx, tokens] += 1

    def observe_one(self, tok: int) -> None:
        if self.seen is not None:
            self.seen[0, tok] = True
        if self.counts is not None:
            self.counts[0, tok] += 1

    # batch-1 helpers for speculative decoding: `extra` are tokens drafted after the committed ones
    def _processed(self, logits: Tensor, extra: list[int]) -> Tensor:
        logits = logits.float()
        if self.seen is not None:
            seen = self.seen[0].clone()
            if extra:
                seen[torch.tensor(extra)] = True
            assert self.penalty is not None
            logits = penalise(logits[None], seen[None], self.penalty[:1])[0]
        if self.counts is not None and self.pres_freq is not None:
            counts = self.counts[0].clone()
            for t in extra:
                counts[t] += 1
            logits = penalise_counts(logits[None], counts[None], self.pres_freq[:1])[0]
        if self.bias is not None:
            logits = logits + self.bias[0]
        return logits

    def pick(self, logits: Tensor, extra: list[int]) -> tuple[int, Tensor | None]:
        """A draft token and the draft distribution q (None when greedy)."""
        sp = self.plist[0]
        lg = self._processed(logits, extra)
        if sp.greedy:
            return int(lg.argmax()), None
        q = sampling_probs(lg, sp).cpu()
        return int(torch.multinomial(q, 1, generator=self.gens[0])[0]), q

    def verify(self, logits: Tensor, drafts: list[int], qs: list[Tensor | None]) -> tuple[int, int]:
        """logits (k+1, V) at full depth -> (accepted drafts, the verifier's next token)."""
        sp, g = self.plist[0], self.gens[0]
        for j, d in enumerate(drafts):
            lg = self._processed(logits[j], drafts[:j])
            if sp.greedy:
                v = int(lg.argmax())
                if v != d:
                    return j, v
                continue
            p, q = sampling_probs(lg, sp).cpu(), qs[j]
            assert q is not None
            if float(torch.rand((), generator=g)) < min(1.0, float(p[d] / q[d].clamp_min(1e-30))):
                continue
            resid = (p - q).clamp_min(0)
            resid = resid / resid.sum() if float(resid.sum()) > 0 else p
            return j, int(torch.multinomial(resid, 1, generator=g)[0])
        lg = self._processed(logits[len(drafts)], drafts)
        if sp.greedy:
            return len(drafts), int(lg.argmax())
        return len(drafts), int(torch.multinomial(sampling_probs(lg, sp).cpu(), 1, generator=g)[0])


def token_logprobs(logits: Tensor, tokens: list[int], top: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """(B', V) logits, each row's chosen token and how many alternatives it wants -> per row
    (the token's log-probability, [(token, log-probability)] of the `top` likeliest, best first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).view(-1, 1))[:, 0].tolist()
    n = max(top)
    vals, ids = torch.topk(lp, n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    vals_l, ids_l = vals.tolist(), ids.tolist()
    return [(c, list(zip(ids_l[j][:k], vals_l[j][:k]))) for j, (c, k) in enumerate(zip(chosen, top))]


def penalise(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """CTRL repetition penalty on tokens seen so far: (B, V), (B, V) bool, (B, 1)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def penalise_counts(logits: Tensor, counts: Tensor, pres_freq: Tensor) -> Tensor:
    """OpenAI's presence and frequency penalties: (B, V), (B, V) output counts, (B, 2)."""
    return logits - pres_freq[:, :1] * (counts > 0) - pres_freq[:, 1:] * counts


def sampling_probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """(V,) processed logits -> sampling distribution after temperature, top-k and top-p."""
    lg = logits / sp.temperature
    if 0 < sp.top_k < lg.shape[-1]:
        kth = torch.topk(lg, sp.top_k).values[-1]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    probs = torch.softmax(lg, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p >= sp.top_p            # keep the smallest prefix reaching top_p (at least one)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


@dataclass
class TokenEvent:
    """One generated token of one row (what `Engine.stream` yields)."""

    row: int
    token: int
    text: str
    """Text newly safe to show (complete characters, never part of a stop string)."""
    rounds: int
    """Rounds run for this token."""
    finish_reason: str | None = None
    """On the row's last event: "stop" (eos or a stop string) or "length"."""
    logprob: float | None = None
    """The token's log-probability under the model, when its SamplingParams asked (`logprobs`)."""
    top_logprobs: list[tuple[int, float]] | None = None
    """The likeliest tokens and their log-probabilities, best first (as many as asked)."""
    prompt_logprobs: list[float | None] | None = None
    """On a row's first event, when asked: each prompt token's log-probability (None for the first)."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With `prompt_logprobs`: the likeliest tokens at each prompt position (None for the first)."""


class RowText:
    """Incremental detokenisation for one row: complete characters only, stop strings cut."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], deltas: bool):
        self.tok, self.stops, self.deltas = tokenizer, stops, deltas
        self.ids: list[int] = []
        self.shown = 0          # characters already handed out
        self.final: str | None = None

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; return (new safe text, whether a stop string ended the row)."""
        self.ids.append(token)
        if self.tok is None or not (self.deltas or self.stops):
            return "", False
        text = self.tok.decode(self.ids)
        if self.stops:
            lo = max(0, self.shown - max(map(len, self.stops)))
            hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
            if hits:
                self.final = text[:min(hits)]
                delta = self.final[self.shown:] if self.deltas else ""
                self.shown = len(self.final)
                return delta, True
        if not self.deltas:
            return "", False
        safe = len(text)
        while safe > self.shown and text[safe - 1] == "\ufffd":   # maybe a character cut in half
            safe -= 1
        for s in self.stops:                                       # maybe the start of a stop string
            for n in range(min(len(s) - 1, safe - self.shown), 0, -1):
                if text[safe - n:safe] == s[:n]:
                    safe -= n
                    break
        delta = text[self.shown:safe]
        self.shown = safe
        return delta, False

    def add(self, token: int, eos: bool, last: bool) -> tuple[str, str | None]:
        """A row's next token: (text to show, why the row ends: "stop", "length" or None). `eos`:
        the token is the end-of-sequence token (shown as nothing); `last`: the row may not have more."""
        if eos:
            return self.finish(), "stop"
        delta, hit = self.push(token)
        if hit:
            return delta + self.finish(), "stop"
        if last:
            return delta + self.finish(), "length"
        return delta, None

    def finish(self) -> str:
        """The rest of the text (at the end of the row)."""
        if self.tok is None:
            return ""
        text = self.final if self.final is not None else self.tok.decode(self.ids)
        if not self.deltas:
            return text
        delta = text[self.shown:]
        self.shown = len(text)
        return delta
