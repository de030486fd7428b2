"""Agent commands: `tasks check|feature-deletion|bug-injection|list|demos` and `eval run|compare`."""

from __future__ import annotations

import json
import os
import sys

from composer_jax.cli.common import command_error, command_group, non_negative_int, positive_int, subcommand
from composer_jax.sandbox.pool import MOST_WORKERS, default_workers


# tasks check


def _run_tasks_check(args) -> int:
    import time

    from composer_jax.sandbox import SandboxError, SandboxUnavailable, make_sandbox
    from composer_jax.tasks import TaskError, check_tasks, load_task, summary_line

    start = time.monotonic()
    try:
        tasks = [load_task(d) for d in args.task_dirs]
        results = check_tasks(tasks, make_sandbox(args.backend), solution=args.solution, workers=args.workers)
    except (TaskError, SandboxError, SandboxUnavailable) as e:
        return command_error("tasks check", e)
    lines = [json.dumps(r.to_json()) for r in results]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
    else:
        print("\n".join(lines))
    print(summary_line(results, time.monotonic() - start))
    return 0


def _generation_settings(args) -> dict:
    return {"max_tasks": args.max_tasks, "workers": args.workers, "seed": args.seed, "test_command": args.test_command,
            "timeout_s": args.timeout, "backend": args.backend, "held_out": args.held_out}


def _generate(args, name: str, generate, summary) -> int:
    """Run a task generator, `generate(log)` (its config built inside: a bad setting is a one-line error),
    with progress on stderr."""
    from composer_jax.sandbox import SandboxError, SandboxUnavailable
    from composer_jax.tasks import FeatureDeletionError

    try:
        report = generate(lambda line: print(line, file=sys.stderr))
    except (FeatureDeletionError, SandboxError, SandboxUnavailable) as e:
        return command_error(f"tasks {name}", e)
    print(summary(report))
    print(f"report: {os.path.join(args.out_dir, 'report.json')}")
    return 0


def _run_feature_deletion(args) -> int:
    from composer_jax.tasks.feature_deletion import FeatureDeletionConfig, generate_tasks, summary

    return _generate(args, "feature-deletion", lambda log: generate_tasks(
        args.repo_dir, args.out_dir,
        FeatureDeletionConfig(**_generation_settings(args), min_lines=args.min_lines, level=args.level), log=log),
        summary)


def _run_bug_injection(args) -> int:
    from composer_jax.tasks.bug_injection import BugInjectionConfig, generate_bug_tasks, summary
    from composer_jax.tasks.format import MUTATIONS

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) if args.kinds else MUTATIONS
    return _generate(args, "bug-injection", lambda log: generate_bug_tasks(
        args.repo_dir, args.out_dir, BugInjectionConfig(**_generation_settings(args), kinds=kinds), log=log), summary)


def _run_tasks_list(args) -> int:
    from composer_jax.tasks import TaskError
    from composer_jax.tasks.listing import find_tasks, task_table

    try:
        print(task_table(find_tasks(args.out_dir)))
    except TaskError as e:
        return command_error("tasks list", e)
    return 0


def _run_tasks_demos(args) -> int:
    from composer_jax.envs.demos import DemoConfig, DemoError, summary_line, write_demos, write_toy_demos
    from composer_jax.envs.tools import TOOL_NAMES
    from composer_jax.sandbox import SandboxError, SandboxUnavailable
    from composer_jax.tasks import TaskError

    try:
        config = DemoConfig(tools=tuple(args.tools.split(",")) if args.tools is not None else TOOL_NAMES,
                            format=args.format, max_output_chars=args.max_output_chars,
                            hinted_share=args.hinted_share, seed=args.seed, workers=args.workers, backend=args.backend)
        if args.tasks_dir.startswith("toy:"):
            summary = write_toy_demos(args.tasks_dir, args.out, config, count=args.count, length=args.length,
                                      use_tool=args.use_tool, wrong_tool_share=args.wrong_tool_share)
        else:
            summary = write_demos(args.tasks_dir, args.out, config, log=lambda line: print(line, file=sys.stderr))
    except (DemoError, TaskError, SandboxError, SandboxUnavailable) as e:
        return command_error("tasks demos", e)
    print(summary_line(summary))
    print(f"conversations: {summary.path}")
    return 0


def _sandbox_arguments(p, what: str) -> None:
    """--workers and --backend of a command that runs sandboxes (`what`: what runs `--workers` at once)."""
    p.add_argument("--workers", type=positive_int, default=default_workers(),
                   help=f"{what} at once (default: one per core, at most {MOST_WORKERS})")
    p.add_argument("--backend", choices=("bwrap", "none"), default="bwrap",
                   help="sandbox backend; 'none' runs the tests UNSANDBOXED on this machine (default bwrap)")


