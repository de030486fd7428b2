"""The direction of targeted self-distillation, checked with an oracle hint (issue 30, deliverable 4).

A tiny model first learns two behaviours: with a hint "Answer: 7" inserted before its turn (as the
teacher sees it) it answers 7; without the hint it answers a wrong number, confidently. Then RL steps
with the self-distillation term alone (every reward 0, so every advantage and the policy gradient are
0): each step the student samples its turns on the toy add tasks, the wrong ones are flagged with the
oracle hint, and the fused RL step distils the hinted teacher into the unhinted student. The student's
log-probability of the correct turn, without the hint, must rise at every step; with the loss's sign
flipped it must fall at every step.

What this found (the numbers are in docs/rl-experiments.md): with the former default divergence, reverse KL, the
tasks whose first answer token differs from the student's never moved (a confident student gives the
hinted token ~e^-9 of its mass, and the reverse-KL gradient s * (log s - log t - KL) vanishes with it);
with the live teacher at a larger learning rate the hinted behaviour itself eroded until student and
teacher agreed on neither. Forward KL (the default now) raises them all.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composer_jax import CausalLM, config, load_config
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.envs import TokenEpisode, ToyEnv, get_format, rollout_fields, toy_tasks
from composer_jax.rl import RLConfig, RLStep, losses
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.config import rl_optimizer
from composer_jax.rl.teacher import feedback_rows, teacher_predictions

TOKENIZER, FMT = ByteTokenizer(), get_format("plain")
TASKS = toy_tasks("add", 8, seed=0)
GROUP, STEPS, CONTEXT = 2, 20, 144


def _oracle(task) -> str:
    return f"Answer: {task.answer}"


def _wrong(task) -> str:
    return str((int(task.answer) + 5) % 19)


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).tolist()


def _prompt(task) -> list[int]:
    return _ids(FMT.message("user", task.prompt) + FMT.generation_prompt())


def _rows(contexts, answers):
    """Rows [context + answer] and the mask of the answer tokens (what a row's log-probability sums)."""
    tokens, mask = np.zeros((len(contexts), CONTEXT), np.int32), np.zeros((len(contexts), CONTEXT), np.float32)
    for i, (context, answer) in enumerate(zip(contexts, answers)):
        row = context + _ids(answer + FMT.end_of_turn)
        tokens[i, :len(row)], mask[i, len(context):len(row)] = row, 1.0
    return jnp.asarray(tokens), jnp.asarray(mask)


HINTED = [_prompt(t) + _ids(FMT.hint_insert(_oracle(t))) for t in TASKS]
CORRECT_HINTED = _rows(HINTED, [t.answer for t in TASKS])
CORRECT_UNHINTED = _rows([_prompt(t) for t in TASKS], [t.answer for t in TASKS])
WRONG_UNHINTED = _rows([_prompt(t) for t in TASKS], [_wrong(t) for t in TASKS])


@nnx.jit
def _answer_logprobs(model, tokens, mask):
    """f32[rows]: log pi(answer | context) of each row."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden = model.forward(tokens, jnp.ones_like(tokens), positions, with_mtp=False).hidden
    logp = losses.token_logprobs(model.logits(hidden[:, :-1]), tokens[:, 1:])
    return (logp * mask[:, 1:]).sum(-1)


def train_hint_reader() -> CausalLM:
    """A tiny model that answers right after the oracle hint and wrong without it (150 Adam steps)."""
    cfg = config.replace(load_config("tiny"), **{
        "num_layers": 2, "moe.n_routed_experts": 4, "moe.num_experts_per_tok": 2, "moe.n_group": 1,
        "moe.topk_group": 1, "moe.dispatch": "dense", "mtp.num_layers": 0, "rope.factor": 1,
        "rope.original_max_position_embeddings": 256, "rope.max_position_embeddings": 256})
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.concatenate([CORRECT_HINTED[0], WRONG_UNHINTED[0]])
    mask = jnp.concatenate([CORRECT_HINTED[1], WRONG_UNHINTED[1]])
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)))

    # Optimised (the suite compiles at -O0, tests/conftest.py): the 150 steps' run time dominates.
    @functools.partial(jax.jit, donate_argnums=0, compiler_options={"xla_backend_optimization_level": 2})
    def train(state):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: -_answer_logprobs(m, tokens, mask).sum() / mask.sum())(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    for _ in range(150):
        state = train(state)
    return nnx.merge(graphdef, state)[0]


@pytest.fixture(scope="module")
def hint_reader():
    model = train_hint_reader()
    hinted, unhinted = (float(_answer_logprobs(model, *rows).mean()) for rows in (CORRECT_HINTED, CORRECT_UNHINTED))
    assert hinted > -1.0 and unhinted < -4.0, (hinted, unhinted)
    return model


def first_token_wrong(model: CausalLM) -> list[bool]:
    """Per task: whether the model's most likely first answer token without the hint is not the correct one."""
    prompts = [_prompt(t) for t in TASKS]
    tokens = np.zeros((len(prompts), 80), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    best = np.argmax(np.asarray(_next_logits(model, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts]))), -1)
    return [int(b) != _ids(t.answer)[0] for b, t in zip(best, TASKS)]


def copy_model(model: CausalLM) -> CausalLM:
    """A model with the same weights in buffers of its own (the RL step donates them)."""
    fresh = CausalLM(model.cfg, rngs=nnx.Rngs(1))
    nnx.update(fresh, jax.tree.map(jnp.copy, nnx.state(model)))
    return fresh


@nnx.jit
def _next_logits(model, tokens, lengths):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden = model.forward(tokens, jnp.ones_like(tokens), positions, with_mtp=False).hidden
    return model.logits(jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0])


