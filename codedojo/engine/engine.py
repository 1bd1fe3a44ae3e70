"""The generation engine: token ids in, token ids and logprobs out. It knows nothing of text.

One scheduler owns the model and the KV cache. Each iteration it
1. admits waiting requests into free cache slots, prefilling each prompt (one forward pass,
   logits for the last position only) and sampling its first token;
2. runs one batched decode step over every live request (each at its own length);
3. retires finished requests, moving the last live slot into the hole so live slots stay
   contiguous and a decode step reads the cache as a plain slice.

A new request therefore joins while others decode (continuous batching). A prompt that starts
with tokens another sequence already holds (a live one, or a finished one kept in the prefix
cache, ``prefix_cache_tokens``) copies their keys and values and is prefilled from where they
part: the next turn of an agent loop, the other members of a GRPO group. The scheduler runs
either inline (``generate`` without a started engine) or on a background thread (``start``),
which ``stream`` and concurrent callers use.

Finish reasons: "stop" (a stop token was sampled; it is kept in ``token_ids`` because RL trains
on it), "length" (``max_tokens`` reached, or the cache's ``max_seq_len``), "cancelled".
``load_weights`` swaps weights between steps, so a request in flight during a push finishes on
the new weights (its older-version KV entries are kept, as in asynchronous RL). Every token is
tagged with the version of the weights of the step that sampled it (``TokenEvent.
weight_version``, ``Completion.weight_versions``); ``Completion.weight_version`` is its first
token's.

Speculative decoding (``drafter=``, MTP modules): a request decodes speculatively while it is
the only one live, which is when decoding is latency-bound and a verify pass over k + 1 tokens
costs about what one token does. It must ask for the plain target distribution (no top-k/top-p,
no top logprobs); its tokens, logprobs and finish reasons are exactly what plain decoding gives
(greedy: identical tokens; sampling: identically distributed). When another request joins, it
continues in the batch with plain decoding. A request that takes its prompt's start from a
shared prefix decodes speculatively too, its drafts seeing the sequence from where the shared
part ends (`SpeculativeSession.prefill`; on held-out code, drafts that saw only the last 8 of
384 prompt tokens were accepted as often as those that saw all of them).

With ``record_routing`` (RL rollouts of a mixture-of-experts model), requests record their
routing (``Completion.routed_experts``, and piece by piece in ``TokenEvent``): the experts each
MoE layer chose for each token, in the very pass that produced the token's keys and values (a
shared prefix's routing comes with its keys and values), so that training can replay it
(router replay) rather than route again on slightly different numbers. A request's rows match
its keys and values one for one, a verify pass's rejected drafts dropped with theirs.

On the CPU kernels (``codedojo.ops``) a forward pass over at most 512 tokens in all
(``transformer.FUSED_TOKENS``) is batch-invariant: a token's logits do not depend on the other
tokens in the pass, bit for bit. So greedy speculative decoding emits exactly plain greedy
decoding's tokens in float32 and bfloat16 alike, and decode steps do not mix requests'
numbers. Larger passes (longer prefills) go through BLAS, which makes no such promise: a prompt
prefilled in one batch with others may differ in the last bits from the same prompt prefilled
alone. Nor does an MoE layer: an expert runs over all the tokens routed to it in the pass, so
a token's numbers move with its neighbours' routing (logprobs by about 1e-6 in the tests' tiny
MoE model; the tokens held); its routing is recorded for replay for that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from codedojo.engine.prefix_cache import Entry, PrefixCache, common_prefix
from codedojo.engine.sampling import filtered_logprobs, sample_batch
from codedojo.engine.speculative import (
    Drafter,
    DraftTree,
    SpecStats,
    SpeculativeSession,
    TransformerTarget,
    best_depth,
    tree_gain_and_cost,
)
from codedojo.engine.types import Completion, GenerationError, SamplingParams, TokenEvent
from codedojo.model.kv_cache import KVCache
from codedojo.model.moe import moe_layers
from codedojo.model.transformer import Transformer
from codedojo.ops import greedy, load_kernel


def input_major_weights(model: torch.nn.Module) -> None:
    """Store every matrix input-major (the transpose is contiguous), in place.

    Values, shapes and gradients are unchanged; only strides differ. A decode step multiplies a
    few rows by each weight, and MKL streams an input-major (k-major) matrix about twice as
    fast as the row-major ``nn.Linear`` layout at batch 1 on CPU, where decoding is bound by
    reading the weights. The engine uses this only where the small-row kernel of
    ``codedojo.ops`` (which wants the row-major layout, and is faster still) cannot be built.
    """
    with torch.no_grad():
        for p in model.parameters():
            # float32 only: MKL's bfloat16 GEMV is far slower on the transposed layout.
            if (p.ndim == 2 and p.dtype == torch.float32 and p.is_contiguous()
                    and p.shape[0] > 1 and p.shape[1] > 1):
                p.data = p.data.t().contiguous().t()


log = logging.getLogger(__name__)
PREFILL_TOKENS = 4096  # padded tokens per batched prefill pass
# Shared prefixes shorter than this are prefilled again (a copy and a batch of its own do not pay).
PREFIX_MIN_TOKENS = 32
# Whether a draft tree pays is judged on the tree rounds of probing (32 of the first 64), with
# the gain the rank model expects counted as this many rounds besides: enough that a stretch of
# easy text, where every top draft passes, does not switch the tree off on its own.
TREE_PRIOR_ROUNDS = 16
DEFAULT_TREE = 5  # nodes of a GPU engine's draft tree, unless told otherwise
# Whether drafts pay is judged by the acceptance of the engine's latest rounds (its
# `SpecStats.window`), so that it follows the traffic and the weights (a long-lived server's
# totals would never move), and for a request by its own rounds too: acceptance differs far
# more between texts than between the rounds of one (SmolLM2-135M's first draft passed 0.14 to
# 1.0 of the time on 24 held-out code prompts). The engine's rates count as this many rounds of
# the request's own.
PRIOR_ROUNDS = 8
# A request in this many failed steps ends with an error, even where others shared them.
MAX_FAILURES = 3


@contextlib.contextmanager
def _draws_undone_on_failure(gens: Sequence[torch.Generator | None]) -> Iterator[None]:
    """Put the generators back as they were should the block raise: a seeded request put back
    after a failed step then draws as if the step had not run (a row after it in the batch
    failing to sample must not change its tokens)."""
    states = [(g, g.get_state()) for g in gens if g is not None]
    try:
        yield
    except BaseException:
        for g, state in states:
            g.set_state(state)
        raise


@dataclass(eq=False)  # a request is itself: two with equal fields are two requests
class Request:
    """One generation request as the scheduler tracks it."""

    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[TokenEvent], None] | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error")
    weight_versions: list[int] = field(default_factory=list)  # per token, the step's weights
    loads: int = -1  # the engine's `load_weights` calls before its prefill
    cancelled: bool = False
    # failed steps it was in; once in a failed step with others, it is prefilled again (with
    # what it generated so far) in a batch of its own, so that a request that fails a step
    # fails alone and the others go on
    failures: int = 0
    alone: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    # where its prompt's first `cached_tokens` keys/values come from: a live request or a
    # prefix cache entry (chosen at admission)
    reuse: Request | Entry | None = None
    cached_tokens: int = 0
    # routing recorded: the experts of every token in its cache slot, (tokens, MoE layers,
    # top_k) pieces: the prompt's (a shared prefix's alone until the prefill), then one row per
    # token fed; piece i goes out with generated token i, the token sampled after it
    routed: list[torch.Tensor] = field(default_factory=list)

    @functools.cached_property
    def prompt_tensor(self) -> torch.Tensor:
        return torch.tensor(self.prompt_ids)

    @property
    def reused(self) -> int:
        """The leading tokens whose keys/values its admission copies (until its prefill)."""
        return self.cached_tokens if self.reuse is not None else 0

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def context_ids(self) -> list[int]:
        """What its cache slot must hold to go on: the prompt, and what it generated (put back
        after a failed step)."""
        return self.prompt_ids + self.token_ids

    @property
    def weight_version(self) -> int:
        """The version of the weights that sampled its first token (-1: none yet)."""
        return self.weight_versions[0] if self.weight_versions else -1

    def routed_experts(self) -> torch.Tensor | None:
        """The routing recorded so far, as one (tokens, MoE layers, top_k) tensor."""
        return torch.cat(self.routed) if self.routed else None

    def completion(self) -> Completion:
        routed = self.routed_experts()  # a round that stopped early holds rows past the end
        fed = len(self.prompt_ids) + len(self.token_ids) - 1
        return Completion(prompt_ids=self.prompt_ids, token_ids=self.token_ids,
                          logprobs=self.logprobs, finish_reason=self.finish_reason or "cancelled",
                          weight_version=self.weight_version, top_logprobs=self.top_logprobs,
                          cached_tokens=self.cached_tokens,
                          routed_experts=None if routed is None else routed[:fed],
                          weight_versions=self.weight_versions)


class Engine:
    """Batched, continuously-batched generation over a ``Transformer``."""

    def __init__(self, model: Transformer, *, max_batch: int = 16,
                 max_seq_len: int | None = None, drafter: Drafter | None = None,
                 spec_draft_cost: float | None = None, spec_probe_rounds: int = 64,
                 spec_explore_every: int = 32, spec_tree: int | None = None,
                 prefix_cache_tokens: int = 16384, record_routing: bool = False) -> None:
        """``prefix_cache_tokens``: finished sequences' keys and values kept for reuse, in
        tokens (SmolLM2-135M: 46 KB a token in float32); 0 turns prefix reuse off (live
        sequences are not shared either).

        ``record_routing``: an MoE model's requests record the experts every token took
        (``Completion.routed_experts``), for router replay in training. No effect on a dense
        model.

        ``drafter``: MTP drafts for speculative decoding. The first ``spec_probe_rounds``
        rounds draft with every module; from then on each round drafts the number of tokens
        that emits the most per unit of time by the acceptance seen (`best_depth`: of the
        engine's latest rounds and of the request's own), with one more draft costing
        ``draft_cost`` plain decode steps (drafting it and verifying it), except every
        ``spec_explore_every``-th round, which drafts with every module so that the acceptance
        of every draft stays current. When no draft pays, rounds draft nothing but those:
        speculation pauses, and resumes if the drafts come to pay (on text they know better).
        ``spec_explore_every=0``: no exploring rounds, and when no draft pays speculation stops
        (until MTP weights are pushed, `load_weights`).
        ``spec_draft_cost``: that cost, fixed; None: measured while probing, where every
        fourth round drafts nothing to time a plain step (a draft costs about 0.2 steps on a
        2-core CPU, far less on a GPU); 0: always draft with every module.
        ``spec_tree``: greedy rounds may draft a tree of this many nodes (`DraftTree.best`,
        cut to the round's depth) where the drafter drafts trees (``draft_tree``); 0: chains;
        None: ``DEFAULT_TREE`` on a GPU, chains on a CPU. A tree emits more tokens a pass
        (SmolLM2-135M: 2.37 against 2.08 with 5 nodes) for a wider pass, which costs little on
        a GPU at batch 1 and a round 1.09 times a chain's on a 2-core CPU (where, with the
        probing below, `spec_decode.py` ran 3% behind chains). Probing drafts the tree in half
        its rounds, and from then on greedy rounds draft it if it pays (``tree_pays``; the
        draft cost is measured on chains either way)."""
        if spec_draft_cost is not None and spec_draft_cost < 0:
            raise ValueError(f"spec_draft_cost must be >= 0, got {spec_draft_cost}")
        if spec_explore_every < 0:
            raise ValueError(f"spec_explore_every must be >= 0, got {spec_explore_every}")
        if spec_tree is not None and spec_tree < 0:
            raise ValueError(f"spec_tree must be >= 0 nodes, got {spec_tree}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        cfg = model.cfg
        self.model = model.eval()
        moe = moe_layers(model)
        self._moe = moe if record_routing else []  # the layers whose routing is recorded
        if any(m.n_experts > torch.iinfo(torch.int16).max + 1 for m in self._moe):
            raise ValueError(f"record_routing: routing is kept as int16 expert ids, and this model "
                             f"has {max(m.n_experts for m in self._moe)} experts in a layer")
        # "dense", "recorded" or "unrecorded" (an MoE model, record_routing off)
        self.routing = "recorded" if self._moe else ("unrecorded" if moe else "dense")
        w = next(model.parameters())
        self.device = w.device  # where token ids go in
        if self.device.type == "cpu" and load_kernel() is None:
            input_major_weights(model)
        self.max_batch = max_batch
        if max_seq_len is not None and max_seq_len < 2:  # (a prompt token and one to generate)
            raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
        self.max_seq_len = min(cfg.max_seq_len if max_seq_len is None else max_seq_len,
                               cfg.max_seq_len)
        self.cache = KVCache(cfg, max_batch, self.max_seq_len, dtype=w.dtype, device=self.device)
        self.weight_version = 0
        self._loads = 0  # load_weights calls (a version number may be pushed twice)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.drafter = drafter
        self._drafter = drafter  # kept should speculation be switched off (`_restart_probing`)
        self.spec_stats = SpecStats()  # over every speculative round of this engine
        self.spec_draft_cost = spec_draft_cost
        self.spec_probe_rounds = max(1, spec_probe_rounds)  # the first round always drafts
        self.spec_explore_every = spec_explore_every
        self._spec_steps = 0  # speculative steps run (rounds without drafts included)
        self._round_s: dict[int, list[float]] = {}  # probing steps' seconds, by drafts
        self._measured_cost: float | None = None  # draft_cost, once probing is over
        # drafter.depth, kept for draft_cost after speculation is switched off (drafter None)
        self._spec_max_depth = 0 if drafter is None else drafter.depth
        if spec_tree is None:
            spec_tree = DEFAULT_TREE if self.device.type == "cuda" else 0
        self.spec_tree = (DraftTree.best(drafter.depth, spec_tree) if drafter is not None
                          and spec_tree and hasattr(drafter, "draft_tree") else None)
        # timed full-depth probing rounds: seconds of tree and of chain rounds; the tokens the
        # tree rounds emitted and those their top chains alone would have
        self._tree_probe: dict[str, list[float]] = {"tree_s": [], "chain_s": [],
                                                    "tree_tokens": [], "chain_tokens": []}
        self._tree_pays: bool | None = None  # decided once probing is over
        self._spec: tuple[Request, SpeculativeSession] | None = None
        self._paused = False  # no draft paid at the last admission
        self._waiting: deque[Request] = deque()
        self._live: list[Request] = []  # request i lives in cache slot i
        self._admitting: list[Request] = []  # the batch being prefilled
        self._step_lock = threading.Lock()  # one scheduler iteration (or weight swap) at a time
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False

    # ---------------------------------------------------------------- public API
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_event: Callable[[TokenEvent], None] | None = None) -> Request:
        """Queue one request (validated now, so bad input fails in the caller's thread)."""
        self._check(prompt_ids, params)
        return self._enqueue(prompt_ids, params, on_event)

    def _enqueue(self, prompt_ids: list[int], params: SamplingParams,
                 on_event: Callable[[TokenEvent], None] | None = None) -> Request:
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        req = Request(list(prompt_ids), params, on_event, gen)
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()
        return req

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request."""
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        vocab = self.model.cfg.vocab_size
        if not all(type(t) is int for t in prompt_ids):
            bad = next(t for t in prompt_ids if type(t) is not int)
            raise ValueError(f"prompt_ids: token ids must be integers, got {bad!r}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt_ids: token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens leave no room to generate "
                             f"(max_seq_len {self.max_seq_len})")

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 timeout: float | None = None) -> list[Completion]:
        """Generate for every prompt (batched); returns completions in prompt order. Requests
        not done within ``timeout`` seconds are cancelled: their completions hold what they
        generated by then, with finish reason "cancelled"."""
        if timeout is not None and not timeout >= 0:  # NaN too
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} entries for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):  # all, before any runs
            try:
                self._check(p, sp)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        reqs = [self._enqueue(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for r in reqs:
            self._wait(r, deadline)
        late = [r for r in reqs if not r.done.is_set()]
        for r in late:  # all at once: the next step ends them, keeping their tokens
            self._cancel(r)
        for r in late:
            self._wait(r, math.inf)
        failed = next((r for r in reqs if r.finish_reason == "error"), None)
        if failed is not None:
            raise GenerationError(f"generation failed: {failed.error}")
        return [r.completion() for r in reqs]

    def _wait(self, req: Request, deadline: float) -> None:
        """Until ``req`` is done or it is ``deadline`` (`time.perf_counter`): with no scheduler
        running, the caller's thread runs the steps."""
        while not req.done.is_set() and (left := deadline - time.perf_counter()) > 0:
            if self._running:
                req.done.wait(None if left == math.inf else left)
            else:
                self.step()

    async def stream(self, prompt_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[TokenEvent]:
        """Yield tokens as they are generated. Stopping iteration (or ``aclose()``) cancels the
        request. Starts the background scheduler if it is not running."""
        if not self._running:
            self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def deliver(ev: TokenEvent) -> None:  # runs on the scheduler thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:  # the consumer's loop has closed: nobody is listening
                req.cancelled = True

        req = self.submit(prompt_ids, params, on_event=deliver)
        try:
            while True:
                ev = await queue.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not req.done.is_set():
                req.on_event = None  # the consumer is gone; its loop may close before we stop
                self._cancel(req)

    def _cancel(self, req: Request) -> None:
        """Cancel a request: one still queued ends now (a queue of requests nobody waits for
        would hold their prompts, and what they share, until they reach its head); a live one
        at the scheduler's next step."""
        with self._wake:
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
                self._finish(req, "cancelled")
            self._wake.notify()

    def start(self) -> None:
        """Run the scheduler on a background thread (continuous batching across callers)."""
        if self._running:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="codedojo-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background scheduler; requests still queued or live are cancelled."""
        if not self._running:
            return
        self._running = False
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._end_all("cancelled")

    def _end_all(self, reason: str, error: str | None = None) -> None:
        """End every request queued, being admitted or live, with ``reason`` (and ``error``),
        and empty every cache slot."""
        with self._step_lock, self._wake:  # (callers may be queueing requests meanwhile)
            for r in [*self._live, *self._admitting, *self._waiting]:
                self._finish(r, reason, error)
            self._live.clear()
            self._admitting = []
            self._waiting.clear()
            self._spec = None
            for slot in range(self.max_batch):
                self.cache.reset(slot)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Swap in new weights between scheduler steps: all or some parameters, by their names
        in the model's state dict, and with an MTP drafter its modules' by theirs in
        ``drafter.mtp``'s, after ``mtp.``. Tokens sampled from then on carry ``version`` (an
        integer >= 0, never below the engine's: versions only go up). Prefixes are not shared
        across it: the prefix cache is emptied, and requests prefilled before it are no source
        for requests after it (even under the same version number). MTP weights restart the
        probing of speculative decoding (`_restart_probing`): what it saw of the old drafts
        tells nothing of the new.

        Everything is checked before anything changes: a version, a name or a tensor refused
        raises with the engine as it was. A copy that fails even so (out of memory on the
        device) raises with some parameters new and some old, the engine already on ``version``
        and no keys and values of the old weights left to share: push again."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"load_weights: version must be an integer, got {version!r}")
        if version < 0:  # (-1 tags what no weights made)
            raise ValueError(f"load_weights: version must be >= 0, got {version}")
        if version < self.weight_version:  # (how far behind a sample is counts on it)
            raise ValueError(f"load_weights: version must not go back: {version} after "
                             f"{self.weight_version}")
        own = self.model.state_dict()
        mtp = getattr(self._drafter, "mtp", None)  # an MTP drafter's modules ("mtp." names)
        if mtp is not None:
            own.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            hint = (" (mtp. names need an engine with an MTP drafter)"
                    if mtp is None and any(k.startswith("mtp.") for k in unknown) else "")
            raise KeyError(f"load_weights: unknown parameter names {unknown[:5]}{hint}")
        for k, v in state_dict.items():  # (all checked before any is copied: a load that
            if not isinstance(v, torch.Tensor) or v.is_complex() or (  # failed half-way would
                    v.is_floating_point() != own[k].is_floating_point()):  # serve a mix)
                raise TypeError(f"load_weights: {k} must be a "
                                f"{'floating' if own[k].is_floating_point() else 'integer'}"
                                f" tensor, got {getattr(v, 'dtype', type(v).__name__)}")
            if (type(v) not in (torch.Tensor, torch.nn.Parameter) or v.layout != torch.strided
                    or v.is_meta or v.is_nested):
                raise TypeError(f"load_weights: {k} must be a dense tensor holding its values, "
                                f"got a {type(v).__name__} ({v.layout}) on {v.device}")
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"load_weights: {k} has shape {tuple(v.shape)}, "
                                 f"expected {tuple(own[k].shape)}")
        with self._step_lock, torch.no_grad():
            # the old weights' keys and values go before the first copy, should one fail
            self.weight_version = version
            self._loads += 1
            self.prefix_cache.clear()
            try:
                for k, v in state_dict.items():
                    own[k].copy_(v)
            finally:
                # drafts read the new head, a drafter switched off too (it may come back)
                refresh = getattr(self._drafter, "refresh", None)
                if refresh is not None:
                    refresh()
                if any(k.startswith("mtp.") for k in state_dict):
                    self._restart_probing()

    def _restart_probing(self) -> None:
        """Judge the drafts afresh: the window of the latest rounds (`SpecStats.window`) is
        emptied, speculation switched off is on again, and the next ``spec_probe_rounds``
        rounds probe as the first did (every module; the tree in half of them, whether it pays
        decided again on the tokens they emit); the costs measured stay (they are the
        hardware's, not the weights')."""
        self.drafter = self._drafter
        self.spec_stats.clear_recent()
        self._spec_steps = 0
        self._tree_pays = None
        self._tree_probe["tree_tokens"].clear()
        self._tree_probe["chain_tokens"].clear()

    @property
    def n_live(self) -> int:
        return len(self._live)

    # ---------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        while self._running:
            with self._wake:
                while self._running and not self._waiting and not self._live:
                    self._wake.wait()
            if not self._running:
                break
            try:
                self.step()
            except Exception as e:  # beyond what a step recovers from (`_fail_step` failed)
                log.exception("the engine's scheduler failed: every request ends")
                self._end_all("error", f"{type(e).__name__}: {e}")

    @torch.inference_mode()
    def step(self) -> None:
        """One scheduler iteration: admit, decode once, retire. Should it fail (an error in the
        model or in sampling), every slot is emptied and the engine goes on (`_fail_step`)."""
        with self._step_lock:
            try:
                self._retire()
                self._admit()
                self._retire()
                if self._live:
                    self._decode_step(self._live)
                self._retire()
            except Exception as e:
                log.exception("an engine step failed")
                self._fail_step(f"{type(e).__name__}: {e}")

    def _fail_step(self, error: str) -> None:
        """After a failed step: a request that was alone in the failing pass (a prefill, or a
        decode step), or that was in ``MAX_FAILURES`` failed steps, ends with finish reason
        "error" and ``error``. The others of the pass are put back at the head of the queue,
        each to be prefilled again in a batch of its own with what it generated, and so are
        the live requests that were not in it. A request whose every prefill fails thus fails
        alone; one that fails only in batched decoding brings a failed step to each request
        decoded with it, and after ``MAX_FAILURES`` of them they all end. Every cache slot is
        emptied (a failed pass may have written any)."""
        ran = self._admitting or self._live  # the requests of the pass that failed
        for r in ran:
            r.failures += 1
            if len(ran) == 1 or r.failures >= MAX_FAILURES:
                self._finish(r, "error", error)
            r.alone = True
        back = [r for r in {id(r): r for r in [*self._live, *self._admitting]}.values()
                if not r.done.is_set()]
        for r in back:
            r.reuse = None
            del r.routed[len(r.token_ids):]  # rows of the failed pass, if it recorded any
        for slot in range(self.max_batch):
            self.cache.reset(slot)
        self._live.clear()
        self._admitting = []
        self._spec = None
        if back:
            log.warning("%d requests of a failed step go back to the queue, %d to be "
                        "prefilled alone", len(back), sum(r.alone for r in back))
        with self._wake:
            self._waiting.extendleft(reversed(back))

    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill them together: prompts are
        right-padded into one batch (a pad never influences a real token under the causal
        mask, and each slot is then cut back to its prompt), up to ``PREFILL_TOKENS`` padded
        tokens per forward pass. A prompt that shares at least ``PREFIX_MIN_TOKENS`` leading
        tokens with a live sequence or a prefix cache entry is prefilled from where they part
        (unless ``prefix_cache_tokens`` is 0); one that would share more with a request of the
        batch being gathered waits for the next batch (the same iteration), to share it then:
        the first of a group of equal prompts is prefilled alone, the others together after."""
        while self._waiting and len(self._live) < self.max_batch:
            batch: list[Request] = []
            with self._wake:
                while self._waiting and len(self._live) + len(batch) < self.max_batch:
                    req = self._waiting[0]
                    if req.cancelled:
                        self._waiting.popleft()
                        self._finish(req, "cancelled")
                        continue
                    if req.alone and batch:
                        break
                    self._find_reuse(req)
                    if self._shares_more_with(req, batch):
                        break
                    rows = [*batch, req]
                    width = max(r.context_len - r.reused for r in rows)
                    past = max(r.reused for r in rows)  # padded rows run past their prompt
                    if batch and (width * len(rows) > PREFILL_TOKENS
                                  or past + width > self.max_seq_len):
                        break
                    self._waiting.popleft()
                    batch.append(req)
                    if req.alone:
                        break
            if batch:
                self._admitting = batch  # ended with the step, should it fail
                self._prefill(batch)
                self._admitting = []

    def _find_reuse(self, req: Request) -> None:
        """Choose where the prompt's leading keys/values come from: the live sequence (of the
        current weights) or prefix cache entry sharing the most tokens with it; at least one
        prompt token is left to prefill, for the first token's logits."""
        if not self.prefix_cache.max_tokens or req.token_ids:  # put back: prefilled whole
            return
        ids = req.prompt_tensor
        src: Request | Entry | None = None
        n = 0
        for slot, r in enumerate(self._live):
            if r.loads != self._loads:  # keys and values of older weights
                continue
            m = common_prefix(r.prompt_tensor, ids)
            if m == len(r.prompt_ids) and r.token_ids:  # and on into what it generated
                m += common_prefix(torch.tensor(r.token_ids), ids[m:])
            if (m := min(m, self.cache.lengths[slot])) > n:
                src, n = r, m
        entry, m = self.prefix_cache.lookup(ids)
        if m > n:
            src, n = entry, m
        n = min(n, len(ids) - 1)
        req.reuse, req.cached_tokens = (src, n) if n >= PREFIX_MIN_TOKENS else (None, 0)

    def _shares_more_with(self, req: Request, batch: list[Request]) -> bool:
        """Whether ``req`` would reuse more of a request in ``batch`` (once prefilled) than
        ``_find_reuse`` found for it, and at least ``PREFIX_MIN_TOKENS`` tokens."""
        if not self.prefix_cache.max_tokens:
            return False
        last = len(req.prompt_ids) - 1
        return any(min(common_prefix(r.prompt_tensor, req.prompt_tensor), last)
                   >= max(PREFIX_MIN_TOKENS, req.cached_tokens + 1) for r in batch)

    def _take_prefix(self, slot: int, req: Request) -> tuple[int, list[int]]:
        """Fill ``slot`` with the keys/values ``req`` reuses; return how many tokens that is,
        and the tokens left to prefill."""
        src, n = req.reuse, req.reused
        req.reuse = None  # hold no entry past this point
        routed = None
        if src is None:
            self.cache.reset(slot)
        elif isinstance(src, Entry):
            self.cache.load(slot, src.k[:, :, :n], src.v[:, :, :n])
            routed = src.routed_experts
        else:
            self.cache.copy(next(i for i, r in enumerate(self._live) if r is src), slot, n)
            routed = src.routed_experts()
        if not req.token_ids:  # (one put back keeps the rows that went out with its tokens)
            req.routed = [routed[:n]] if routed is not None else []
        return n, req.context_ids[n:]

    @property
    def speculating(self) -> bool:
        """Whether a lone request's rounds draft: a drafter (not switched off), and drafts that
        pay (or probing still under way). While none pays, only exploring rounds draft."""
        return self.drafter is not None and self._paying_depth() > 0

    @property
    def draft_cost(self) -> float:
        """What one more draft per round costs, in plain decode steps: ``spec_draft_cost``, or
        measured while probing as (a round with every module - a plain step) / (modules x a
        plain step), medians of the probing steps (0.2 until both are timed)."""
        if self.spec_draft_cost is not None:
            return self.spec_draft_cost
        if self._measured_cost is not None:
            return self._measured_cost
        plain, full = self._round_s.get(0), self._round_s.get(self._spec_max_depth)
        if not plain or not full:
            return 0.2
        step = statistics.median(plain)
        cost = max(0.0, statistics.median(full) - step) / (self._spec_max_depth * step)
        if self._spec_steps >= self.spec_probe_rounds:  # no more timings: computed once
            self._measured_cost = cost
        return cost

    @property
    def tree_pays(self) -> bool:
        """Whether greedy rounds draft the tree now: in half the probing rounds; after them, if
        the tree's rounds emitted more tokens than their top chains alone would have by a
        larger factor than their time exceeded a chain round's. (Each tree round holds its own
        chain, so the gain is read on the same text: the emitted tokens of rounds on different
        text differ by far more.) The gain the rank model expects (`DraftTree.
        expected_tokens`) counts as ``TREE_PRIOR_ROUNDS`` rounds of its own."""
        tree = self.spec_tree
        if tree is None:
            return False
        if self._spec_steps < self.spec_probe_rounds:
            return self._spec_steps % 4 in (1, 2)
        if self._tree_pays is None:
            p, chain = self._tree_probe, tree.top_chain().expected_tokens()
            gain, cost = tree_gain_and_cost(
                p["tree_tokens"], p["chain_tokens"], p["tree_s"], p["chain_s"],
                prior_gain=tree.expected_tokens() / chain,
                prior_tokens=TREE_PRIOR_ROUNDS * chain)
            self._tree_pays = gain > cost
            log.info("draft tree of %d nodes: %.3f times the tokens of its top chain for %.3f "
                     "times a chain round's time: %s", len(self.spec_tree), gain, cost,
                     "on" if self._tree_pays else "off")
        return self._tree_pays

    def spec_report(self) -> dict[str, float | int | bool] | None:
        """How speculative decoding is going, for `dojo serve`'s ``/health``: None for an engine
        built without a drafter; else whether rounds draft now, the rounds so far (each one
        target pass), the acceptance of the first draft and of all drafts, the tokens emitted
        per target pass, the drafts per round, what a draft costs in plain steps, and the
        acceptance of draft J once drafts 1..J-1 passed."""
        if self._spec_max_depth == 0:
            return None
        return {"modules": self._spec_max_depth, "speculating": self.speculating,
                "draft_cost": self.draft_cost,
                "tree_nodes": len(self.spec_tree) if self.spec_tree and self.tree_pays else 0,
                **self.spec_stats.as_dict()}

    def _paying_depth(self, own: SpecStats | None = None) -> int:
        """The number of drafts a round pays for (every module while probing), by the
        acceptance of the engine's latest rounds; for a request, by its own rounds, those
        counting as ``PRIOR_ROUNDS`` rounds of its own."""
        assert self.drafter is not None
        depth = self.drafter.depth
        if self.spec_draft_cost == 0 or self._spec_steps < self.spec_probe_rounds:
            return depth
        rates = self.spec_stats.pass_rates(depth, recent=True)
        if own is not None:
            rates = own.pass_rates(depth, prior=rates, prior_rounds=PRIOR_ROUNDS)
        return best_depth(rates, depth, self.draft_cost)

    def _spec_depth(self, own: SpecStats) -> int:
        """Drafts for the next speculative round (see ``__init__``): what pays, but while
        probing every fourth round drafts nothing when the cost is to be measured, and after
        it every ``spec_explore_every``-th drafts with every module."""
        assert self.drafter is not None
        n, e = self._spec_steps, self.spec_explore_every
        if n < self.spec_probe_rounds:
            timing = self.spec_draft_cost is None and self._measured_cost is None
            return 0 if timing and n % 4 == 3 else self.drafter.depth
        if e and (n - self.spec_probe_rounds) % e == e - 1:
            return self.drafter.depth
        return self._paying_depth(own)

    def _speculates(self, req: Request) -> bool:
        if self.drafter is not None and (paused := self._paying_depth() == 0) != self._paused:
            self._paused, st = paused, self.spec_stats
            log.warning("speculative decoding %s: %.2f tokens per target pass over %d rounds, "
                        "first-draft acceptance %.2f, a draft at %.2f steps",
                        ("paused, drafting only to re-check" if self.spec_explore_every
                         else "off") if paused else "resumed",
                        st.tokens_per_pass, st.rounds, st.accept_first, self.draft_cost)
            if paused and not self.spec_explore_every:
                self.drafter = None
                self._spec = None  # a lone speculating request goes on decoding plainly
        p = req.params
        alone = not self._live and not self._waiting
        # A seeded sampled request decodes plainly: speculative rounds draw from its generator
        # as often as the engine's state (probing, timings, acceptance) has them draft, so its
        # seed would not give the same tokens twice.
        seeded = p.temperature > 0 and p.seed is not None
        return (self.drafter is not None and alone and p.top_k == 0 and p.top_p == 1.0
                and not p.top_logprobs and not seeded and not req.token_ids)

    def _prefill(self, batch: list[Request]) -> None:
        if len(batch) == 1 and self._speculates(batch[0]):
            return self._prefill_speculative(batch[0])
        start = len(self._live)
        rest = [self._take_prefix(start + i, r)[1] for i, r in enumerate(batch)]
        lens = [len(t) for t in rest]
        tokens = torch.zeros(len(batch), max(lens), dtype=torch.long)
        for i, t in enumerate(rest):
            tokens[i, : lens[i]] = torch.tensor(t)
        view = self.cache.view(start, start + len(batch))
        logits = self.model(tokens.to(self.device), cache=view,
                            logits_at=torch.tensor(lens, device=self.device) - 1)
        # one put back records the row of its last token only (those before went out)
        self._record_routing(batch, [[n - 1] if r.token_ids else n
                                     for r, n in zip(batch, lens, strict=True)])
        for i, r in enumerate(batch):
            self.cache.truncate(start + i, r.context_len)
            r.loads = self._loads
        self._live.extend(batch)
        self._emit(batch, logits[:, -1])
        for r in batch:
            r.alone = False

    def _prefill_speculative(self, req: Request) -> None:
        assert self.drafter is not None and not self._live
        start, _ = self._take_prefix(0, req)
        target = TransformerTarget(self.model, cache=self.cache, slot=0,
                                   taps=getattr(self.drafter, "taps", ()))
        sess = SpeculativeSession(target, self.drafter, req.params.temperature, req.generator,
                                  stats=self.spec_stats, tree=self.spec_tree)
        sess.prefill(req.prompt_ids, start=start)
        self._record_routing([req], [sess.kept_rows])
        req.loads = self._loads
        self._live.append(req)
        self._spec = (req, sess)
        self._record_logits(req, sess)

    def _record_logits(self, req: Request, sess: SpeculativeSession) -> None:
        """Record the tokens a speculative step emitted, logprobs from their target logits."""
        assert sess.logits is not None
        emitted = sess.tokens[-len(sess.logits):]
        if req.params.temperature == 0:  # plain greedy steps' arithmetic (sample_batch)
            lps = greedy(sess.logits, torch.tensor(emitted))[1].tolist()
        else:
            lps = [float(filtered_logprobs(row, req.params)[tok])  # as plain steps', always
                   for tok, row in zip(emitted, sess.logits, strict=True)]
        for tok, lp in zip(emitted, lps, strict=True):
            self._record(req, tok, lp, [])
            if req.done.is_set():
                break

    def _decode_step(self, live: list[Request]) -> None:
        """Feed each live request's last token; sample the next one."""
        if self._spec is not None:
            req, sess = self._spec
            if live == [req]:
                room = min(req.params.max_tokens - len(req.token_ids),
                           self.max_seq_len - len(req.prompt_ids) - len(req.token_ids))
                depth = self._spec_depth(sess.own)
                # a request's first round also drafts over the whole prompt: not timed
                timed = depth < room and len(req.token_ids) > 1  # and drafts what was asked
                t = time.perf_counter()
                with _draws_undone_on_failure([req.generator]):
                    emitted = len(sess.round(max_tokens=room, depth=depth, tree=self.tree_pays))
                if timed and self._spec_steps < self.spec_probe_rounds:
                    seconds = time.perf_counter() - t
                    if depth == self._spec_max_depth:  # full depth: the tree's probe
                        probe = self._tree_probe
                        probe["tree_s" if sess.tree_round else "chain_s"].append(seconds)
                        if sess.tree_round:
                            probe["tree_tokens"].append(emitted)
                            probe["chain_tokens"].append(sess.chain_emitted)
                    if not sess.tree_round:  # the draft cost is a chain's
                        self._round_s.setdefault(depth, []).append(seconds)
                self._spec_steps += 1
                # the verify pass's rows of the positions kept, one per token emitted
                self._record_routing([req], [sess.kept_rows])
                self._record_logits(req, sess)
                return
            self._spec = None  # others joined (or it finished): plain batched decoding
        tokens = torch.tensor([[r.token_ids[-1]] for r in live], dtype=torch.long,
                              device=self.device)
        logits = self.model(tokens, cache=self.cache.view(0, len(live)))  # (B, 1, V)
        if self._moe:
            self._record_routing(live, [1] * len(live))
        self._emit(live, logits[:, -1])

    def _record_routing(self, reqs: list[Request], lens: Sequence[int | list[int]]) -> None:
        """Append to each request the routing the last pass chose for its first ``lens[i]``
        tokens (row i; the rest of a row is padding), or for the tokens ``lens[i]`` lists (a
        tree's accepted branch)."""
        if not self._moe:
            return
        chosen = torch.stack([m.last_indices for m in self._moe], dim=2)  # (B, T, L, k)
        chosen = chosen.to(torch.int16).cpu()  # narrowed on the device, then one copy off it
        for i, r in enumerate(reqs):
            n = lens[i]
            rows = chosen[i, :n] if isinstance(n, int) else chosen[i, n]
            if r.token_ids:  # decoding (a verify pass feeds several tokens)
                r.routed.extend(rows.clone().split(1))
            else:  # the prompt's rest, after a shared prefix's rows
                r.routed = [torch.cat([*r.routed, rows])]

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample one token per request from logits (B, V) and record it."""
        gens = [r.generator for r in reqs]
        with _draws_undone_on_failure(gens):
            drawn = sample_batch(logits, [r.params for r in reqs], gens)
        for slot_req, (tok, lp, top) in zip(reqs, drawn, strict=True):
            self._record(slot_req, tok, lp, top)

    def _record(self, req: Request, tok: int, lp: float, top: list[tuple[int, float]]) -> None:
        """Record a token sampled by this step (of the current weights: `load_weights` waits
        for the step to end) and hand it to the request's callback."""
        req.token_ids.append(tok)
        req.logprobs.append(lp)
        req.top_logprobs.append(top)
        req.weight_versions.append(self.weight_version)
        p = req.params
        reason = None
        if tok in p.stop_token_ids:
            reason = "stop"
        elif len(req.token_ids) >= p.max_tokens or (
                len(req.prompt_ids) + len(req.token_ids) >= self.max_seq_len):
            reason = "length"
        req.finish_reason = reason
        n = len(req.token_ids)
        routed = req.routed[n - 1] if n <= len(req.routed) else None  # the rows it followed
        self._notify(req, TokenEvent(tok, lp, top, reason, req.cached_tokens, routed,
                                     weight_version=self.weight_version))
        if reason is not None:
            req.done.set()

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request without a token: cancelled, or failed (``error`` says why)."""
        if req.finish_reason is None:
            req.finish_reason, req.error = reason, error
            self._notify(req, TokenEvent(-1, 0.0, [], reason, req.cached_tokens, error=error))
        req.done.set()

    @staticmethod
    def _notify(req: Request, ev: TokenEvent) -> None:
        """Hand ``ev`` to the request's ``on_event``, if it has one. A callback that raises is
        the consumer's fault, not the engine's: it is logged and not called again, and the
        request alone ends, with finish reason "error" saying so (unless ``ev`` ended it
        already); the step and the other requests go on."""
        on_event = req.on_event  # (read once: a stream's consumer may drop it meanwhile)
        if on_event is None:
            return
        try:
            on_event(ev)
        except Exception as e:
            log.exception("a request's on_event raised: the request ends")
            req.on_event = None
            if ev.finish_reason is None:
                req.finish_reason, req.error = "error", f"on_event raised {type(e).__name__}: {e}"
                req.done.set()

    def _retire(self) -> None:
        """Drop finished/cancelled requests, keeping live slots contiguous."""
        i = 0
        while i < len(self._live):
            r = self._live[i]
            if r.cancelled and r.finish_reason is None:
                self._finish(r, "cancelled")
            if r.done.is_set():
                self._keep(i, r)
                last = len(self._live) - 1
                if last != i:
                    self.cache.move(last, i)  # also empties slot `last`
                else:
                    self.cache.reset(i)
                self._live[i] = self._live[last]
                self._live.pop()
            else:
                i += 1

    def _keep(self, slot: int, req: Request) -> None:
        """Put a retiring sequence's keys/values in the prefix cache (those of the current
        weights only: a request that saw a weight push holds older ones too)."""
        ids = (req.prompt_ids + req.token_ids)[: self.cache.lengths[slot]]
        # (a speculative round that stopped early holds keys past its last emitted token)
        n = len(ids)
        if PREFIX_MIN_TOKENS <= n <= self.prefix_cache.max_tokens and req.loads == self._loads:
            routed = req.routed_experts()
            self.prefix_cache.put(torch.tensor(ids), *self.cache.export(slot, n),
                                  routed_experts=None if routed is None else routed[:n])