def _generation_arguments(p) -> None:
    """The arguments every task generator takes."""
    p.add_argument("repo_dir", metavar="REPO_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty directory")
    p.add_argument("--max-tasks", type=positive_int, default=20, help="stop after keeping this many (default 20)")
    p.add_argument("--seed", type=int, default=0, help="order in which candidates are tried (default 0)")
    p.add_argument("--test-command", default=None,
                   help="pytest command run from the repository root (default: python -m pytest -q without plugin "
                        "autoload, PYTHONPATH=src for a src/ layout)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole test suite may take (default 600)")
    p.add_argument("--held-out", type=non_negative_int, default=0, metavar="N",
                   help="move the last N tasks (by id) to OUT_DIR/held-out/ for evaluation: training on OUT_DIR "
                        "(demos, RL) never sees them (default 0)")
    _sandbox_arguments(p, "candidates checked")


def _add_tasks(sub) -> None:
    tasks_sub = command_group(sub, "tasks", "coding tasks: generate, list and check (reward from sandboxed tests)")
    c = subcommand(tasks_sub, "check", _run_tasks_check, "run each task's tests in the sandbox and report its reward",
                   "Validate TASK_DIRs, run their test commands in the sandbox on copies of "
                   "repo/ and print one JSON object per task (task, reward, passed, failed, "
                   "status, seconds) and a summary line. Task directories are never modified.")
    c.add_argument("task_dirs", nargs="+", metavar="TASK_DIR")
    c.add_argument("--solution", action="store_true", help="apply solution.patch to the copy first")
    c.add_argument("--json", default=None, metavar="OUT", help="write the JSON lines to OUT instead of stdout")
    c.add_argument("--workers", type=positive_int, default=default_workers(),
                   help=f"tasks checked at once (default: one per core, at most {MOST_WORKERS})")
    c.add_argument("--backend", choices=("bwrap", "none", "ray"), default="bwrap",
                   help="sandbox backend; 'none' runs the tests UNSANDBOXED on this machine; 'ray' runs them in "
                        "bwrap on the Ray cluster at RAY_ADDRESS (pip install 'composer-jax[ray]') (default bwrap)")
    f = subcommand(tasks_sub, "feature-deletion", _run_feature_deletion,
                   "make tasks from a repository by deleting tested features",
                   "Run REPO_DIR's pytest suite in the sandbox with tracing, delete one "
                   "function, method or class per task (the module still imports), keep the "
                   "task if the tests that ran it now fail, the others still pass and "
                   "solution.patch restores them; write OUT_DIR/<id>/{repo/, task.json, "
                   "solution.patch} and OUT_DIR/report.json. REPO_DIR is only read.")
    _generation_arguments(f)
    f.add_argument("--min-lines", type=positive_int, default=3,
                   help="lines of code a deletion must remove, at least (default 3)")
    f.add_argument("--level", default="body",
                   help="what a task deletes: 'body' (the body of one definition; signature and docstring stay), "
                        "'definition' (the whole definition) or 'feature' (every definition that only its tests "
                        "run, across modules, and the modules left empty) (default body)")
    b = subcommand(tasks_sub, "bug-injection", _run_bug_injection,
                   "make tasks from a repository by injecting bugs into tested code",
                   "Run REPO_DIR's pytest suite in the sandbox with tracing, make one small "
                   "semantic mutation per task inside a function that specific tests run (an "
                   "operator, a bound, swapped arguments, a dropped condition or early return, a "
                   "constant), keep the task if the tests that ran it now fail, the others still "
                   "pass and solution.patch restores them; write OUT_DIR/<id>/{repo/, task.json, "
                   "solution.patch} and OUT_DIR/report.json. REPO_DIR is only read.")
    _generation_arguments(b)
    b.add_argument("--kinds", default=None, metavar="a,b,c",
                   help="mutation kinds, comma-separated: comparison, arithmetic, off_by_one, swapped_arguments, "
                        "dropped_condition, dropped_return, wrong_constant (default: all)")
    t = subcommand(tasks_sub, "list", _run_tasks_list, "table of the tasks in a directory",
                   "Print id, target tests, deleted lines and pass rate of every task "
                   "directory under OUT_DIR.")
    t.add_argument("out_dir", metavar="OUT_DIR")
    _add_tasks_gym(tasks_sub)
    _add_tasks_demos(tasks_sub)


def _run_tasks_gym(args) -> int:
    from composer_jax.tasks.gym import GymConfig, make_gym, summary

    return _generate(args, "gym", lambda log: make_gym(args.out_dir, GymConfig(
        tasks=args.tasks, held_out=args.held_out, seed=args.seed, workers=args.workers, backend=args.backend),
        log=log), summary)


