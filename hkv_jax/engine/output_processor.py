"""Booking a step's results into the requests: tokens, log-probabilities, text and stop strings.

``OutputProcessor.book`` applies a ``StepReport`` to the requests a ``SchedulerOutput`` planned: the
leading steps that decoded every request of a decode-only record, each allocated and sampled, with
array operations (the tokens wait in the record); any other step request by request. Whether a request
is done is ``request.check_stop``'s answer, here and only here.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from hkv_jax.engine.decode_batch import DecodeBatch, book_logprobs
from hkv_jax.engine.request import Request, check_stop, may_stop
from hkv_jax.engine.scheduler import Scheduler, SchedulerOutput
from hkv_jax.engine.speculative import keeps_drafting
from hkv_jax.engine.stats import Stats
from hkv_jax.engine.step_messages import StepReport

NO_TOKENS = (np.zeros(0, np.int64), np.zeros(0, np.int32))


class OutputProcessor:
    """Books reports into ``scheduler``'s requests; ``detokenize`` (token ids -> text, or ``None``) gives the
    text that stop strings and ``text`` need; ``num_blocks``: the pool's size, for refusal errors."""

    def __init__(self, scheduler: Scheduler, stats: Stats, detokenize: Callable[[list[int]], str] | None,
                 num_blocks: int):
        self.scheduler, self.stats, self.detokenize, self.num_blocks = scheduler, stats, detokenize, num_blocks

    def book(self, out: SchedulerOutput, report: StepReport) -> tuple[np.ndarray, np.ndarray]:
        """Book the reports of consecutive steps of ``out`` (or of one speculative step's positions); returns
        their sampled request ids ``i64[n]`` and tokens ``i32[n]`` in step order."""
        clean = 0
        if out.decode_batch is not None:
            ok = report.clean_decodes()
            clean = len(ok) if ok.all() else int(ok.argmin())
            if report.speculative and clean > 1:  # no request may stop before the last position booked as arrays
                d = out.decode_batch
                left = d.tokens_left[None, :] - np.arange(1, clean + 1)[:, None]
                stops = may_stop(left, report.tokens[:clean], d.stops).any(axis=1)
                clean = int(stops.argmax()) + 1 if stops.any() else clean
        rids, tokens = self._book_decodes(out.decode_batch, report.steps(slice(clean))) if clean else NO_TOKENS
        self.stats.steps += 1 if report.speculative else len(report)
        self.stats.array_steps += min(clean, 1) if report.speculative else clean
        # At most one step here without drafts: a call stops at the first step the host must see.
        refused = []
        for i in range(clean, len(report)):
            events = self._book(out, report.steps(slice(i, i + 1)), refused, first=i == 0)
            if events:
                rids = np.concatenate([rids, np.array([rid for rid, _ in events], np.int64)])
                tokens = np.concatenate([tokens, np.array([tok for _, tok in events], np.int32)])
        # Once every position is booked: a request preempted now has all its tokens.
        if refused:
            self.stats.preemptions += self.scheduler.handle_refusals(refused, self.num_blocks)
        if clean < len(report):
            self.scheduler.refresh_decode_batch()
        if report.speculative:
            self._book_drafts(out, report)
        return rids, tokens

    def _book_drafts(self, out: SchedulerOutput, report: StepReport) -> None:
        """Count a speculative step's drafts and accepted tokens; requests whose drafts are rarely accepted
        stop drafting (``speculative.keeps_drafting``)."""
        drafted = report.drafted[0]
        accepted = np.maximum(report.sampled.sum(axis=0) - 1, 0)
        lanes = np.flatnonzero(drafted)
        stats = self.stats
        stats.spec_drafts += len(lanes)
        stats.spec_draft_tokens += int(drafted.sum())
        stats.spec_accepted_tokens += int(accepted[lanes].sum())
        stop = []
        # Every lane that could draft and sampled took part, whether its n-gram matched or not.
        took_part = (out.num_drafts[:drafted.shape[0]] > 0) & (report.sampled[0] > 0)
        for i in np.flatnonzero(took_part).tolist():
            r = out.requests[i]
            r.spec_steps += 1
            r.draft_tokens += int(drafted[i])
            r.accepted_tokens += int(accepted[i])
            if not r.done and not keeps_drafting(r.spec_steps, r.draft_tokens, r.accepted_tokens):
                stop.append(r)
        if stop:
            self.scheduler.stop_drafting(stop)

    def _book(self, out: SchedulerOutput, report: StepReport, refused: list[tuple[int, int]],
              first: bool = True) -> list[tuple[int, int]]:
        """Apply one step's report to the requests ``out`` planned; returns the sampled (id, token) pairs and
        adds the refused lanes' (id, tokens wanted) to ``refused``. ``first=False``: a later position of a
        speculative step (lanes refused, done, or that emitted fewer tokens are left alone)."""
        ok, n, hit, sampled, tokens = (x[0].tolist() for x in (report.ok, report.num_new, report.cache_hit,
                                                                report.sampled, report.tokens))
        now = time.time()
        events = []
        stats, scheduler = self.stats, self.scheduler
        requests = scheduler.requests
        stats.tokens_computed += sum(n)  # 0 on refused lanes
        for i, rid in enumerate(out.request_ids):
            r = requests[rid]
            if not first:
                if ok[i] and sampled[i] and not r.done:
                    r.computed += n[i]
                    self._append(r, report, i, tokens[i], events, now)
                continue
            if not ok[i]:
                refused.append((rid, int(out.num_tokens[i])))
                continue
            if i >= out.num_running:  # a waiting request starts running
                scheduler.start(r)
                r.cache_hit = hit[i]
                stats.cache_hit_tokens += hit[i]
                stats.prompt_tokens += r.total
            r.computed += hit[i] + n[i]
            if sampled[i]:
                self._append(r, report, i, tokens[i], events, now)
        stats.generated += len(events)
        return events

    def _append(self, r: Request, report: StepReport, i: int, tok: int, events: list, now: float) -> None:
        """``r`` (lane ``i`` of ``report``) generated ``tok``: book it, and finish ``r`` if it stops there."""
        if not r.generated:
            r.first_token_time = now
        r.generated.append(tok)
        if r.logprobs is not None:
            book_logprobs(r, report.logprob[:, i], report.top_ids[..., i], report.top_logprobs[..., i])
        events.append((r.rid, tok))
        found = (self._stop_string(r) if r.stop_strings and len(r.generated) > r.min_tokens else None)
        reason = check_stop(r.params, len(r.generated), tok, found)
        if reason is not None:
            r.stop_string = found
            self.scheduler.finish(r, reason, now)

    def _book_decodes(self, d: DecodeBatch, report: StepReport) -> tuple[np.ndarray, np.ndarray]:
        """``_book`` for ``k`` steps that decoded every request of ``d``, each allocated and sampled (only the
        last may finish a request), with array operations: the tokens wait in ``d``, and only finished
        requests get theirs now."""
        tokens = report.tokens
        k, n = tokens.shape
        d.add(tokens, (report.logprob, report.top_ids, report.top_logprobs) if d.logprobs else None)
        self.stats.tokens_computed += k * n
        self.stats.generated += k * n
        last = tokens[-1]
        finished = []
        for i in np.flatnonzero(may_stop(d.tokens_left, last, d.stops)).tolist():
            r = d.requests[i]
            reason = check_stop(r.params, r.max_new_tokens - int(d.tokens_left[i]), int(last[i]))
            if reason is not None:
                finished.append((i, reason))
        rids = np.tile(d.rid_array, k)
        if finished:
            d.flush([i for i, _ in finished])
            now = time.time()
            for i, reason in finished:
                r = d.requests[i]
                self.scheduler.to_free.append(r.slot)
                r.finish(reason, now)
            self.scheduler.shrink_decode_batch([i for i, _ in finished])
        return rids, tokens.ravel()

    # --- text ---------------------------------------------------------------------------------

    def text(self, r: Request, stable: bool = False) -> str:
        """``Engine.text`` of request ``r``."""
        if self.detokenize is None:
            raise ValueError("text needs the engine's detokenize (Engine(..., detokenize=codec.decode))")
        text = self.detokenize(r.generated)
        if r.stop_string is not None:
            return text[:self._stop_strings_in(r, text)[r.stop_string]]
        if stable and not r.done:
            held = min(len(text) - len(text.rstrip("\ufffd")), 3) + max(map(len, r.stop_strings), default=1) - 1
            return text[:max(len(text) - held, 0)]
        return text

    def _stop_string(self, r: Request) -> str | None:
        """The earliest of ``r``'s stop strings its text holds, or ``None``. It runs after each of ``r``'s
        tokens, so a string not found before ends in the newest token's text: the text of the last few
        tokens is searched (a token holds at least a quarter of a character, as byte-fallback pieces do),
        and the whole text only on a hit, so a long generation is not decoded whole every step."""
        tail = self.detokenize(r.generated[-4 * (max(map(len, r.stop_strings)) + 2):])
        if not any(s in tail for s in r.stop_strings):
            return None
        found = self._stop_strings_in(r, self.detokenize(r.generated))
        return min(found, key=found.get) if found else None

    def _stop_strings_in(self, r: Request, text: str) -> dict[str, int]:
        """The index in ``text`` of each of ``r``'s stop strings found there, first occurrence. Under
        ``min_tokens`` only a string that ends after the text of its first ``min_tokens`` tokens counts,
        as in vLLM, which looks for them only in the text that comes after."""
        floor = len(self.detokenize(r.generated[:r.min_tokens])) if r.min_tokens else 0
        at = {s: text.find(s, max(floor - len(s) + 1, 0)) for s in r.stop_strings}
        return {s: i for s, i in at.items() if i >= 0}
