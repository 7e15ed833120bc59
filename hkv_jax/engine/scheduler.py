"""Which requests run in the next step and how many tokens each computes (host only).

A continuous-batching policy, vLLM's: running requests first (one token when decoding, a chunk of at
most the remaining token budget when still prefilling), then waiting ones while the budget and request
slots last. The plan lists the decoding requests first, then the running ones with a chunk, then the
waiting ones (the order the vectorised step batches them in). When the allocator refuses a request,
the latest admitted running one is preempted in the next step and waits at the front of the queue; its
prefix may come back from the cache (``handle_refusals``).

Models with Mamba layers: a chunk that starts inside a block stops at the next block boundary, so a
Mamba state block, once full, holds the state after exactly its last token (vLLM's 'align' mode).

Everything here is plain Python and numpy: ``Scheduler`` is built and tested without a model.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import numpy as np

from hkv_jax.engine.changes import Changes, SchedulerOutput, prompt_buffer
from hkv_jax.engine.decode_batch import DecodeBatch, book_logprobs
from hkv_jax.engine.request import FinishReason, Request, RequestStatus, check_stop, keeps_drafting, may_stop
from hkv_jax.engine.stats import Stats

NO_TOKENS = (np.zeros(0, np.int64), np.zeros(0, np.int32))


class Scheduler:
    """The requests, the waiting and running queues, request slots and the token budget.

    ``max_requests`` slots, ``token_budget`` tokens a step, ``block_size`` tokens a block; ``align``:
    chunks stop at block boundaries (Mamba); ``prefix_caching=False`` gives every admission a cache salt
    of its own, so nothing ever hits; ``vectorised``: keep the decode-only record (the per-request
    allocator runs the per-request pass every step); ``num_speculative``: draft tokens a decoding request
    may verify per step (speculative decoding; they take budget as computed tokens do); ``num_blocks``: the
    pool's size (named when a request cannot fit it); ``stats``: the counters it adds to (the engine's)."""

    def __init__(self, *, max_requests: int, token_budget: int, block_size: int, align: bool = False,
                 prefix_caching: bool = True, vectorised: bool = True, num_speculative: int = 0,
                 num_blocks: int = 0, stats: Stats | None = None):
        self.max_requests, self.token_budget, self.block_size = max_requests, token_budget, block_size
        self.num_blocks, self.stats = num_blocks, Stats() if stats is None else stats
        self.align, self.prefix_caching, self.vectorised = align, prefix_caching, vectorised
        self.num_speculative = num_speculative
        self.requests: dict[int, Request] = {}  # by id (``book_pending``: with every token booked)
        self.waiting: list[int] = []   # request ids, front first
        self.running: list[int] = []   # admission order
        self.to_free: list[int] = []   # slots freed in the next step
        self.to_preempt: list[int] = []
        self.next_id = 0
        self.admissions = 0
        self.hold_admissions = False   # a running request was refused: admit none next step
        # The decode-only record, valid while ``running`` is as it was built for (``_running_changed``).
        self._version = 0
        self._batch: DecodeBatch | None = None

    # --- the requests --------------------------------------------------------------------

    def book_pending(self) -> dict[int, Request]:
        """Book the tokens the decode-only record holds back (``DecodeBatch.flush``) into their requests;
        returns ``requests``, every one with its ``generated`` tokens and ``computed`` count up to date."""
        if self._batch is not None:
            self._batch.flush()
        return self.requests

    def add(self, prompt: list[int], params, bias: tuple = ()) -> int:
        """Queue a request (checked by the engine); returns its id."""
        rid = self.next_id
        self.next_id += 1
        self.requests[rid] = Request(rid, prompt, params, bias=bias, arrival_time=time.time())
        self.waiting.append(rid)
        return rid

    def add_fork(self, parent: int, slot: int, params, computed: int) -> int:
        """A running copy of running request ``parent`` in ``slot``, which the allocator has already forked
        the parent into, sampling with ``params`` and ``computed`` tokens computed; returns its id."""
        child = copy.deepcopy(self.book_pending()[parent])
        child.rid, child.slot, child.params, child.computed = self.next_id, slot, params, computed
        self.next_id += 1
        self.requests[child.rid] = child
        self.running.append(child.rid)
        self._running_changed()
        return child.rid

    def forget(self, rid: int) -> Request:
        """Drop finished request ``rid`` and return it. ``ValueError`` while it is not done."""
        r = self.book_pending()[rid]
        if not r.done:
            raise ValueError(f"request {rid} is not done")
        return self.requests.pop(rid)

    def abort(self, rid: int) -> bool:
        """End ``rid`` now; ``False`` if it had ended; ``KeyError`` for an id never added."""
        requests = self.book_pending()
        if rid not in requests:
            raise KeyError(f"no request {rid}")
        r = requests[rid]
        if rid in self.waiting:
            self.waiting.remove(rid)
        elif rid in self.running:
            self.running.remove(rid)
            self._running_changed()
        else:
            return False
        if r.slot >= 0:  # its tokens live in the allocator (admitted, refused or preempted): free them
            if r.slot in self.to_preempt:
                self.to_preempt.remove(r.slot)
            self.to_free.append(r.slot)
        r.finish(FinishReason.ABORT, time.time())
        return True

    def finish(self, r: Request, reason: FinishReason, now: float) -> None:
        """``r`` (running) ended: its slot's blocks are freed in the next step."""
        self.running.remove(r.rid)
        self._running_changed()
        self.to_free.append(r.slot)
        r.finish(reason, now)

    def start(self, r: Request) -> None:
        """Waiting request ``r`` got its first tokens computed: it runs."""
        self.waiting.remove(r.rid)
        self.running.append(r.rid)
        self._running_changed()
        r.status = RequestStatus.RUNNING

    def free_slot(self) -> int:
        """A request slot no request holds and none frees next step (-1: none)."""
        used = {r.slot for r in self.requests.values() if r.slot >= 0} | set(self.to_free)
        return next((s for s in range(self.max_requests) if s not in used), -1)

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything: requests waiting or running, or blocks still to free."""
        return bool(self.waiting or self.running or self.to_free)

    # --- the decode-only record -------------------------------------------------------------

    def _running_changed(self) -> None:
        """The running set changed: the record no longer describes it (its pending tokens are booked)."""
        if self._batch is not None:
            self._batch.flush()
            self._batch = None
        self._version += 1

    @property
    def decode_batch(self) -> DecodeBatch | None:
        """The decode-only record of the running requests, or ``None``."""
        b = self._batch
        return b if b is not None and b.version == self._version else None

    def refresh_decode_batch(self) -> None:
        """After a step was booked request by request: keep a record if every running request decodes.
        (A request about to sample its first token stays out of it: its first token is booked then. So
        does a batch with stop strings: each step's text must be looked at.)"""
        live = [self.requests[rid] for rid in self.running] if self.vectorised else []
        decoding = live and all(r.total - r.computed == 1 and r.generated and not r.stop_strings for r in live)
        self._batch = DecodeBatch.of(self._version, live) if decoding else None

    def stop_drafting(self, requests: list[Request]) -> None:
        """These running requests draft no more (their drafts were rarely accepted): the plans change."""
        for r in requests:
            r.drafting = False
        self._running_changed()
        self.refresh_decode_batch()

    def shrink_decode_batch(self, finished: list[int]) -> None:
        """The requests at positions ``finished`` of the record ended (their tokens booked): the rest run on."""
        b = self._batch
        keep = sorted(set(range(len(b.rids))) - set(finished))
        self._version += 1
        self.running = [b.rids[i] for i in keep]
        self._batch = b.take(self._version, keep) if keep else None

    # --- planning ---------------------------------------------------------------------------

    def _chunk(self, r: Request, budget: int) -> int:
        """Tokens ``r`` computes this step: what is left, within the budget and its chunk limit."""
        left = len(r.prompt) + len(r.generated) - r.computed
        if left == 1:  # decoding (the usual case, first)
            return min(1, budget)
        n = min(left, budget, r.max_chunk)
        bs = self.block_size
        if self.align and r.computed % bs:
            n = min(n, bs - r.computed % bs)  # Mamba: stop at the block boundary
        return n

    def _draft(self, r: Request, spare: int) -> int:
        """Draft tokens decoding request ``r`` may verify with ``spare`` tokens of budget left besides its own."""
        return min(self.num_speculative, spare) if r.drafting else 0

    def schedule(self) -> SchedulerOutput:
        """The next step's plan (it admits the waiting requests it plans: see ``SchedulerOutput``)."""
        R, budget = self.max_requests, self.token_budget
        hold, self.hold_admissions = self.hold_admissions, False
        d = self.decode_batch
        if d is not None and len(d.rids) <= budget and (hold or not self.waiting or len(d.rids) in (R, budget)):
            n = len(d.rids)  # every running request decodes, and no waiting one can start: no pass over them
            if d.step_arrays is None:
                slots = np.full(R, -1, np.int32)
                slots[:n] = d.slots
                want = np.zeros(R, np.int32)
                want[:n] = 1
                drafts = None
                if self.num_speculative:
                    drafts, spare = np.zeros(R, np.int32), budget - n
                    for i, r in enumerate(d.requests):
                        drafts[i] = self._draft(r, spare)
                        spare -= drafts[i]
                d.step_arrays = slots, want, drafts if drafts is not None and drafts.any() else None
            slots, want, drafts = d.step_arrays
            multi = not self.waiting or n in (R, budget)
            return SchedulerOutput(d.rids, d.requests, slots, want, n, n, [], self._changes([]), d, multi, drafts)
        decoding: list[tuple[int, int]] = []  # (request id, tokens)
        chunked: list[tuple[int, int]] = []
        drafts: list[int] = []  # of the decoding ones
        requests = self.book_pending()
        for rid in self.running:
            r = requests[rid]
            if budget > 0 and len(r.prompt) + len(r.generated) - r.computed == 1:  # decoding: the usual case
                decoding.append((rid, 1))
                drafts.append(self._draft(r, budget - 1) if self.num_speculative else 0)
                budget -= 1 + drafts[-1]
                continue
            n = self._chunk(r, budget)
            if n > 0:
                if n == 1:
                    decoding.append((rid, n))
                    drafts.append(0)
                else:
                    chunked.append((rid, n))
                budget -= n
        picks = decoding + chunked
        admit: list[int] = []
        for rid in list(self.waiting):
            if hold or budget <= 0 or len(picks) >= R:
                break
            r = requests[rid]
            if not r.admitted:
                if r.slot < 0:
                    r.slot = self.free_slot()
                    if r.slot < 0:
                        break
                admit.append(rid)
            n = self._chunk(r, budget)
            picks.append((rid, n))
            budget -= n
        order = [rid for rid, _ in picks]
        slots = np.full(R, -1, np.int32)
        want = np.zeros(R, np.int32)
        slots[:len(picks)] = [requests[rid].slot for rid in order]
        want[:len(picks)] = [n for _, n in picks]
        num_drafts = None
        if any(drafts):
            num_drafts = np.zeros(R, np.int32)
            num_drafts[:len(drafts)] = drafts
        return SchedulerOutput(order, [requests[rid] for rid in order], slots, want, len(decoding),
                               len(decoding) + len(chunked), admit, self._changes(admit), num_drafts=num_drafts)

    def _changes(self, admit: list[int]) -> Changes | None:
        """The releases of this step and the prompts of the requests it admits (``None``: nothing)."""
        if not (admit or self.to_free or self.to_preempt):
            return None
        R = self.max_requests
        free = np.zeros(R, bool)
        free[self.to_free] = True
        preempt = np.zeros(R, bool)
        preempt[self.to_preempt] = True
        slots = np.full(R, -1, np.int32)
        lens = np.zeros(R, np.int32)
        salts = np.zeros(R, np.uint32)
        prompts: list[int] = []
        for i, rid in enumerate(admit):
            r = self.requests[rid]
            if not self.prefix_caching:
                self.admissions += 1
                r.salt = self.admissions
            toks = r.prompt + r.generated
            slots[i], lens[i], salts[i] = r.slot, len(toks), r.salt
            prompts += toks
        buffer = np.zeros(prompt_buffer(len(prompts)), np.int32)
        buffer[:len(prompts)] = prompts
        return Changes(free=free, preempt=preempt, slots=slots, prompts=buffer, lens=lens, salts=salts)

    def sent(self, out: SchedulerOutput) -> None:
        """``out``'s changes reached the device: its releases are done and its admissions hold slots."""
        if out.changes is not None:
            self.to_free, self.to_preempt = [], []
        for rid in out.admitted:
            self.requests[rid].admitted = True

    def handle_refusals(self, refused: list[tuple[int, int]]) -> bool:
        """vLLM's policy for requests the allocator refused (``(id, tokens wanted)``): a refused running
        request preempts the latest admitted running one (itself, if it is the latest) and no new
        request is admitted next step; a refused waiting request just waits. A request refused while it
        runs alone retries with half the chunk (``RuntimeError`` when a single token does not fit).
        Returns whether it preempted a request."""
        running_refused = [(rid, want) for rid, want in refused if rid in self.running]
        if running_refused:
            self.hold_admissions = True
            if len(self.running) > 1:
                victim = self.running.pop()
                self._running_changed()
                r = self.requests[victim]
                self.to_preempt.append(r.slot)
                r.computed = 0
                r.admitted = self.prefix_caching  # without caching: re-admitted under a new salt
                r.preemptions += 1
                r.status = RequestStatus.WAITING
                self.waiting.insert(0, victim)
                return True
            if self.to_free:
                return False  # finished requests free their blocks at the start of the next step
            rid, want = running_refused[0]
        elif self.running or self.to_free:
            return False  # waiting requests retry once blocks come free
        else:
            rid, want = refused[0]
        r = self.requests[rid]
        if want <= 1:
            raise RuntimeError(f"request {rid} ({r.total} tokens) does not fit the KV pool "
                               f"({self.num_blocks} blocks) even alone")
        r.max_chunk = want // 2
        return False

    # --- results ----------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, report, stop_string: Callable[[Request], str | None]
                           ) -> tuple[np.ndarray, np.ndarray]:
        """Book ``report`` (the ``StepReport`` of consecutive steps of ``out``, or of one speculative step's
        positions; not imported here: its module imports jax) into the requests: tokens, log-probabilities,
        starts, finishes (``request.check_stop``, the one stop rule), refusals and drafting. Every change of
        a request's state after a step is made here. ``stop_string(r)``: the stop string ``r``'s text now
        holds (the output processor's). Returns the sampled request ids ``i64[n]`` and tokens ``i32[n]``
        in step order.

        The leading steps that decoded every request of a decode-only record, each allocated and sampled,
        are booked with array operations (the tokens wait in the record); any other step request by request."""
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
            events = self._book(out, report.steps(slice(i, i + 1)), refused, stop_string, first=i == 0)
            if events:
                rids = np.concatenate([rids, np.array([rid for rid, _ in events], np.int64)])
                tokens = np.concatenate([tokens, np.array([tok for _, tok in events], np.int32)])
        # Once every position is booked: a request preempted now has all its tokens.
        if refused:
            self.stats.preemptions += self.handle_refusals(refused)
        if clean < len(report):
            self.refresh_decode_batch()
        if report.speculative:
            self._book_drafts(out, report)
        return rids, tokens

    def _book_drafts(self, out: SchedulerOutput, report) -> None:
        """Count a speculative step's drafts and accepted tokens; requests whose drafts are rarely accepted
        stop drafting (``request.keeps_drafting``)."""
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
            self.stop_drafting(stop)

    def _book(self, out: SchedulerOutput, report, refused: list[tuple[int, int]], stop_string,
              first: bool = True) -> list[tuple[int, int]]:
        """Apply one step's report to the requests ``out`` planned; returns the sampled (id, token) pairs and
        adds the refused lanes' (id, tokens wanted) to ``refused``. ``first=False``: a later position of a
        speculative step (lanes refused, done, or that emitted fewer tokens are left alone)."""
        ok, n, hit, sampled, tokens = (x[0].tolist() for x in (report.ok, report.num_new, report.cache_hit,
                                                                report.sampled, report.tokens))
        now = time.time()
        events = []
        stats, requests = self.stats, self.book_pending()  # a step booked request by request follows any in the record
        stats.tokens_computed += sum(n)  # 0 on refused lanes
        for i, rid in enumerate(out.request_ids):
            r = requests[rid]
            if not first:
                if ok[i] and sampled[i] and not r.done:
                    r.computed += n[i]
                    self._append(r, report, i, tokens[i], events, now, stop_string)
                continue
            if not ok[i]:
                refused.append((rid, int(out.num_tokens[i])))
                continue
            if i >= out.num_running:  # a waiting request starts running
                self.start(r)
                r.cache_hit = hit[i]
                stats.cache_hit_tokens += hit[i]
                stats.prompt_tokens += r.total
            r.computed += hit[i] + n[i]
            if sampled[i]:
                self._append(r, report, i, tokens[i], events, now, stop_string)
        stats.generated += len(events)
        return events

    def _append(self, r: Request, report, i: int, tok: int, events: list, now: float,
                stop_string) -> None:
        """``r`` (lane ``i`` of ``report``) generated ``tok``: book it, and finish ``r`` if it stops there."""
        if not r.generated:
            r.first_token_time = now
        r.generated.append(tok)
        if r.logprobs is not None:
            book_logprobs(r, report.logprob[:, i], report.top_ids[..., i], report.top_logprobs[..., i])
        events.append((r.rid, tok))
        found = stop_string(r) if r.stop_strings and len(r.generated) > r.min_tokens else None
        reason = check_stop(r.params, len(r.generated), tok, found)
        if reason is not None:
            r.stop_string = found
            self.finish(r, reason, now)

    def _book_decodes(self, d: DecodeBatch, report) -> tuple[np.ndarray, np.ndarray]:
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
                self.to_free.append(r.slot)
                r.finish(reason, now)
            self.shrink_decode_batch([i for i, _ in finished])
        return rids, tokens.ravel()

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Its state (the requests themselves, not copies)."""
        return {"requests": self.book_pending(), "waiting": self.waiting, "running": self.running,
                "to_free": self.to_free, "to_preempt": self.to_preempt, "next_id": self.next_id,
                "admissions": self.admissions, "hold_admissions": self.hold_admissions}

    def load_state_dict(self, h: dict) -> None:
        """Take the state ``state_dict`` gave (not copied). Tokens pending in the old record belonged to the
        requests replaced here: they are dropped with it."""
        self.requests, self.waiting, self.running = h["requests"], h["waiting"], h["running"]
        self.to_free, self.to_preempt, self.next_id = h["to_free"], h["to_preempt"], h["next_id"]
        self.admissions, self.hold_admissions = h["admissions"], h["hold_admissions"]
        self._batch = None
        self._version += 1
