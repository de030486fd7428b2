"""The oracle-hint check of self-distillation's direction, arm by arm (tests/test_rl_oracle.py has the setup
and checks the default arm): a tiny model that answers the toy add tasks right after the hint "Answer: N"
and wrong without it, then RL steps with self-distillation alone. Prints, per arm, the mean log-probability
of the correct turn without the hint (the student) and with it (what the teacher knows) at every fifth
step, and writes every step to JSON.

    python tools/experiment_oracle.py OUT.json                      # the arms of docs/rl-experiments.md
    python tools/experiment_oracle.py OUT.json --arm forward_kl,live,5e-5 --arm reverse_kl,live,5e-5
    python tools/experiment_oracle.py OUT.json --arm forward_kl,live,5e-5,flipped
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ARMS = ("forward_kl,live,5e-5", "forward_kl,live,5e-5,flipped", "reverse_kl,live,5e-5",
                "forward_kl,initial,1e-4", "reverse_kl,initial,1e-4", "reverse_kl,live,1e-3", "forward_kl,live,3e-4")


def parse_arm(text: str) -> dict:
    """'DIVERGENCE,TEACHER,LR[,flipped]' -> the arm's settings (SystemExit naming the culprit)."""
    parts = text.split(",")
    divergences, teachers = ("reverse_kl", "forward_kl", "jsd", "sampled_token"), ("live", "initial")
    if len(parts) not in (3, 4) or parts[0] not in divergences or parts[1] not in teachers or \
            parts[3:] not in ([], ["flipped"]):
        raise SystemExit(f"--arm {text!r}: expected DIVERGENCE,TEACHER,LR[,flipped] with DIVERGENCE one of "
                         f"{', '.join(divergences)} and TEACHER live or initial")
    try:
        lr = float(parts[2])
    except ValueError:
        raise SystemExit(f"--arm {text!r}: the learning rate {parts[2]!r} is not a number") from None
    return {"divergence": parts[0], "teacher": parts[1], "lr": lr, "flipped": len(parts) == 4}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON file for the per-step series")
    parser.add_argument("--arm", action="append", help="DIVERGENCE,TEACHER,LR[,flipped] (repeatable)")
    args = parser.parse_args(argv)
    arms = [parse_arm(a) for a in (args.arm or DEFAULT_ARMS)]

    sys.path.insert(0, str(REPO))
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(1)
    from composer_jax.rl import losses
    from tests.test_rl_oracle import STEPS, TASKS, copy_model, distil, first_token_wrong, train_hint_reader

    print("training the hint reader (150 steps) ...", file=sys.stderr)
    reader = train_hint_reader()
    results, sd_loss = [], losses.self_distillation_loss
    for arm in arms:
        print(f"arm {arm} ...", file=sys.stderr)
        losses.self_distillation_loss = (lambda *a, **k: -sd_loss(*a, **k)) if arm["flipped"] else sd_loss
        teacher = {"sd_teacher": arm["teacher"], "teacher_context": "full" if arm["teacher"] == "initial" else "prefix"}
        unhinted, hinted = distil(copy_model(reader), lr=arm["lr"], sd_divergence=arm["divergence"], **teacher)
        results.append({**arm, "unhinted": unhinted.mean(-1).tolist(), "hinted": hinted.mean(-1).tolist(),
                        "unhinted_per_task": unhinted.tolist(), "hinted_per_task": hinted.tolist()})
    losses.self_distillation_loss = sd_loss
    args.out.write_text(json.dumps({"steps": STEPS, "arms": results}, indent=1))

    shown = list(range(0, STEPS + 1, 5))
    wrong_first = first_token_wrong(reader)
    print(f"tasks whose first answer token the student gets wrong: {[t.answer for t, w in zip(TASKS, wrong_first) if w]}"
          f" (of {[t.answer for t in TASKS]})")
    print("| divergence, teacher, lr | " + " | ".join(f"step {i}" for i in shown) +
          " | rises every step | those tasks at the end | hinted at end |")
    print("| --- " * (len(shown) + 4) + "|")
    for r in results:
        name = f"{r['divergence']}, {r['teacher']}, {r['lr']:g}" + (", sign flipped" if r["flipped"] else "")
        steps = [b - a for a, b in zip(r["unhinted"], r["unhinted"][1:])]
        monotone = "yes" if all(d > 0 for d in steps) else "falls every step" if all(d < 0 for d in steps) else "no"
        start, end = (sum(v for v, w in zip(r["unhinted_per_task"][i], wrong_first) if w) / max(sum(wrong_first), 1)
                      for i in (0, -1))
        print(f"| {name} | " + " | ".join(f"{r['unhinted'][i]:.2f}" for i in shown) +
              f" | {monotone} | {start:.2f} -> {end:.2f} | {r['hinted'][-1]:.2f} |")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