def _sample_turns(model, key, max_new=12) -> list[list[int]]:
    """GROUP turns per task sampled at temperature 1, each up to the end-of-turn marker."""
    prompts = [_prompt(t) for t in TASKS for _ in range(GROUP)]
    tokens, lengths = np.zeros((len(prompts), 80), np.int32), np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    end, turns = _ids(FMT.end_of_turn), [[] for _ in prompts]
    for key in jax.random.split(key, max_new):
        ids = np.asarray(jax.random.categorical(key, _next_logits(model, jnp.asarray(tokens), jnp.asarray(lengths))))
        for i, turn in enumerate(turns):
            if turn[-len(end):] != end:
                turn.append(int(ids[i]))
                tokens[i, lengths[i]] = ids[i]
                lengths[i] += 1
    return turns


def _flagged_batch(turns) -> RolloutBatch:
    """The sampled turns as RL rows; a wrong turn carries the oracle hint (a teacher slot); rewards 0."""
    episodes = []
    for row, turn in enumerate(turns):
        task = TASKS[row // GROUP]
        episode = TokenEpisode(ToyEnv(FMT), TOKENIZER)
        episode.start(task)
        episode.step(np.asarray(turn), np.zeros(len(turn)))
        hint = _oracle(task) if episode.info["task_reward"] < 1 else ""
        episode.turns = [dataclasses.replace(t, hint=hint) for t in episode.turns]
        episodes.append(episode)
    fields = rollout_fields(episodes, [row // GROUP for row in range(len(turns))], seq_len=96, slots=1, window=112)
    fields["rewards"][:] = 0.0                    # no policy gradient: self-distillation alone
    return RolloutBatch(**fields)


def distil(model: CausalLM, lr: float = 5e-5, **rl) -> tuple[np.ndarray, np.ndarray]:
    """STEPS RL steps of self-distillation alone (RLConfig keys `rl`); the log-probability of the correct
    turn of each task without the hint, and with it, before each step and after the last: f32[STEPS + 1,
    tasks] each."""
    step = RLStep(model, RLConfig(group_size=GROUP, mtp_distill_weight=0.0, steps=STEPS,
                                  optimizer=dataclasses.replace(rl_optimizer(), lr=lr), **rl))
    state, key = step.init_state(model), jax.random.key(0)
    unhinted, hinted = [], []
    for i in range(STEPS + 1):
        policy = nnx.merge(step.graphdef, state.params, state.biases, step.rest)
        unhinted.append(np.asarray(_answer_logprobs(policy, *CORRECT_UNHINTED)))
        hinted.append(np.asarray(_answer_logprobs(policy, *CORRECT_HINTED)))
        if i < STEPS:
            key, sub = jax.random.split(key)
            state, metrics = step(state, _flagged_batch(_sample_turns(policy, sub)))
            assert float(metrics["sd_tokens"]) > 0
    return np.stack(unhinted), np.stack(hinted)


@pytest.mark.slow   # ~37 s: the first user of the module's `hint_reader` trains it
def test_the_teacher_sees_the_hint_before_the_students_turn(hint_reader):
    """The prefix teacher's prediction of a flagged turn's first token is the model's own prediction
    after [prompt + hint insert]: the hint sits where the student's turn begins, and slot j of the
    window is predicted from slot j - 1."""
    batch = _flagged_batch([_ids(_wrong(t) + FMT.end_of_turn) for t in TASKS for _ in range(GROUP)])
    batch = jax.tree.map(jnp.asarray, batch)

    @nnx.jit
    def first_token_logprobs(model, batch):
        out = model.forward(batch.tokens, batch.segment_ids, batch.positions, with_mtp=False, return_latents=True)
        fb = feedback_rows(batch)
        teacher = jax.nn.log_softmax(model.logits(teacher_predictions(model, out.hidden, out.latents, fb, batch,
                                                                      "prefix")))
        first = jnp.argmax(fb.map >= 0, axis=-1)
        return jnp.take_along_axis(teacher, first[:, None, None], axis=1)[:, 0]

    teacher = np.asarray(first_token_logprobs(hint_reader, batch))
    correct = []
    for row in range(0, len(TASKS) * GROUP, GROUP):
        context = jnp.asarray([HINTED[row // GROUP]])
        direct = jax.nn.log_softmax(_next_logits(hint_reader, context, jnp.asarray([context.shape[1]])))[0]
        np.testing.assert_allclose(teacher[row], np.asarray(direct), atol=2e-4)
        correct.append(teacher[row, _ids(TASKS[row // GROUP].answer)[0]])
    assert np.mean(correct) > -1.0, correct           # the teacher reads the hint


@pytest.mark.slow
def test_self_distillation_alone_raises_the_hinted_turn_step_by_step(hint_reader, monkeypatch):
    """Forward KL, live teacher: the correct turn's log-probability without the hint rises at every one
    of 20 steps (by over 2 nats), the teacher's (with the hint) stays; with the sign flipped it falls at
    every step."""
    unhinted, hinted = (x.mean(-1) for x in distil(copy_model(hint_reader)))
    rises = np.diff(unhinted)
    assert (rises > 0).all() and unhinted[-1] - unhinted[0] > 2.0, np.round(unhinted, 3)
    assert abs(hinted[-1] - hinted[0]) < 0.5, np.round(hinted, 3)

    flip = losses.self_distillation_loss
    monkeypatch.setattr(losses, "self_distillation_loss", lambda *a, **k: -flip(*a, **k))
    flipped = distil(copy_model(hint_reader))[0].mean(-1)
    assert (np.diff(flipped) < 0).all(), np.round(flipped, 3)
