"""The routing replay in virtual time (issue #34, docs/performance.md), run by hand:

    .venv/bin/python bench/routing_sim.py [--sessions 64 --turns 6 --concurrency 32 --replicas 4]

The same sessions, engines and costs as ``bench/routing.py`` (prefix cache of 16-token
block hashes with LRU, one prefill at a time per engine for the uncached tokens, decodes
that overlap and slow past 8 at once, one engine 5x slower from half-way; decode times
vary by +-50 %, seeded), but as a
discrete-event simulation that feeds the gateway's own routers
(``gateway/upstream/routing.py``) directly, with a virtual clock: no sockets, no event
loop, so the makespans are the routing's alone, the same on a busy machine as on an idle
one. ``bench/routing.py`` runs the real gateway over HTTP for the hit rates end to end.
With the slowed replica, it also counts the calls sent there after it slowed, the sessions
that had two turns or more there, and the sessions *stuck* there (every turn after the
slowdown, two or more, on it). ``--slow-factor 0`` runs the router without its pace gate.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from routing import BLOCK_TOKENS, SYSTEM, Costs, blocks, prompt_tokens  # bench/routing.py

from gateway.upstream.routing import SLOW_FACTOR, CacheAwareRouter, RoundRobinRouter, prefix_chain


@dataclass
class View:
    """What one gateway's router sees of a replica: its id and the calls it sent there."""

    id: str
    in_flight: int = 0


@dataclass
class Replica:
    """One engine: its prefix cache, its prefill queue, its decodes."""

    id: str
    index: int
    capacity: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    prefill_free_at: float = 0.0
    decoding: int = 0
    served: int = 0

    def lookup(self, chain: list[int]) -> int:
        hit = 0
        for h in chain:
            if h not in self.cache:
                break
            hit += 1
        for h in reversed(chain):
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return hit


def answer_of(messages: list[dict[str, Any]]) -> str:
    """The same answer whatever replica (as the fake engine's), ~100 tokens."""
    return f"Ran the step; digest {zlib.crc32(repr(messages).encode()):08x}. " + "Output line. " * 30