def _add_tasks_gym(tasks_sub) -> None:
    g = subcommand(tasks_sub, "gym", _run_tasks_gym, "make a coding gym: many small checked tasks",
                   "Generate small Python repositories (a module of 3-5 functions from the gym's "
                   "templates, with pytest tests) and make tasks from each with feature deletion "
                   "(body level) and bug injection, until OUT_DIR holds --tasks training tasks "
                   "and OUT_DIR/held-out --held-out tasks. Held-out tasks come from templates no "
                   "training repository contains. Every task is checked as the generators check "
                   "theirs; OUT_DIR/report.json lists the repositories and templates.")
    g.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty directory")
    g.add_argument("--tasks", type=positive_int, default=1000, help="training tasks, at least (default 1000)")
    g.add_argument("--held-out", type=non_negative_int, default=64, metavar="N",
                   help="held-out tasks in OUT_DIR/held-out, at least (default 64)")
    g.add_argument("--seed", type=int, default=0, help="the repositories drawn (default 0)")
    _sandbox_arguments(g, "repositories made")


def _add_tasks_demos(tasks_sub) -> None:
    d = subcommand(tasks_sub, "demos", _run_tasks_demos, "write agent trajectories solving tasks (SFT data)",
                   "For every task of TASKS_DIR (a directory of task directories, or one) that "
                   "has a solution.patch, play a scripted agent in the coding environment: run "
                   "the tests, read the files the solution changes, apply it with edit calls, run "
                   "the tests again, submit. Write one OpenAI-style chat conversation per task "
                   "whose episode earns reward 1 (real tool outputs) to OUT.jsonl; a share of them "
                   "show a flagged mistake's hint before one turn (kind 'hinted').")
    d.add_argument("tasks_dir", metavar="TASKS_DIR", help="a directory of coding tasks (or one task), or toy:FAMILY "
                                                          "(toy tasks: toy:add, toy:copy, toy:reverse)")
    d.add_argument("out", metavar="OUT.jsonl", help="the JSON lines file to write (its directory is made)")
    d.add_argument("--count", type=positive_int, default=256, help="toy: tasks drawn (default 256)")
    d.add_argument("--length", type=positive_int, default=3, help="toy: letters per word (default 3)")
    d.add_argument("--use-tool", action="store_true", help="toy: answer through a submit tool call")
    d.add_argument("--wrong-tool-share", type=float, default=0.0, metavar="S",
                   help="toy with --use-tool: share of the conversations that first call a tool that does not exist, "
                        "then recover (default 0)")
    d.add_argument("--tools", default=None, metavar="a,b,c",
                   help="declared tools, comma-separated; must include submit and edit or write_file (default: all)")
    d.add_argument("--format", choices=("plain", "kimi"), default="plain", help="tool-call format (default plain)")
    d.add_argument("--max-output-chars", type=positive_int, default=4000,
                   help="tool output cut after this many characters (default 4000)")
    d.add_argument("--hinted-share", type=float, default=0.25, metavar="S",
                   help="share of the conversations that are hinted (default 0.25)")
    d.add_argument("--seed", type=int, default=0, help="which conversations are hinted, and where (default 0)")
    _sandbox_arguments(d, "tasks played")


# eval / eval compare


def _run_eval(args) -> int:
    from composer_jax.agents import AgentError, load_agent, load_task_set
    from composer_jax.eval import EvalConfig, EvalError, evaluate, summary_table
    from composer_jax.sandbox import SandboxError, SandboxUnavailable, make_sandbox
    from composer_jax.tasks import TaskError

    out = args.out or f"eval-{_slug(args.model)}-{_slug(args.tasks_dir)}"
    try:
        tasks = load_task_set(args.tasks_dir)
        agent = load_agent(args.model, temperature=args.temperature, overrides=args.overrides,
                           episodes_at_once=args.workers)
        try:
            trained = getattr(agent, "trained_with", {})    # the run's own agent settings are the defaults
            config = EvalConfig(samples=args.samples, max_turns=args.max_turns or trained.get("max_turns") or 30,
                                tools=tuple(args.tools.split(",")) if args.tools else tuple(trained.get("tools") or ()),
                                max_output_chars=args.max_output_chars or trained.get("max_output_chars") or 0,
                                workers=args.workers, seed=args.seed, record_file_access=args.record_file_access)
            summary = evaluate(agent, tasks, out, config, sandbox=make_sandbox(args.backend),
                               log=None if args.quiet else lambda line: print(line, file=sys.stderr))
        finally:
            if hasattr(agent, "close"):   # an engine-backed agent's driver thread
                agent.close()
    except (AgentError, EvalError, TaskError, SandboxError, SandboxUnavailable) as e:
        return command_error("eval", e)
    print(summary_table(summary))
    print(f"run directory: {out} (attempts.jsonl, summary.json, transcripts/)")
    return 0


