"""Where an RL run's time goes: every learner step, learner wait, producer batch, producer wait for
weights, weight install and engine call timed, as shares of the wall time after the first (compiling)
step, and the engine calls of a few batches in order (when each started, how long it took, the slots
prefilling and decoding, the requests queued).

    python tools/rl_timeline.py OUT.json [rl overrides...]     # e.g. rollout.devices=0 rl.steps=30

It runs `composer-jax rl` (the bundled rl-tiny and the overrides) with those methods wrapped; OUT.json
holds every timed interval."""

import json
import sys
import threading
import time
from collections import defaultdict

from composer_jax.cpu_devices import use_cpu_devices
from composer_jax.rl.run_config import load_rl_config

TIMED = {"learner_train": ("composer_jax.rl.loop", "RLTrainer", "_train"),
         "learner_wait": ("composer_jax.rl.engines", "Rollouts", "next_batch"),
         "produce": ("composer_jax.rl.rollout", "RolloutProducer", "produce"),
         "producer_wait": ("composer_jax.rl.rollout", "RolloutProducer", "_wait_published"),
         "update_weights": ("composer_jax.agents.engine_agent", "EngineAgent", "update_weights"),
         "engine_step": ("composer_jax.infer.engine", "Engine", "step")}


def slots(engine) -> dict:
    phases = [s.phase for s in engine.slots if s is not None]
    return {"prefill": phases.count("prefill"), "decode": phases.count("decode"), "queued": len(engine.queue)}


def timed(events: list, kind: str, method, note=None):
    def wrapper(self, *args, **kwargs):
        began, before = time.time(), note(self) if note else None
        try:
            return method(self, *args, **kwargs)
        finally:
            events.append((kind, began, time.time(), before, threading.current_thread().name))
    return wrapper


def report(events: list) -> None:
    by = defaultdict(list)
    for kind, a, b, note, _ in events:
        by[kind].append((a, b, note))
    steps = sorted(by["learner_train"])
    origin, end = steps[0][1], steps[-1][1]
    wall = end - origin
    print(f"{len(steps) - 1} steps after the first: {wall / (len(steps) - 1):.3f} s a step")
    for kind in TIMED:
        spans = [(max(a, origin), min(b, end)) for a, b, _ in by[kind] if b > origin and a < end]
        total = sum(b - a for a, b in spans)
        print(f"{kind:15s} {len(spans):5d} calls {total:8.2f} s {total / wall:6.1%} of the wall time")
    batches = [(a, b) for a, b, _ in by["produce"] if a > origin][:3]
    for a, b in batches:
        calls = [(x - a, y - x, n) for x, y, n in by["engine_step"] if a <= x <= b]
        print(f"batch of {b - a:.3f} s, engine calls (start, seconds, slots):",
              [(round(x, 3), round(d, 3), n) for x, d, n in calls])


def main(out: str, overrides: list[str]) -> None:
    cfg = load_rl_config("rl-tiny", overrides)
    use_cpu_devices(cfg.host_cpu_devices)
    import importlib

    events: list = []
    for kind, (module, cls, name) in TIMED.items():
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, name, timed(events, kind, getattr(owner, name), slots if kind == "engine_step" else None))
    from composer_jax.rl.loop import RLTrainer

    print(RLTrainer(cfg).run())
    with open(out, "w") as f:
        json.dump(events, f)
    report(events)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
