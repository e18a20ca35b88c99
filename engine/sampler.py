"""Pick each sequence's next token from its logits, as its SamplingParams say.

Order of operations (vLLM's): a grammar's mask (applied by the engine before this), then the
request's logit adjustments (allowed_token_ids, bad words, logit_bias), then the penalties
(repetition over prompt and output, frequency and presence over the output), then
temperature, then top-k, top-p and min-p filters, then one draw from the sequence's own
generator. Greedy rows take the argmax after the penalties. Reported log-probabilities are
those of the distribution the grammar allows, before any of the request's own transforms.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass

import torch

from engine import penalties
from engine.device_caps import triton_module
from engine.host_to_device import to_device, to_host
from engine.penalties import PenaltyHistory
from engine.sequence import Sequence, TokenLogprob


logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1
_UINT64_MASK = (1 << 64) - 1
_INT_HASH_MODULUS = sys.hash_info.modulus  # Python hashes integers modulo this


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: list[int] | None = None) -> None:
        # Requests without a seed of their own draw from this engine-wide generator (CPU).
        self.default_generator = torch.Generator()
        self.default_generator.manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids or [])
        self._buffer: torch.Tensor | None = None  # scratch kept between steps (_scratch)
        self.penalties = PenaltyHistory()  # the penalised requests' token counts, kept between steps
        self.fused_top_k_draws = True  # top-k rows' filters and draw in one Triton launch on CUDA (off once it fails)
        self._generators: dict[torch.device, torch.Generator] = {}  # _device_generator's
        self._keyed = torch.Generator()  # re-seeded with a seeded row's draw key (_keyed_uniforms)

    @staticmethod
    def make_generator(seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator()
        generator.manual_seed(seed)
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        draft_token_ids: list[int | None] | None = None,
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> list[tuple[int, TokenLogprob | None]]:
        """Next token (and its log-probabilities if asked) for each row of ``logits``.

        ``draft_token_ids``: per row, a speculative token proposed there (None: none), and
        ``draft_probs`` the proposer's distribution it was drawn from (None: proposed with
        certainty, as n-gram lookup does). A greedy row takes its argmax as always (the draft is
        accepted when they agree). A sampled row keeps the draft with probability
        min(1, p/q) of it and otherwise draws from max(p - q, 0) renormalized: whichever way,
        the row's token is distributed as the target's p (rejection sampling). ``seqs[i]`` may
        be a ``speculation.DraftRow``, the sequence as it stands at that row."""
        raw_logits = logits
        logits = self._adjust(logits, seqs)
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        token_ids = [0] * len(seqs)
        if greedy_rows:
            # All greedy (the common case): argmax in place, not over a copy of every row's logits
            # (6 MB a step at 32 rows of a 49k vocabulary).
            greedy_logits = logits if not sampled_rows else logits[to_device(greedy_rows, torch.long, logits.device)]
            for row, token in zip(greedy_rows, greedy_logits.argmax(dim=-1).tolist()):
                token_ids[row] = token
        # A sampled row without a draft draws as in a step without drafts, whatever its
        # neighbours propose: a seeded request repeats whether or not they speculate. A seeded
        # row with a draft draws so too, and keeps the draft where the draw is it (the engine
        # accepts a draft its row's token equals): its tokens are its seed's whether it got a
        # draft or not, which depends on its neighbours (the step's token budget, free blocks).
        # That is the target's p exactly; for a draft proposed with certainty (n-gram) it keeps
        # the draft with probability p(draft), as the accept test does; a draft model's lose
        # what min(1, p/q) adds over p(draft), for seeded rows only.
        drafted = [r for r in sampled_rows if draft_token_ids is not None and draft_token_ids[r] is not None and seqs[r].generator is None]
        verified_rows = set(drafted)
        plain = [r for r in sampled_rows if r not in verified_rows]
        if plain:
            for row, token in zip(plain, self._draw_plain(logits, seqs, plain)):
                token_ids[row] = token
        if drafted:
            # Verifying a draft is per row (an accept test, then maybe a residual draw), each a
            # few scalar reads: on the CPU, those rows' logits only.
            proposals = [None if draft_probs is None else draft_probs[r] for r in drafted]
            verified = self._verify_drafts(_rows_of(logits, drafted).cpu(), [seqs[r] for r in drafted], [draft_token_ids[r] for r in drafted], proposals)
            for row, token in zip(drafted, verified):
                token_ids[row] = token
        reported = LogprobTensors.of(raw_logits, seqs, to_device(token_ids, torch.long, raw_logits.device))
        return list(zip(token_ids, LogprobTensors.by_row(reported, token_ids)))

    @staticmethod
    def draws_on_device(seq: Sequence, device: torch.device) -> bool:
        """Whether ``sample_on_device`` can draw the row's token: greedy, or on CUDA a row
        ``_draw_on_device`` draws (temperature, top-k, top-p, min-p; seeded or not);
        and nothing the host must decide from the sequence's latest tokens (a grammar's mask, bad
        words, a thinking budget the unread token may have met). Penalties, logit_bias,
        allowed_token_ids, min_tokens and a thinking budget are applied on the device."""
        params = seq.params
        if seq.grammar is not None or params.bad_words_token_ids:
            return False
        if seq.thinking is not None and seq.thinking.may_close_after(seq.num_pending_tokens):
            return False  # whether the unread token closed the thinking decides this one
        return params.greedy or _drawn_on_device(seq, device)

    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence], pending=None) -> tuple[torch.Tensor, "LogprobTensors | None"]:
        """Each row's token as a tensor on the logits' device, and the log-probabilities the rows
        that ask for them report, never read by the host here (rows ``draws_on_device`` accepts):
        the same draws and numbers ``sample`` gives them. ``pending``: the step in flight's
        samples (engine.model_runner.PendingSamples), each sequence's newest token, which the
        penalties count."""
        tokens = _rows_in_parts(self._adjust(logits, seqs, pending), [
            ([i for i, s in enumerate(seqs) if s.params.greedy], lambda rows, _: rows.argmax(dim=-1)),
            ([i for i, s in enumerate(seqs) if not s.params.greedy],
             lambda rows, index: self._draw_on_device(rows, [seqs[i].params for i in index], [self.draw_key(seqs[i]) for i in index])),
        ])
        return tokens, LogprobTensors.of(logits, seqs, tokens)

    def _draw_on_device(self, logits: torch.Tensor, params: list, keys: list[int | None] | None = None) -> torch.Tensor:
        """One draw per sampled row on CUDA, left there (nothing the host reads, so an overlapped
        step never waits): temperature, then top-k, top-p and min-p (vLLM's order). Rows with
        top-k draw among their top-k candidates (``_draw_among_top_k``), the others over their
        whole row (``_draw_whole_rows``). ``keys``: per row, a seeded request's draw key
        (``draw_key``: its seed and the token's position), None for an unseeded row: a keyed row's
        draw depends only on its logits, its parameters and its key, never on the rows beside it,
        so a seeded request repeats whatever shares its steps and whether they overlap. (Keyed
        top-k rows take their candidates with their own k: with a neighbour's larger k, tied
        logits could come back in another order, and the same uniform land on another token.)"""
        keys = keys or [None] * len(params)

        def among_top_k(rows: torch.Tensor, index: list[int]) -> torch.Tensor:
            return self._draw_among_top_k(rows, [params[i] for i in index], [keys[i] for i in index])

        top_k_groups: dict[int | None, list[int]] = {}  # the unkeyed rows together (None), keyed ones by their k
        for i, p in enumerate(params):
            if p.top_k > 0:
                top_k_groups.setdefault(None if keys[i] is None else p.top_k, []).append(i)
        return _rows_in_parts(logits, [
            *[(rows, among_top_k) for rows in top_k_groups.values()],
            ([i for i, p in enumerate(params) if p.top_k <= 0],
             lambda rows, index: self._draw_whole_rows(rows, [params[i] for i in index], [keys[i] for i in index])),
        ])

    def _draw_among_top_k(self, logits: torch.Tensor, params: list, keys: list[int | None]) -> torch.Tensor:
        """Rows with top-k (chat models' generation configs set it): ``topk`` once over the
        vocabulary, then the filters and an inverse-CDF draw over a few dozen candidates; the
        uniforms from a CUDA generator seeded from the engine's, a keyed row's from its key (made
        on the host, which knows the key before the step: a copy in, no read back). (FlashInfer's
        top-k/top-p kernel with per-row k masked the whole vocabulary, took its softmax and
        sampled it: on an H200, 0.79 ms for 64 rows of a 152k vocabulary, 19% of the 1.5B
        shape's decode step.) On CUDA the filters and the draw after ``topk`` are one Triton
        launch (engine.triton_sampling), where the torch ops were about 70."""
        uniforms = torch.rand(len(params), dtype=torch.float64, device=logits.device, generator=self._device_generator(logits.device))
        keyed = [i for i, key in enumerate(keys) if key is not None]
        if keyed:
            uniforms[to_device(keyed, torch.long, logits.device)] = to_device(self._keyed_uniforms([keys[i] for i in keyed]), torch.float64, logits.device)
        width = min(logits.shape[-1], max(p.top_k for p in params))
        if self.fused_top_k_draws and _fused_top_k_draws(logits) and width <= _triton_sampling().MAX_CANDIDATES:
            # The filters and the draw in one launch after topk (engine.triton_sampling).
            top, token_ids = logits.topk(width, dim=-1)
            try:
                return _triton_sampling().draw_among_top_k(
                    top, token_ids, [_held_temperature(p) for p in params], [p.top_k for p in params], [_held_top_p(p) for p in params],
                    [p.min_p for p in params], uniforms)
            except Exception:
                # A kernel that does not build here (a Triton or driver this was never run on).
                logger.exception("the top-k draw's Triton kernel failed; drawing top-k rows with torch ops from now on")
                self.fused_top_k_draws = False
        probs, token_ids = _top_k_candidates(logits, params)
        return token_ids.gather(1, _inverse_cdf_no_sync(probs, uniforms).unsqueeze(1)).squeeze(1)

    def _keyed_uniforms(self, keys: list[int]) -> torch.Tensor:
        """One uniform in [0, 1) per draw key, a function of the key alone."""
        uniforms = torch.empty(len(keys), dtype=torch.float64)
        for i, key in enumerate(keys):
            self._keyed.manual_seed(key)
            uniforms[i] = torch.rand((), generator=self._keyed, dtype=torch.float64)
        return uniforms

    def _draw_whole_rows(self, logits: torch.Tensor, params: list, keys: list[int | None]) -> torch.Tensor:
        """Rows without top-k need the whole row: FlashInfer's softmax with the rows'
        temperatures, then its top-p kernel (rejection, no sort; top_p = 1 is a plain draw); with
        min-p among the rows, its top-p renormalization, then its min-p kernel: min-p's threshold
        is relative to the row's largest probability, which the nucleus keeps, so the survivors
        are those of both filters on the same distribution (``_filter_sorted``'s), and a row
        without min-p draws from its nucleus there. The kernels' randomness is one seed for their
        whole batch, each row's stream picked by its place in it, so only the unkeyed rows share
        their calls, seeded from the engine's generator. The keyed rows, all at once, keep what
        FlashInfer's (deterministic) top-p renormalization and min-p leave and draw by
        ``keyed_race``, whose noise is a function of each row's key alone: a keyed row's token
        depends on its probabilities and its key, and those on the batch only as far as its
        kernels round differently with the batch's size (FlashInfer's softmax splits a row when
        rows are few; the model's GEMMs pick tiles by the row count). (One FlashInfer call a
        keyed row, seeded with its key, took 8.4 ms for 64 rows of a 152k vocabulary on an H200.)"""
        sampling = _flashinfer_sampling()
        # The floor keeps logits / temperature finite (FlashInfer divides before its running
        # maximum); below it every token but the largest already has probability exactly 0.
        temperatures = _temperatures(params, logits.device)
        probs = sampling.softmax(logits, temperature=temperatures)
        top_p = _top_ps(params, logits.device)
        min_p = to_device([p.min_p for p in params], torch.float32, logits.device) if any(p.min_p > 0.0 for p in params) else None

        def draw(seed: int):
            def rows_drawn(rows: torch.Tensor, index: list[int]) -> torch.Tensor:
                if params[index[0]].min_p == 0.0:  # a part's rows all have min-p or all have none
                    return sampling.top_p_sampling_from_probs(rows, _rows_of(top_p, index), seed=seed, offset=0).long()
                if any(params[i].top_p < 1.0 for i in index):
                    rows = sampling.top_p_renorm_probs(rows, _rows_of(top_p, index))
                return sampling.min_p_sampling_from_probs(rows, _rows_of(min_p, index), seed=seed, offset=0).long()
            return rows_drawn

        def race(with_top_p: bool):
            def rows_drawn(rows: torch.Tensor, index: list[int]) -> torch.Tensor:
                if with_top_p:  # deterministic: its default sums with float atomics
                    rows = sampling.top_p_renorm_probs(rows, _rows_of(top_p, index), is_deterministic=True)
                if min_p is not None:
                    rows = _min_p_kept(rows, _rows_of(min_p, index))
                return keyed_race(rows, [keys[i] for i in index])
            return rows_drawn

        # Rows without min-p never go through the min-p kernel: at min_p 0 it counts a token of
        # probability 0 (cut by top-p, or masked by allowed_token_ids or min_tokens) as drawable.
        unkeyed = [[i for i, key in enumerate(keys) if key is None and (params[i].min_p > 0.0) == with_min_p] for with_min_p in (False, True)]
        parts = [(rows, draw(int(torch.randint(0, 2**62, (1,), generator=self.default_generator)))) for rows in unkeyed if rows]
        # Keyed rows without top-p skip the renormalization: its radix kernel rescales a row at top_p 1 too.
        parts += [([i for i, key in enumerate(keys) if key is not None and (params[i].top_p < 1.0) == with_top_p], race(with_top_p))
                  for with_top_p in (True, False)]
        return _rows_in_parts(probs, parts)

    def _device_generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device``, re-seeded from the engine's generator for each use: the
        draws follow the engine's seed and one stream, as the host's do."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.default_generator)))
        return generator

    def probabilities(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's sampling distribution over the vocabulary, as ``sample`` would draw from it
        (sampled rows only: greedy ones are argmax, no distribution)."""
        return self._probabilities(self._adjust(logits, seqs), [s.params for s in seqs])

    def draw_generator(self, seq: Sequence, salt: int = 0) -> torch.Generator:
        """The generator a row draws from: a seeded request's is re-seeded with its ``draw_key``,
        so the draw for token i depends only on (seed, i, salt); a request resumed on another
        worker of the same kind (or recomputed) draws exactly the same. (A CUDA worker with
        FlashInfer draws a seeded row without top-k through FlashInfer's random stream, keyed
        alike, not this generator: the same seed gives another draw on a CPU worker.)"""
        key = self.draw_key(seq, salt)
        if key is None:
            return self.default_generator
        seq.generator.manual_seed(key)
        return seq.generator

    def _own_generator(self, seq: Sequence) -> torch.Generator:
        """``draw_generator``'s, as a generator of the row's own (a seeded one: a new one keyed
        as it would be), for rows that draw more than once in a step side by side."""
        key = self.draw_key(seq)
        return self.default_generator if key is None else self.make_generator(key)

    @staticmethod
    def draw_key(seq: Sequence, salt: int = 0) -> int | None:
        """A seeded request's key for the token it draws now (None: unseeded), from its seed and
        that token's position in its output, which counts a token the step in flight sampled and
        the host has not read (engine.overlap): an overlapped step draws position i as a step run
        at once does."""
        if seq.generator is None:
            return None
        position = seq.params.num_resumed_tokens + seq.num_output_tokens + seq.num_pending_tokens
        seed = seq.params.seed
        if not 0 <= seed < _INT_HASH_MODULUS:
            # Python hashes an integer modulo 2^61 - 1 (and -1 as -2): a seed outside that range
            # (a negative one, as vLLM takes) keys by its two unsigned 32-bit halves, distinct
            # from every seed inside it (whose keys stay as they were).
            unsigned = seed & _UINT64_MASK
            seed = (unsigned >> 32, unsigned & 0xFFFFFFFF)
        key = (seed, position) if salt == 0 else (seed, position, salt)
        return hash(key) & _SEED_MASK

    def _adjust(self, logits: torch.Tensor, seqs: list[Sequence], pending=None) -> torch.Tensor:
        """Every per-request change to the logits before temperature, in vLLM's order
        (``pending``: as ``sample_on_device`` takes it)."""
        if not any(_adjusts(s.params) for s in seqs):  # the common case: one look per row
            return logits
        logits = _apply_logit_adjustments(logits, seqs)
        logits = self.penalties.apply(logits, seqs, pending)
        logits = self._suppress_early_stops(logits, seqs, pending)
        return _close_spent_thinking(logits, seqs)

    def _suppress_early_stops(self, logits: torch.Tensor, seqs: list[Sequence], pending=None) -> torch.Tensor:
        """No EOS or stop token id for a request short of its ``min_tokens`` (its tokens counted
        with one the step in flight sampled, ``pending``, and the host has not read)."""
        early = [i for i, s in enumerate(seqs) if s.num_output_tokens + penalties.num_unread(s, pending) < s.params.min_tokens]
        if not early:
            return logits
        pairs = []  # (row, token) of every stop a row may not take yet
        for row in early:
            params = seqs[row].params
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            pairs.extend((row, token) for token in sorted(stops))
        if not pairs:
            return logits
        logits = logits.clone()
        logits[_pair_index(pairs, logits.device)] = float("-inf")
        return logits

    def _probabilities(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, then the filters: each row's probabilities, in vocabulary order."""
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for group in _sampling_groups(logits, params):
            index = to_device(group.rows, torch.long, logits.device)
            if group.token_ids is None:
                out[index] = group.probs
            else:
                out[index] = torch.zeros(len(group.rows), logits.shape[-1], device=logits.device).scatter_(1, group.token_ids, group.probs)
        return out

    def _verify_drafts(self, logits: torch.Tensor, seqs: list, drafts: list[int], proposals: list[torch.Tensor | None]) -> list[int]:
        """Each row's token where it carries a draft (rejection sampling: the token is distributed
        as the target's p, see ``sample``), on the CPU."""
        probs = self._probabilities(logits, [s.params for s in seqs])
        tokens: list[int] = []
        for local, seq in enumerate(seqs):
            generator = self.draw_generator(seq)
            row_probs, draft, proposal = probs[local], drafts[local], proposals[local]
            if proposal is not None:
                proposal = proposal.to(row_probs.device)
            # Accept with min(1, p/q); q = 1 for a draft proposed with certainty.
            threshold = float(row_probs[draft]) if proposal is None else float(row_probs[draft]) / float(proposal[draft])
            if float(torch.rand((), generator=generator)) < threshold:
                tokens.append(draft)
                continue
            if proposal is None:
                row_probs = row_probs.clone()
                row_probs[draft] = 0.0  # rejected: the rest of the distribution, renormalized
            else:
                # Rejected: draw from what p has beyond q.
                residual = (row_probs - proposal).clamp_(min=0.0)
                # p <= q everywhere only if p == q: never rejected.
                row_probs = residual if float(residual.sum()) > 0.0 else row_probs
            uniform = torch.rand(1, generator=generator, dtype=torch.float64)
            tokens.append(int(_inverse_cdf(row_probs.unsqueeze(0), uniform)[0]))
        return tokens

    def _draw_plain(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> list[int]:
        """One draw per row, batched: each row's uniform from its own generator, the inverse CDF
        over its distribution (in vocabulary order, or over its filtered candidates)."""
        tokens = [0] * len(rows)
        fused = [i for i, r in enumerate(rows) if _drawn_on_device(seqs[r], logits.device)]
        if fused:
            # On CUDA: drawn there (_draw_on_device), the same distribution as the groups below,
            # and the same draws an overlapped step makes (a seeded row's keyed alike).
            picks = self._draw_on_device(
                _rows_of(logits, [rows[i] for i in fused]), [seqs[rows[i]].params for i in fused], [self.draw_key(seqs[rows[i]]) for i in fused]
            ).tolist()
            for local, token in zip(fused, picks):
                tokens[local] = token
        taken = set(fused)
        undecided_rows: dict[int, torch.Generator] = {}
        # Rows without top-k (no filter, top-p, min-p) draw by rejection (_draw_by_rejection): no sort.
        chosen = [i for i in range(len(rows)) if i not in taken and _rejection_draw_applies(seqs[rows[i]].params)]
        if chosen:
            weights = self._scratch(len(chosen), logits)
            _exp_scaled(_rows_of(logits, [rows[i] for i in chosen]), [seqs[rows[i]].params for i in chosen], out=weights)
            # A seeded row draws its rounds from a generator of its own, keyed by its position: a
            # sequence's rows (its drafts' and its own) share the sequence's generator, and
            # re-seeded in turn, every row drew from the last one's key.
            generators = [self._own_generator(seqs[rows[i]]) for i in chosen]
            picks, undecided = _draw_by_rejection(weights, [seqs[rows[i]].params for i in chosen], generators)
            for local, token in enumerate(picks):
                tokens[chosen[local]] = token
            taken.update(chosen[local] for local in range(len(chosen)) if local not in undecided)
            # A row the rounds left undecided draws on from its generator as the rounds left it:
            # re-seeded, it gave round one's uniform again, which that round's rejection conditions.
            undecided_rows = {chosen[local]: generators[local] for local in undecided}
        rest = [i for i in range(len(rows)) if i not in taken]
        if not rest:
            return tokens

        def generator(i: int) -> torch.Generator:
            """(Re-seeded here, a row's generator gives its uniform at once, below.)"""
            return undecided_rows[i] if i in undecided_rows else self.draw_generator(seqs[rows[i]])

        params = [seqs[rows[i]].params for i in rest]
        for group in _sampling_groups(_rows_of(logits, [rows[i] for i in rest]), params):
            uniforms = torch.cat([torch.rand(1, generator=generator(rest[i]), dtype=torch.float64) for i in group.rows])
            picks = _inverse_cdf(group.probs, uniforms.to(group.probs.device))
            if group.token_ids is not None:
                picks = group.token_ids.gather(1, picks.unsqueeze(1)).squeeze(1)
            for local, token in zip(group.rows, picks.tolist()):
                tokens[rest[local]] = token
        return tokens

    def _scratch(self, rows: int, logits: torch.Tensor) -> torch.Tensor:
        """A float32 [rows, vocab] buffer kept between steps: a fresh 12 MB tensor a step (64 rows
        of a 49k vocabulary) is fresh pages for the kernel to fault in, which took longer than the
        arithmetic (a temperature-only draw: 29 ms fresh, 7 ms reused, one thread)."""
        vocab = logits.shape[-1]
        buffer = self._buffer
        if buffer is None or buffer.device != logits.device or buffer.shape[1] != vocab or buffer.shape[0] < rows:
            buffer = self._buffer = torch.empty((max(rows, 1), vocab), dtype=torch.float32, device=logits.device)
        return buffer[:rows]


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` (any tensor's rows), without a copy when they are every row in order (the common case)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[to_device(rows, torch.long, logits.device)]  # no stream synchronization: a step may be in flight


def _rows_in_parts(logits: torch.Tensor, parts: list) -> torch.Tensor:
    """One token per row of ``logits``: ``parts`` split the rows, each ``(rows, fn)`` with ``fn``
    given those rows' logits and their indices; each result lands in its rows' places (a part
    holding every row gives its result as is)."""
    parts = [(rows, fn) for rows, fn in parts if rows]
    if len(parts) == 1:
        rows, fn = parts[0]
        return fn(logits, rows)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for rows, fn in parts:
        tokens[to_device(rows, torch.long, logits.device)] = fn(_rows_of(logits, rows), rows)
    return tokens


def _exp_scaled(logits: torch.Tensor, params: list, out: torch.Tensor) -> torch.Tensor:
    """exp((logits - the row's largest) / temperature) into ``out``: each row's distribution up to
    its normalizer, with its most likely token's weight exactly 1. Shifted before dividing (as
    _sampling_groups): a temperature of 1e-40 then sends the others to 0, never inf - inf."""
    torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=out)
    out.div_(_temperatures(params, out.device).unsqueeze(1))
    return out.exp_()


# Inverse-CDF draws in two levels (_inverse_cdf): a row's probabilities in blocks of this many,
# the block found on the blocks' cumulative sums, then the token inside it. torch.multinomial took
# 0.77 ms per row of a 49k vocabulary here (37% of a batch-32 decode step of the 135M model).
_DRAW_BLOCK = 64


def _drawn_on_device(seq: Sequence, device: torch.device) -> bool:
    """Whether ``Sampler._draw_on_device`` draws the row on ``device``: a sampled row on CUDA with
    top-k (torch alone), or without where FlashInfer is installed."""
    return device.type == "cuda" and (seq.params.top_k > 0 or _flashinfer_sampling() is not None)


# Temperatures are held inside [1e-30, 1e30] where they divide logits (float32). Below, a
# temperature rounds to 0 in float32 (under 1.4e-45), and the largest logit's 0 / 0 was NaN (a
# draw of the vocabulary's last token, an IndexError, a draft model's multinomial raising); float32
# logits (|x| < 1e4) over 1e-30 stay finite, and a gap of one float32 step between two logits
# over it is already a factor exp(-1e20) = 0 in probability, as with any smaller temperature.
# Above, it rounds to inf, and a masked token's -inf / inf was NaN (a token allowed_token_ids or a
# grammar bans); over 1e30 every finite logit is already 0, a uniform draw, as at any larger one.
_MIN_TEMPERATURE, _MAX_TEMPERATURE = 1e-30, 1e30
# top_p below this is raised to it (float32 rounds under 1.4e-45 to 0, and a nucleus of mass 0
# kept no token at all): any top_p this small keeps the most likely token alone.
_MIN_TOP_P = 1e-30


def _temperatures(params: list, device) -> torch.Tensor:
    """The rows' temperatures, float32, held inside [_MIN_TEMPERATURE, _MAX_TEMPERATURE]."""
    return to_device([_held_temperature(p) for p in params], torch.float32, device)


def _held_temperature(params) -> float:
    return min(max(params.temperature, _MIN_TEMPERATURE), _MAX_TEMPERATURE)


def _top_ps(params: list, device) -> torch.Tensor:
    """The rows' top_p, float32, at least _MIN_TOP_P."""
    return to_device([_held_top_p(p) for p in params], torch.float32, device)


def _held_top_p(params) -> float:
    return max(params.top_p, _MIN_TOP_P)


def _triton_sampling():
    return triton_module("engine.triton_sampling")


def _fused_top_k_draws(logits: torch.Tensor) -> bool:
    """Whether top-k rows' filters and draw run as one Triton launch: float32 logits on CUDA."""
    return logits.device.type == "cuda" and logits.dtype == torch.float32 and _triton_sampling() is not None


@functools.cache
def _flashinfer_sampling():
    """FlashInfer's sampling kernels, or None where it is not installed."""
    try:
        import flashinfer.sampling
    except Exception:
        return None
    return flashinfer.sampling


def _min_p_kept(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``probs`` with what min-p removes zeroed: below min_p times the row's largest (renormalized
    or not, the ratio is the same)."""
    return probs * (probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True))


# fmix32, MurmurHash3's finalizer: the noise's per-token hash (a bijection of 32-bit words with
# full avalanche), computed in int64 and kept to 32 bits.
_MASK32 = 0xFFFFFFFF
_FMIX = (0x85EBCA6B, 0xC2B2AE35)


def keyed_race(weights: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """One token per row of ``weights`` (non-negative, any scale; [rows, vocab]) drawn with
    probability proportional to its weight, by the exponential race: the token with the largest
    weight / E, E ~ Exp(1) independent per token, wins with exactly that probability. Each E
    comes from a hash of the row's key and the token, so a row's draw depends on its weights and
    its key alone, never on the rows beside it, and all rows draw in a dozen batched kernels."""
    rows, vocab = weights.shape
    device = weights.device
    seeds = to_device([_key_word(key) for key in keys], torch.long, device).unsqueeze(1)
    h = torch.arange(vocab, device=device).unsqueeze(0) ^ seeds
    for multiplier, shift in ((_FMIX[0], 16), (_FMIX[1], 13), (None, 16)):
        h = h ^ (h >> shift)
        if multiplier is not None:
            # h * multiplier mod 2^32 in halves of the multiplier: no product passes 2^48, so
            # nothing relies on signed int64 overflow wrapping.
            low, high = multiplier & 0xFFFF, multiplier >> 16
            h = (h * low + (((h * high) & 0xFFFF) << 16)) & _MASK32
    # (h + 1/2) / 2^32: uniform in (0, 1), never 0 or 1; in float64, which holds 32 bits exactly.
    exponential = -torch.log((h.double() + 0.5) * 2.0**-32)
    return torch.argmax(weights.double() / exponential, dim=-1)


def _key_word(key: int) -> int:
    """A draw key (up to 63 bits) mixed into one 32-bit word (splitmix64's finalizer, folded)."""
    z = (key + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z ^ (z >> 32)) & _MASK32


def _top_k_candidates(logits: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that all have top-k: each row's probabilities over its largest logits (descending;
    as many columns as the largest top_k, a row's own filters masking the rest to 0) and their
    token ids. The filters are ``_sampling_groups``' for such rows: temperature, top-k, then top-p
    and min-p on what top-k kept."""
    # torch.topk, not FlashInfer's radix top-k: that module's JIT build did not finish in 9 minutes
    # on 16 cores of an H200 machine (session 22), a first top-k request's wait on a fresh server.
    top, token_ids = logits.topk(min(logits.shape[-1], max(p.top_k for p in params)), dim=-1)
    temperatures = _temperatures(params, logits.device).unsqueeze(1)
    values = ((top - top[:, :1]) / temperatures).float()  # shifted first: a tiny temperature never gives inf - inf
    kept = _filter_sorted(values, params, torch.zeros((len(params), 1), dtype=torch.float32, device=logits.device))
    return torch.softmax(kept, dim=-1), token_ids


def _inverse_cdf_no_sync(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``_inverse_cdf`` for narrow rows, without reading anything on the host: the index where a
    row's cumulative probability first exceeds ``uniforms`` x its total. Past a row's last token of
    positive probability its sum no longer grows, so only a rounding edge can land there: such a
    pick is moved back onto that last token."""
    cdf = probs.double().cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(picks, last_positive)


# Rounds of the rejection draw (_draw_by_rejection) before a row still undecided is drawn by
# sorting instead: each round accepts a row with probability top_p or more, so with top_p 0.9 a
# row is left after 8 rounds once in 10^8 draws.
_MAX_REJECTION_ROUNDS = 8


def _rejection_draw_applies(params) -> bool:
    """Rows without top-k (no filter, top-p, min-p): drawn without sorting their vocabulary."""
    return params.top_k <= 0


def _draw_by_rejection(weights: torch.Tensor, params: list, generators: list[torch.Generator]) -> tuple[list[int], set[int]]:
    """Draws of rows without top-k (no filter, top-p, min-p) without a sort (FlashInfer's method, in batched tensor ops), from each
    row's ``weights`` (``_exp_scaled``: its distribution p up to a normalizer, largest 1; changed).

    A row draws a token t from p over its support (at first the tokens min-p keeps: min-p is a
    threshold on p). t is in the top-p nucleus if the tokens more probable than t hold less than
    top_p of the mass; then it is the row's token. If not, every token of the nucleus is more
    probable than t, so the support shrinks to those and the row draws again. The accepted token
    is distributed as p restricted to the survivors, renormalized: the distribution the sorted
    filters give (``_filter_sorted``), ties aside. A full sort of 64 rows of a 49k vocabulary took
    200 ms on one core; a round here reads each row a few times.

    Returns each row's token, and the rows still undecided after ``_MAX_REJECTION_ROUNDS``
    (for the sorted path: a fresh exact draw, so the mixture is still exact)."""
    device = weights.device
    testing = any(p.top_p < 1.0 for p in params)
    # Top-p's mass is the whole row's (as _filter_sorted measures it): summed before min-p.
    total = weights.sum(dim=-1) if testing else None
    if any(p.min_p > 0.0 for p in params):
        # A row's largest weight is 1, so min-p's threshold is min_p itself.
        min_p = to_device([p.min_p for p in params], torch.float32, device).unsqueeze(1)
        weights.masked_fill_(weights < min_p, 0.0)
    if not testing:  # no nucleus to test (no filter, or min-p alone): one draw from the support
        uniforms = torch.cat([torch.rand(1, generator=generator, dtype=torch.float64) for generator in generators])
        return _inverse_cdf(weights, uniforms.to(device)).tolist(), set()
    top_p = _top_ps(params, device)
    no_top_p = top_p >= 1.0  # a sum of the others can round up to the whole: never test those rows
    needed = top_p * total
    picks = [0] * len(params)
    active = list(range(len(params)))
    index = None  # the active rows' indices (None: every row)
    support = weights  # what each row may still draw; rejected rows' rows are narrowed below
    for _ in range(_MAX_REJECTION_ROUNDS):
        rows = support if index is None else support[index]
        uniforms = torch.cat([torch.rand(1, generator=generators[row], dtype=torch.float64) for row in active])
        drawn = _inverse_cdf(rows, uniforms.to(device))
        drawn_weights = rows.gather(1, drawn.unsqueeze(1))
        # Narrowing keeps every token above the drawn one, so "more probable than t" is still
        # counted on the narrowed support, against the whole row's normalizer.
        mass_above = torch.where(rows > drawn_weights, rows, 0.0).sum(dim=-1)
        row_needed, row_no_top_p = (needed, no_top_p) if index is None else (needed[index], no_top_p[index])
        accepted = ((mass_above < row_needed) | row_no_top_p).tolist()
        rejected = [local for local, ok in enumerate(accepted) if not ok]
        for local, token in enumerate(drawn.tolist()):
            picks[active[local]] = token
        if not rejected:
            return picks, set()
        # Each rejected row keeps only what is more probable than the token it drew.
        local_index = to_device(rejected, torch.long, device)
        kept = rows.index_select(0, local_index)
        kept = torch.where(kept > drawn_weights.index_select(0, local_index), kept, 0.0)
        active = [active[local] for local in rejected]
        index = to_device(active, torch.long, device)
        support.index_copy_(0, index, kept)
    return picks, set(active)


def _adjusts(params) -> bool:
    """Whether the request changes its logits before temperature (beyond a grammar's mask)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
        or params.allowed_token_ids is not None
        or bool(params.bad_words_token_ids)
        or params.min_tokens > 0
        or (params.thinking is not None and params.thinking.budget is not None)
    )


def _close_spent_thinking(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """A row whose thinking spent its budget (engine.thinking) draws its closer: every other
    token at -inf. Overlapped rows never get here one token short of it (``draws_on_device``),
    so a row's state is exact."""
    rows = [i for i, s in enumerate(seqs) if s.thinking is not None and s.thinking.must_close()]
    if not rows:
        return logits
    logits = logits.clone()
    index = to_device(rows, torch.long, logits.device)
    closers = to_device([seqs[i].thinking.thinking.closer for i in rows], torch.long, logits.device)
    logits[index] = float("-inf")
    logits[index, closers] = 0.0  # certain, whatever allowed_token_ids or bad words made of it
    return logits


def _apply_logit_adjustments(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """allowed_token_ids, then bad words, then logit_bias (vLLM applies them in this order), each
    one scatter over every row that has it: the (row, token) pairs are gathered on the host."""
    rows = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None or s.params.bad_words_token_ids or s.params.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    allowed = [i for i in rows if seqs[i].params.allowed_token_ids is not None]
    if allowed:
        keep = torch.zeros((len(allowed), logits.shape[-1]), dtype=torch.bool, device=device)
        keep[_pair_index([(j, token) for j, i in enumerate(allowed) for token in seqs[i].params.allowed_token_ids], device)] = True
        index = to_device(allowed, torch.long, device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    banned = [(i, token) for i in rows for token in banned_tokens(seqs[i])]
    if banned:
        logits[_pair_index(banned, device)] = float("-inf")
    biased = [((i, token), value) for i in rows for token, value in (seqs[i].params.logit_bias or {}).items()]
    if biased:
        logits.index_put_(_pair_index([pair for pair, _ in biased], device), to_device([v for _, v in biased], logits.dtype, device), accumulate=True)
    return logits


def _pair_index(pairs: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs as the index of one scatter over [rows, vocab]."""
    return to_device([row for row, _ in pairs], torch.long, device), to_device([token for _, token in pairs], torch.long, device)


def banned_tokens(seq) -> list[int]:
    """The tokens bad_words forbid as the sequence's next: each word's last token where the
    output already ends with the rest of it."""
    words = seq.params.bad_words_token_ids
    if not words:
        return []
    output = _output_ids(seq)
    banned = []
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def _output_ids(seq: Sequence) -> list[int]:
    """The request's output so far (resumed tokens included: ``penalties.num_output``)."""
    num_output = penalties.num_output(seq)
    return seq.token_ids[len(seq.token_ids) - num_output :] if num_output else []


# Rows with top-p or min-p but no top-k look for their survivors among this many candidates
# (topk, no sort of the whole vocabulary) and sort the whole row only where they are not all
# there. A full sort was 50 of the 71 ms a batch-32 top-p step's sampling took here (49k vocabulary).
_NUM_CANDIDATES = 1024


@dataclass(slots=True)
class _SamplingGroup:
    """Rows drawn alike: their probabilities, over the vocabulary (``token_ids`` None) or over
    candidates sorted by logit, whose token ids ``token_ids`` holds."""

    rows: list[int]
    probs: torch.Tensor
    token_ids: torch.Tensor | None


def _is_filtered(params) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _sampling_groups(logits: torch.Tensor, params: list) -> list[_SamplingGroup]:
    """Temperature, then the filters (top-k, then top-p and min-p on what it kept, as vLLM).

    Which group a row falls in depends only on its own parameters and logits: a row's
    distribution, and so its seeded draw, never depends on what shares its batch. (It did: a
    top-p request sorted every row of the batch, and the same uniform then picked another token
    from a sampled request's sorted row.)

    Each row is shifted so its largest logit is 0 before dividing by its temperature: a
    temperature as small as 1e-40 then sends the others to -inf (greedy, in effect) instead of
    overflowing to inf - inf. Filtered rows take their candidates from the raw logits (the order
    is the same) and scale only those: a row with top-k never touches its whole vocabulary again
    (scaling, shifting and normalising 64 rows of a 49k vocabulary took 25 of a 33 ms step here)."""
    device = logits.device
    vocab = logits.shape[-1]

    def temperatures(rows: list[int]) -> torch.Tensor:
        return _temperatures([params[i] for i in rows], device).unsqueeze(1)

    def scaled(rows: list[int]) -> torch.Tensor:
        """The rows' whole scaled logits, float32."""
        row_logits = _rows_of(logits, rows)
        return ((row_logits - row_logits.amax(dim=-1, keepdim=True)) / temperatures(rows)).float()

    plain = [i for i, p in enumerate(params) if not _is_filtered(p)]
    filtered = [i for i, p in enumerate(params) if _is_filtered(p)]
    groups = []
    if plain:
        groups.append(_SamplingGroup(plain, torch.softmax(scaled(plain), dim=-1), None))
    if not filtered:
        return groups
    row_params = [params[i] for i in filtered]
    num_candidates = min(vocab, max(p.top_k if p.top_k > 0 else _NUM_CANDIDATES for p in row_params))
    top, token_ids = _rows_of(logits, filtered).topk(num_candidates, dim=-1)
    values = ((top - top[:, :1]) / temperatures(filtered)).float()  # the row's largest is its first
    # Top-p without top-k measures mass against the whole row: its log-normalizer (top-k rows
    # renormalize over what they keep and need none).
    log_norm = torch.zeros((len(filtered), 1), dtype=torch.float32, device=device)
    unbounded = [j for j, p in enumerate(row_params) if p.top_k <= 0]  # -1 and 0 both disable top-k
    whole = {}
    if unbounded:
        whole_rows = scaled([filtered[j] for j in unbounded])
        log_norm[to_device(unbounded, torch.long, device)] = torch.logsumexp(whole_rows, dim=-1, keepdim=True)
        whole = {j: local for local, j in enumerate(unbounded)}
    complete = [num_candidates == vocab or p.top_k > 0 or _survivors_inside(values[j], log_norm[j], p) for j, p in enumerate(row_params)]
    inside = [j for j, ok in enumerate(complete) if ok]
    outside = [j for j, ok in enumerate(complete) if not ok]  # top-p/min-p rows only
    if inside:
        index = to_device(inside, torch.long, device)
        kept = _filter_sorted(values[index], [row_params[j] for j in inside], log_norm[index])
        groups.append(_SamplingGroup([filtered[j] for j in inside], torch.softmax(kept, dim=-1), token_ids[index]))
    if outside:
        index = to_device(outside, torch.long, device)
        in_order, order = whole_rows[to_device([whole[j] for j in outside], torch.long, device)].sort(dim=-1, descending=True)
        kept = _filter_sorted(in_order, [row_params[j] for j in outside], log_norm[index])
        groups.append(_SamplingGroup([filtered[j] for j in outside], torch.softmax(kept, dim=-1), order))
    return groups


def _survivors_inside(values: torch.Tensor, log_norm: torch.Tensor, params) -> bool:
    """Whether every token top-p or min-p keeps is among a row's candidates (``values``, its
    largest logits, descending): the candidates' mass reaches top_p, or the last candidate is
    already under min_p times the most likely."""
    probs = torch.exp(values - log_norm)
    if params.top_p < 1.0 and float(probs.sum()) >= params.top_p:
        return True
    return params.min_p > 0.0 and float(probs[-1]) < params.min_p * float(probs[0])


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index where its cumulative probability first exceeds ``uniforms`` x its
    total (rows need not sum to 1); a token of probability 0 is never drawn."""
    rows, width = probs.shape
    pad = (-width) % _DRAW_BLOCK
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = padded.view(rows, -1, _DRAW_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    targets = (uniforms * block_cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(block_cdf, targets, right=True).clamp_(max=block_cdf.shape[1] - 1)
    inside = blocks.gather(1, block.unsqueeze(-1).expand(-1, -1, _DRAW_BLOCK)).squeeze(1).double().cumsum(dim=-1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(targets))
    offset = torch.searchsorted(inside + before, targets, right=True).clamp_(max=_DRAW_BLOCK - 1)
    picks = (block * _DRAW_BLOCK + offset).squeeze(1)
    # A rounding edge can land on a token of probability 0 (or padding): the nearest drawable one.
    bad = (picks >= width) | (probs.gather(1, picks.clamp(max=width - 1).unsqueeze(1)).squeeze(1) <= 0)
    for row in bad.nonzero().flatten().tolist():
        positive = probs[row].nonzero().flatten()
        earlier = positive[positive < picks[row]]
        picks[row] = earlier[-1] if earlier.numel() else positive[0]
    return picks


def _filter_sorted(sorted_logits: torch.Tensor, params: list, log_norm: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p remove, on logits sorted descending (a row's
    largest ones, or all of them). ``log_norm``: each row's log-normalizer over the whole
    vocabulary, which top-p measures mass against where no top-k renormalized it."""
    width = sorted_logits.shape[-1]
    ranks = torch.arange(width, device=sorted_logits.device).unsqueeze(0)
    top_k = to_device([p.top_k if p.top_k > 0 else width for p in params], torch.long, sorted_logits.device).unsqueeze(1)
    removed = ranks >= top_k
    masked = sorted_logits.masked_fill(removed, float("-inf"))
    has_top_k = to_device([p.top_k > 0 for p in params], torch.bool, sorted_logits.device).unsqueeze(1)
    norm = torch.where(has_top_k, torch.logsumexp(masked, dim=-1, keepdim=True), log_norm)
    probs = torch.exp(masked - norm)
    top_p = _top_ps(params, sorted_logits.device).unsqueeze(1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    removed |= mass_before >= top_p
    min_p = to_device([p.min_p for p in params], torch.float32, sorted_logits.device).unsqueeze(1)
    removed |= probs < min_p * probs[:, :1]
    removed[:, 0] = False  # the most likely token always survives
    return sorted_logits.masked_fill(removed, float("-inf"))


@dataclass(slots=True)
class LogprobTensors:
    """What some rows report of their log-probabilities, computed where the logits are: only these
    numbers travel to the host, not the rows (a row of a 152k vocabulary is 600 KB)."""

    rows: list[int]  # the rows (of a step's sampled rows) that report
    num_top: list[int]  # how many most likely tokens each reports
    chosen: torch.Tensor  # [n] the chosen token's log-probability
    ranks: torch.Tensor  # [n] its rank (1: the most likely)
    top_values: torch.Tensor | None  # [n, max(num_top)] (None: no row asks for any)
    top_ids: torch.Tensor | None

    @classmethod
    def of(cls, logits: torch.Tensor, seqs: list, token_ids: torch.Tensor) -> "LogprobTensors | None":
        """What the rows of ``logits`` whose requests ask for log-probabilities report, their
        chosen tokens among ``token_ids`` (one per row, on the logits' device); None: no row asks."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        return cls.of_rows(logits, rows, [seqs[i].params.logprobs for i in rows], token_ids)

    @classmethod
    def of_rows(cls, logits: torch.Tensor, rows: list[int], num_top: list[int], token_ids: torch.Tensor) -> "LogprobTensors":
        """What ``rows`` of ``logits`` (distinct, ascending) report: each its token among
        ``token_ids`` (one per row of ``logits``) and its ``num_top`` most likely."""
        if len(rows) == logits.shape[0]:  # every row (a prompt's scores): no copy of them first
            log_probs, targets = torch.log_softmax(logits, dim=-1), token_ids
        else:
            index = to_device(rows, torch.long, logits.device)
            log_probs, targets = torch.log_softmax(logits[index], dim=-1), token_ids[index]
        chosen = log_probs.gather(1, targets.unsqueeze(1))
        ranks = (log_probs >= chosen).sum(dim=-1)  # vLLM's: a token tied with another ranks after it
        most = max(num_top)
        top_values, top_ids = log_probs.topk(most, dim=-1) if most > 0 else (None, None)
        return cls(rows, num_top, chosen.squeeze(1), ranks, top_values, top_ids)

    def to_host(self) -> "LogprobTensors":
        """A copy on the host, started without waiting where the tensors are on CUDA (``to_host``)."""
        return LogprobTensors(self.rows, self.num_top, to_host(self.chosen), to_host(self.ranks), to_host(self.top_values), to_host(self.top_ids))

    @staticmethod
    def by_row(reported: "LogprobTensors | None", token_ids: list[int]) -> list[TokenLogprob | None]:
        """Per row (``token_ids``: every row's chosen token), what it reports, None for a row that
        asks nothing (reads the tensors)."""
        entries: list[TokenLogprob | None] = [None] * len(token_ids)
        if reported is None:
            return entries
        chosen, ranks = reported.chosen.tolist(), reported.ranks.tolist()
        top_values, top_ids = (reported.top_values.tolist(), reported.top_ids.tolist()) if reported.top_values is not None else ([], [])
        for i, (row, top) in enumerate(zip(reported.rows, reported.num_top)):
            pairs = list(zip(top_ids[i][:top], top_values[i][:top])) if top > 0 else []
            entries[row] = TokenLogprob(token_id=token_ids[row], logprob=chosen[i], rank=ranks[i], top=pairs)
        return entries
