"""The scheduling ceiling (``rlstream bench ceiling``): an event model of the async benchmark's
sim workload that says how close to the ideal-overlap bound the *rules* let a pipeline come, so
that the gap ``rlstream bench async`` measures splits into what the rules cost and what the
implementation costs.

The model keeps what bounds throughput and nothing else:

* the async bench's workload and sizes: the sim engine's ``sample_length``, its decode slots and
  token latency (continuous batching: every running sample advances one token per step), the
  trainer's cost per token (``async_sync.sim_plan``), G groups of n samples per step;
* admission (``pipeline.control.admission_limit``) at each worker's loaded version, with the
  next admissible group going to the worker that has a free slot;
* whole-group training: the trainer takes the G oldest closed groups once G are closed, drops a
  sample its hard bound rejects (``is_stale``; the token rule judges a sample by its newest token,
  the sample rule by its oldest), and pays for the samples it trains;
* interrupt reloads (a running sample's later tokens carry the newest version) and the worker's
  restart policy as the bench configures it (``producers.holding.StaleRestarts``: held samples
  regenerated at a load or when their message's last sample ends, in-flight restarts under the
  sample rule);
* three fixed hops: a step's end to its WeightUpdate, the WeightUpdate to every worker's load,
  a group's last sample to the trainer.

Policies: ``rollout`` is the worker's. ``clairvoyant`` knows in advance which samples run to at
least half the clip and starts the other samples of their group late, so that they end together:
no sibling goes stale waiting for the long one, and none is generated twice. No scheduler knows
lengths, so it shows what length prediction could be worth under the same rules. ``first-n``
is ``rollout.overprovision``: ``n + extra`` samples drawn per group, the first ``n`` to finish kept
and the rest aborted (their slot time counted as spent). Dispatch: see ``Case.dispatch``.

What it is not: a measurement of rlstream. There is no Kafka, no process and no CPU contention;
the figures are a ceiling to set beside the measured rows, and the model is only as right as the
rules it copies.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.control import admission_limit, is_stale
from rlstream.dev.bench.harness import BenchContext, md_table, pyplot, rnd, write_json

NEEDS_KAFKA = False
HOPS = {"none": (0.0, 0.0, 0.0), "measured": (0.005, 0.035, 0.025)}
"""Hop delays in seconds: (step end -> WeightUpdate, WeightUpdate -> every worker loaded, a
group's last sample -> the trainer). ``measured``: publish 4.4 ms (async bench, hf k = 0 step
breakdown), notice -> loaded p50 34.5 ms (weights bench, sim workers), scored -> trained 25 ms
(reward hop 17 ms + commit and fetch 8 ms)."""
SIZES = {"tiny": {"steps": 40, "ks": [0, 2]}, "full": {"steps": 400, "ks": [0, 1, 2, 4]}}
PARTITIONS, PACED_BACKLOG, PACED_LEAD = 8, 8, 1
"""The async bench's prompts partitions and the paced feed's defaults (backlog 8, lead 1 step)."""
TOKEN_KS = (1, 2)
"""The async bench's token-rule cases."""


@dataclass(eq=False)
class SimSample:
    g: int
    i: int
    length: int
    version_min: int | None = None
    version_max: int | None = None
    restarts: int = 0
    env: None = None
    started: float = 0.0
    epoch: int = 0
    """Bumped when the sample is restarted, so its scheduled end no longer counts."""


@dataclass
class Worker:
    slots: int
    version: int = 0
    consumed: int = 0
    running: set = field(default_factory=set)
    ready: deque = field(default_factory=deque)
    queue: deque = field(default_factory=deque)
    """Groups placed on this worker's partitions, not started (``paced``)."""


@dataclass
class Case:
    k: int
    rule: str
    policy: str = "rollout"
    hops: str = "measured"
    steps: int = 400
    dispatch: str = "pull"
    """``pull``: a worker with a free slot takes the next admissible group (what an ideal dispatcher
    achieves). ``paced``: the paced feed's placement (``producers.pacing``): a group goes out
    ``lead`` steps before admission, onto the prompts partition with the fewest messages not yet
    committed (commits in offset order), and waits on worker ``p mod workers``."""
    extra: int = 0
    """``first-n``: samples started per group beyond ``n``; the first ``n`` to finish are the
    group, the rest are aborted (``rollout.overprovision``)."""