def _slug(path: str) -> str:
    """A directory-name-safe label of a MODEL or TASKS_DIR argument."""
    name = os.path.basename(os.path.normpath(path.split(":", 1)[-1])) or "run"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _run_eval_compare(args) -> int:
    from composer_jax.eval import EvalError, compare_runs, comparison_plot, comparison_table

    try:
        comparison = compare_runs(args.run_a, args.run_b)
    except EvalError as e:
        return command_error("eval compare", e)
    print(comparison_table(comparison))
    png = args.png or os.path.join(args.run_b, f"compare_{_slug(args.run_a)}.png")
    print(f"plot: {comparison_plot(comparison, png)}")
    return 0


def _add_eval(sub) -> None:
    eval_sub = command_group(sub, "eval", "run an agent on a task set (pass@k, efficiency, lint); compare two runs",
                              default="run")
    r = subcommand(eval_sub, "run", _run_eval, "run an agent K times per task and score it (the default: `composer-jax "
                   "eval MODEL TASKS_DIR`)",
                   "Run the agent MODEL K times on every task of TASKS_DIR in the coding "
                   "environment (commands in the sandbox), writing OUT/attempts.jsonl (one line "
                   "per attempt), OUT/transcripts/ and OUT/summary.json: pass@k (unbiased), "
                   "mean reward, tokens and turns per solved attempt, tool-error rate and lint "
                   "findings added, with bootstrap confidence intervals over tasks. Resumable: "
                   "the same command again skips the attempts already recorded.")
    r.add_argument("model", metavar="MODEL", help="the agent: a Hugging Face directory or model id (org/name), a "
                                                  "converted directory or a training run, sampled by the inference "
                                                  "engine; or scripted:PATH (a JSON file of per-task tool-call "
                                                  "scripts)")
    r.add_argument("tasks_dir", metavar="TASKS_DIR", help="a directory of task directories (or one task directory)")
    r.add_argument("overrides", nargs="*", metavar="key=value",
                   help="engine agent settings: temperature, top_p, top_k, max_new_tokens (per turn), max_len "
                        "(context per episode), max_slots (episodes decoding at once), steps_per_call, format "
                        "(plain or kimi); model.KEY=VALUE overrides the model config")
    r.add_argument("--samples", type=int, default=1, metavar="K", help="attempts per task (default 1)")
    r.add_argument("--max-turns", type=int, default=None, metavar="T",
                   help="assistant turns per attempt (default: the model's recorded agent settings, else 30)")
    r.add_argument("--tools", default=None, metavar="a,b,c",
                   help="tools declared to the agent (default: those the model was trained with, else all)")
    r.add_argument("--max-output-chars", type=positive_int, default=None, metavar="N",
                   help="a tool result is cut to N characters (default: the model's recorded setting, else 4000)")
    r.add_argument("--temperature", type=float, default=None, metavar="X",
                   help="sampling temperature (default: the agent's)")
    r.add_argument("--workers", type=int, default=1, metavar="N", help="attempts at once (default 1)")
    r.add_argument("--seed", type=int, default=0, help="attempt seeds derive from it (default 0)")
    r.add_argument("--out", default=None, metavar="DIR", help="run directory (default: eval-MODEL-TASKS in the "
                                                              "current directory)")
    r.add_argument("--backend", choices=("bwrap", "none", "ray"), default="bwrap",
                   help="sandbox backend; 'none' runs the agent's commands UNSANDBOXED; 'ray' runs them in bwrap "
                        "on the Ray cluster at RAY_ADDRESS (default bwrap)")
    r.add_argument("--record-file-access", action="store_true",
                   help="record the files the agent's commands open (strace) and put the reward-hacking monitor's "
                        "report in each transcript")
    r.add_argument("--quiet", action="store_true", help="no line per finished attempt on stderr")
    c = subcommand(eval_sub, "compare", _run_eval_compare,
                   "paired difference of two runs per score, flipped tasks, a PNG",
                   "Compare two evaluation run directories on the tasks both ran: per score, "
                   "B - A with a paired bootstrap 95% interval over tasks, and the tasks solved "
                   "by only one of them; prints a table and writes a PNG.")
    c.add_argument("run_a", metavar="RUN_A")
    c.add_argument("run_b", metavar="RUN_B")
    c.add_argument("--png", default=None, help="where to write the plot (default: RUN_B/compare_<RUN_A name>.png)")