def run(way: str, args: argparse.Namespace, slow: bool) -> dict[str, Any]:
    """``way``: a key of :data:`WAYS`. Returns hit rate, ideal, makespan, spread."""
    now = [0.0]
    replicas = [Replica(f"r{i}", i, args.cache_blocks) for i in range(args.replicas)]
    gateways = 2 if way.startswith("ca2") else 1  # several gateway replicas: each its own router and view
    routers: list[Any] = [
        CacheAwareRouter(lambda: now[0], args.imbalance_rel, args.imbalance_abs, slow_factor=args.slow_factor)
        if way.startswith("ca")
        else RoundRobinRouter(lambda: now[0]) for _ in range(gateways)]
    views = [[View(r.id) for r in replicas] for _ in range(gateways)]  # the calls each gateway has in flight
    calls_sent = itertools.count()
    costs = Costs()
    total = args.sessions * args.turns
    done = [0]
    ideal: set[int] = set()
    totals = {"prompt": 0, "cached": 0, "ideal": 0}
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    finished: list[dict[str, Any]] = []
    jitter = random.Random(7)  # answers vary in length (and lock-step sessions would make round-robin sticky)

    def at(time: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (time, next(order), kind, payload))

    def factor(replica: Replica) -> float:
        return 5.0 if slow and replica.index == 0 and done[0] >= total // 2 else 1.0

    def send(session: dict[str, Any]) -> None:
        messages = session["messages"]
        sid = session["id"]
        gateway = 0
        if way == "hash":
            replica = replicas[zlib.crc32(sid.encode()) % len(replicas)]
        else:
            named = sid if way.endswith("named") else None
            if gateways > 1:  # the load balancer: by session hash when named, else call by call
                gateway = zlib.crc32(sid.encode()) % gateways if named else next(calls_sent) % gateways
            chain = prefix_chain({"model": "bench", "messages": messages}) if way.startswith("ca") else ()
            replica = replicas[int(routers[gateway].route(views[gateway], named, chain).replica.id[1:])]
        views[gateway][replica.index].in_flight += 1
        if slow and done[0] >= total // 2:  # where each turn went once replica 0 slowed
            session["after"].append(replica.index)
        session["gateway"] = gateway
        chain_blocks = blocks(messages)
        tokens = prompt_tokens(messages)
        cached = min(tokens, replica.lookup(chain_blocks) * BLOCK_TOKENS)
        hit = 0
        for h in chain_blocks:
            if h not in ideal:
                break
            hit += 1
        ideal.update(chain_blocks)
        totals["prompt"] += tokens
        totals["cached"] += cached
        totals["ideal"] += min(tokens, hit * BLOCK_TOKENS)
        start = max(now[0], replica.prefill_free_at)
        prefill = (tokens - cached) * costs.prefill_us_per_token / 1e6 * factor(replica)
        replica.prefill_free_at = start + prefill
        at(start + prefill, "decode", (session, replica, now[0]))

    pending = [{"id": f"session-{n}", "n": n, "turn": 0, "after": [],
                "messages": [{"role": "system", "content": SYSTEM}]} for n in range(args.sessions)]
    pending.reverse()

    def next_turn(session: dict[str, Any]) -> None:
        n, turn = session["n"], session["turn"]
        session["messages"].append({"role": "user", "content": f"[{session['id']} turn {turn}] "
                                    + f"Look at file {n}-{turn}. " * 40})
        send(session)

    for _ in range(min(args.concurrency, len(pending))):
        next_turn(pending.pop())
    while events:
        time, _, kind, (session, replica, sent_at) = heapq.heappop(events)
        now[0] = time
        if kind == "decode":
            replica.decoding += 1
            length = costs.decode_ms / 1000 * factor(replica) * max(1.0, replica.decoding / costs.decode_batch) \
                * jitter.uniform(0.5, 1.5)
            at(time + length, "answer", (session, replica, sent_at))
            continue
        replica.decoding -= 1
        views[session["gateway"]][replica.index].in_flight -= 1
        replica.served += 1
        done[0] += 1
        routers[session["gateway"]].observe(replica.id, time - sent_at)
        session["messages"].append({"role": "assistant", "content": answer_of(session["messages"])})
        session["turn"] += 1
        if session["turn"] < args.turns:
            next_turn(session)
            continue
        finished.append(session)
        if pending:
            next_turn(pending.pop())
    slowed = [s["after"] for s in finished]
    return {"slow_calls": sum(a.count(0) for a in slowed),
            # stuck: two turns or more after the slowdown, every one of them on the slowed replica
            "stuck": sum(1 for a in slowed if len(a) >= 2 and set(a) == {0}),
            "twice": sum(1 for a in slowed if a.count(0) >= 2),
            "hit": totals["cached"] / totals["prompt"], "ideal": totals["ideal"] / totals["prompt"],
            "makespan": now[0], "spread": [r.served for r in replicas]}


WAYS = {
    "hash": "client sticky hash",
    "rr": "round-robin, unnamed",
    "rr-named": "round-robin, named (sticky)",
    "ca-named": "cache-aware, named",
    "ca": "cache-aware, unnamed",
    "ca2-named": "cache-aware, 2 gateways, named (sessions hashed to a gateway)",
    "ca2": "cache-aware, 2 gateways, unnamed (calls alternate)",
}


def main(args: argparse.Namespace) -> None:
    for slow in (False, True):
        print(f"\n{'one replica 5x slower from half-way' if slow else 'all replicas alike'} (virtual time): "
              f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} at once, {args.replicas} replicas,"
              f" {args.cache_blocks} blocks of {BLOCK_TOKENS} tokens; gate rel {args.imbalance_rel} abs {args.imbalance_abs}")
        results = {way: run(way, args, slow) for way in WAYS}
        ideal = results["rr"]["ideal"]
        base = results["rr"]["makespan"]
        stuck = " calls there after | sessions there twice+ | stuck there |" if slow else ""
        print(f"| way | hit rate | of ideal ({ideal:.1%}) | makespan s | vs round-robin | calls per replica |{stuck}")
        print("| --- | --- | --- | --- | --- | --- |" + " --- | --- | --- |" * slow)
        for way, r in results.items():
            print(f"| {WAYS[way]} | {r['hit']:.1%} | {r['hit'] / r['ideal']:.0%} | {r['makespan']:.2f} |"
                  f" {r['makespan'] / base:.2f}x | {' / '.join(map(str, r['spread']))} |"
                  + (f" {r['slow_calls']} | {r['twice']} | {r['stuck']} |" if slow else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--cache-blocks", type=int, default=2048)
    parser.add_argument("--imbalance-rel", type=float, default=1.5)
    parser.add_argument("--imbalance-abs", type=int, default=8)
    parser.add_argument("--slow-factor", type=float, default=SLOW_FACTOR, help="0: the router before it (pace weighs load only)")
    main(parser.parse_args())