class Model:
    """One run of the model: events on a heap (time, sequence, handler, args), handled in order
    until the trainer has taken ``case.steps`` steps. ``restarts`` is the worker's
    ``StaleRestarts``, applied to model samples as the worker applies it to its own."""

    def __init__(self, case: Case, sz: dict, plan: dict, eng, restarts):
        from libs.engines.sim import sample_length

        self.c, self.sz, self.plan, self.restarts = case, sz, plan, restarts
        self.length = lambda g, i: sample_length(eng, f"g{g}/{i}", sz["clip"])
        self.G, self.n, self.lat = sz["groups"], sz["n"], sz["latency"]
        self.publish_s, self.notice_s, self.close_s = HOPS[case.hops]
        self.workers = [Worker(sz["inflight"]) for _ in range(sz["workers"])]
        self.events: list = []
        self.seq = 0
        self.t = 0.0
        self.next_g = 0
        self.left: dict[int, int] = {}
        self.held: dict[int, list[SimSample]] = {}
        self.closed: list[tuple[int, list[SimSample]]] = []
        self.version = self.consumed = 0
        self.trainer_busy = False
        self.steps: list[tuple[float, int]] = []
        self.trained = self.stale = self.generated = self.regenerated = self.restarted = 0
        self.aborted = self.trained_tokens = 0
        self.aborted_s = 0.0
        self.started: dict[int, list[SimSample]] = {}
        """``first-n``: every sample of each open group (to abort the losers)."""
        self.slot_s = 0.0
        self.partitions: list[deque] = [deque() for _ in range(PARTITIONS)]
        """Per prompts partition, [group, done] of each message not yet committed (``paced``)."""
        self.part_of: dict[int, list] = {}
        self.feed_version = self.feed_consumed = 0

    def at(self, dt: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (self.t + dt, self.seq, fn, args))

    def run(self) -> dict:
        self.feed()
        self.dispatch()
        while len(self.steps) < self.c.steps:
            self.t, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return self.result()

    # -- rollout ---------------------------------------------------------------------------------
    def dispatch(self) -> None:
        for w in self.workers:
            while len(w.running) < w.slots:
                if not w.ready and not self.pull(w):
                    break
                self.start(w, w.ready.popleft())

    def feed(self) -> None:
        """``paced``: place groups while the lead allows and a partition has room."""
        if self.c.dispatch != "paced":
            return
        limit = admission_limit(self.feed_version, self.c.k + PACED_LEAD, self.G, self.feed_consumed)
        while self.next_g < limit:
            backlog = [len(q) for q in self.partitions]
            p = min(range(PARTITIONS), key=lambda j: (backlog[j], j))
            if backlog[p] >= PACED_BACKLOG:
                return
            entry = [self.next_g, False]
            self.partitions[p].append(entry)
            self.part_of[self.next_g] = entry
            self.workers[p % len(self.workers)].queue.append(self.next_g)
            self.next_g += 1

    def commit(self, g: int) -> None:
        entry = self.part_of.pop(g, None)
        if entry is None:
            return
        entry[1] = True
        for q in self.partitions:
            while q and q[0][1]:
                q.popleft()
        self.feed()

    def pull(self, w: Worker) -> bool:
        """Take the next group onto ``w`` if its loaded version admits it."""
        limit = admission_limit(w.version, self.c.k, self.G, w.consumed)
        if self.c.dispatch == "paced":
            if not w.queue or w.queue[0] >= limit:
                return False
            g = w.queue.popleft()
        elif self.next_g < limit:
            g = self.next_g
            self.next_g += 1
        else:
            return False
        extra = self.c.extra if self.c.policy == "first-n" else 0
        samples = [SimSample(g, i, self.length(g, i)) for i in range(self.n + extra)]
        self.left[g], self.held[g] = self.n, []
        if extra:
            self.started[g] = samples
        longest = max(s.length for s in samples)
        defer = self.c.policy == "clairvoyant" and longest >= self.sz["clip"] // 2
        for s in samples:
            if defer and s.length < longest:
                self.at((longest - s.length) * self.lat, self.release, w, s)
            else:
                w.ready.append(s)
        return True

    def release(self, w: Worker, s: SimSample) -> None:
        w.ready.appendleft(s)
        self.dispatch()

    def start(self, w: Worker, s: SimSample) -> None:
        if s.version_min is None:
            s.version_min = w.version
        s.started = self.t
        w.running.add(s)
        self.at(s.length * self.lat, self.end, w, s, s.epoch)

    def end(self, w: Worker, s: SimSample, epoch: int) -> None:
        if epoch != s.epoch:
            return
        w.running.discard(s)
        self.slot_s += self.t - s.started
        self.generated += 1
        s.version_max = w.version
        self.left[s.g] -= 1
        if self.left[s.g] == 0 and s.g in self.started:
            self.abort_losers(w, s.g, [*self.held[s.g], s])
        if self.left[s.g] == 0:
            done = [*self.held.pop(s.g), s]
            again = self.restarts.likely_lost(s, done, w.version) if len(done) > 1 else []
            if again:
                self.held[s.g] = [x for x in done if x not in again]
                self.regenerate(w, again)
            else:
                del self.left[s.g]
                self.commit(s.g)
                self.at(self.close_s, self.close, s.g, done)
        else:
            self.held[s.g].append(s)
        self.dispatch()

    def abort_losers(self, w: Worker, g: int, winners: list[SimSample]) -> None:
        """``first-n``: group ``g`` has its ``n``: its other samples stop (running) or never start."""
        won = {id(x) for x in winners}
        losers = [x for x in self.started.pop(g) if id(x) not in won]
        for x in losers:
            x.epoch += 1  # its scheduled end is void
            self.aborted += 1
            if x in w.running:
                w.running.discard(x)
                self.slot_s += self.t - x.started
                self.aborted_s += self.t - x.started
        lost = {id(x) for x in losers}
        w.ready = deque(x for x in w.ready if id(x) not in lost)

    @staticmethod
    def requeue(w: Worker, s: SimSample) -> None:
        """``s`` starts again from its prompt, first in ``w``'s queue (its scheduled end is void)."""
        s.restarts += 1
        s.version_min = s.version_max = None
        s.epoch += 1
        w.ready.appendleft(s)

    def regenerate(self, w: Worker, samples: list[SimSample]) -> None:
        """Held (finished) samples run again: their group waits for them."""
        for s in samples:
            self.left[s.g] += 1
            self.regenerated += 1
            self.requeue(w, s)

    def load(self, w: Worker, version: int, consumed: int) -> None:
        w.version, w.consumed = version, consumed
        # sorted: a set's order follows object ids and insertion, and the model must be repeatable
        for s in sorted((s for s in w.running if self.restarts.doomed(s, version)), key=lambda s: (s.g, s.i)):
            w.running.discard(s)
            self.slot_s += self.t - s.started
            self.restarted += 1
            self.requeue(w, s)
        for g in sorted({s.g for s in w.running} | {s.g for s in w.ready}):
            again = [s for s in self.held.get(g, []) if self.restarts.held_doomed(s, version)]
            if again:
                self.held[g] = [x for x in self.held[g] if x not in again]
                self.regenerate(w, again)
        self.dispatch()

    def feed_sees(self, version: int, consumed: int) -> None:
        self.feed_version, self.feed_consumed = version, consumed
        self.feed()
        self.dispatch()

    # -- trainer ---------------------------------------------------------------------------------
    def close(self, g: int, samples: list[SimSample]) -> None:
        heapq.heappush(self.closed, (g, samples))
        self.train()

    def train(self) -> None:
        if self.trainer_busy or len(self.closed) < self.G:
            return
        cost, token_rule = 0.0, self.c.rule == "token"
        for _ in range(self.G):
            _, samples = heapq.heappop(self.closed)
            for s in samples:
                if is_stale(self.version, s.version_max if token_rule else s.version_min, self.c.k):
                    self.stale += 1
                    continue
                self.trained += 1
                self.trained_tokens += s.length
                cost += self.plan["train_token_cost_s"] * (self.sz["prompt_tokens"] + s.length)
        self.trainer_busy = True
        self.at(cost, self.step_end)

    def step_end(self) -> None:
        self.steps.append((self.t, self.trained))
        self.at(self.publish_s, self.publish)

    def publish(self) -> None:
        self.version += 1
        self.consumed += self.G
        for w in self.workers:
            self.at(self.notice_s, self.load, w, self.version, self.consumed)
        self.at(self.notice_s, self.feed_sees, self.version, self.consumed)
        self.trainer_busy = False
        self.train()

    def result(self) -> dict:
        """Steady-state figures, over the same window as the async bench (steps S/4 to S)."""
        skip = max(1, len(self.steps) // 4)
        (t0, n0), (t1, n1) = self.steps[skip - 1], self.steps[-1]
        rate = (n1 - n0) / (t1 - t0)
        slots = sum(w.slots for w in self.workers)
        return {
            "k": self.c.k,
            "rule": self.c.rule,
            "policy": self.c.policy,
            "hops": self.c.hops,
            "steps": len(self.steps),
            "samples_per_s": rnd(rate),
            "achieved_over_ideal": rnd(rate / self.plan["ideal_samples_per_s"]),
            "stale_dropped_fraction": rnd(self.stale / max(1, self.generated)),
            "regenerated_fraction": rnd(self.regenerated / max(1, self.generated)),
            "rollout_idle_fraction": rnd(1 - self.slot_s / (slots * self.t)),
            "restarted_fraction": rnd(self.restarted / max(1, self.generated)),
            "tokens_over_ideal": rnd(
                rate
                * self.trained_tokens
                / max(1, self.trained)
                / (self.plan["ideal_samples_per_s"] * self.plan["mean_response_tokens"])
            ),
            "aborted_fraction": rnd(self.aborted / max(1, self.generated + self.aborted)),
            "aborted_slot_fraction": rnd(self.aborted_s / max(1e-9, self.slot_s)),
            "trained_mean_tokens": rnd(self.trained_tokens / max(1, self.trained)),
            "mean_tokens": self.plan["mean_response_tokens"],
        }


def simulate(case: Case, workload: str = "long-tail") -> dict:
    """One model run of the async bench's full-size sim case (``k``, ``rule``) under ``case``."""
    from producers.config import RolloutConfig
    from producers.holding import StaleRestarts
    from rlstream.dev.bench.async_sync import PROMPT_TOKENS, SIZES, sim_engine, sim_plan

    sz = {**SIZES["full"]["sim"], "prompt_tokens": PROMPT_TOKENS}
    _, plan = sim_plan(sz, workload)
    eng = sim_engine(sz, workload)
    rc = RolloutConfig(reload_policy="interrupt", stale_restarts=1)  # as the async bench sets them
    model = Model(case, sz, plan, eng, StaleRestarts.of(rc, case.rule, case.k))
    return model.run()


VARIANTS = [
    ("rollout", "pull", "none", 0),
    ("rollout", "pull", "measured", 0),
    ("rollout", "paced", "measured", 0),
    ("clairvoyant", "pull", "measured", 0),
    ("first-n", "paced", "measured", 1),
    ("first-n", "paced", "measured", 2),
]
"""(policy, dispatch, hops, extra): the rules alone; plus the hops; plus the paced feed's placement
(the closest to the implementation); lengths known in advance; and the over-provisioned groups of
``rollout.overprovision`` (1 and 2 extra samples per group, first ``n`` kept)."""


def cases(size: str) -> list[Case]:
    sz = SIZES[size]
    rules = [(k, "sample") for k in sz["ks"]] + [(k, "token") for k in TOKEN_KS if k in sz["ks"]]
    return [
        Case(k, rule, pol, hops, sz["steps"], disp, extra) for k, rule in rules for pol, disp, hops, extra in VARIANTS
    ]


def run(ctx: BenchContext) -> dict:
    rows = []
    for case in cases(ctx.size):
        t = time.monotonic()
        row = {**simulate(case), "dispatch": case.dispatch, "extra": case.extra, "seconds": rnd(time.monotonic() - t)}
        rows.append(row)
        ctx.say(
            f"[bench] ceiling k={case.k} {case.rule} {case.policy} {case.dispatch} hops={case.hops}: "
            f"{row['achieved_over_ideal']} of ideal" + (f" (extra {case.extra})" if case.extra else "")
        )
    result = {"benchmark": "ceiling", "size": ctx.size, "hops": HOPS, "rows": rows}
    result["plots"] = [str(p) for p in plot(ctx.out, rows)]
    write_json(ctx.out / "ceiling.json", result)
    return result


def plot(out: Path, rows: list[dict]) -> list[Path]:
    """Bars of achieved/ideal per case (k, rule), one bar per variant."""
    if (plt := pyplot()) is None:
        return []
    labels = list(dict.fromkeys(f"k={r['k']} {r['rule']}" for r in rows))
    variants = list(dict.fromkeys(_variant(r) for r in rows))
    value = {(f"k={r['k']} {r['rule']}", _variant(r)): r["achieved_over_ideal"] for r in rows}
    fig, ax = plt.subplots(figsize=(1.3 * len(labels) + 3, 3.8))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [value.get((lab, v)) or 0 for lab in labels], width, label=v)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("achieved / ideal (model)")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("scheduling ceiling: the sim long tail under the pipeline's rules", fontsize=10)
    fig.tight_layout()
    path = out / "ceiling.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _variant(r: dict) -> str:
    extra = r.get("extra") or 0
    return " / ".join([r["policy"] + (f" +{extra}" if extra else ""), r["dispatch"], r["hops"]])


def table(result: dict) -> str:
    cols = ["k", "rule", "policy", "dispatch", "hops", "achieved/ideal", "stale dropped", "regenerated", "slots idle",
            "aborted", "trained tokens/ideal", "trained mean length"]  # fmt: skip
    body = [
        [r["k"], r["rule"], r["policy"] + (f" +{r['extra']}" if r.get("extra") else ""), r["dispatch"], r["hops"],
         r["achieved_over_ideal"], f"{r['stale_dropped_fraction']:.1%}", f"{r['regenerated_fraction']:.1%}",
         r["rollout_idle_fraction"], f"{r.get('aborted_fraction', 0):.1%}", r.get("tokens_over_ideal"),
         r.get("trained_mean_tokens")]
        for r in result["rows"]
    ]  # fmt: skip
    return md_table(cols, body)
