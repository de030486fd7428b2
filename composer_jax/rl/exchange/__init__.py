"""The exchange between the RL learner and rollout engines in other processes (`rollout.transport=directory`;
the engine: `composer-jax rl-engine`, `engine_process.serve`).

The exchange directory (`rollout.exchange_dir`, default RUN_DIR/exchange) lies on a filesystem both
hosts see:

    session.json                      the learner's running session: id, first batch index, each engine's
                                      sampler and group state, the settings the engines must share
    engine-heartbeat[-<k>]            a counter engine k (0: no suffix) rewrites every HEARTBEAT_S while it runs
    <session>/weights/<version>.npz   the policy's parameters at a version (parameter path -> array);
                                      the newest few kept (weight_transfer=device: transport_device.py)
    <session>/batches/<index>.npz     one ProducedBatch for policy version `index`, by engine index % rollout.engines;
                                      removed at the learner's next publish
    <session>/stop                    the learner is done: the engine exits
    <session>/engine-failed           the engine's one-line failure: the learner stops with it

Every file is written under a hidden temporary name in its directory, then renamed (atomic on POSIX):
a reader sees a whole file or none. Files are npz (arrays) with one JSON member for the rest; nothing
is pickled. A restarted learner starts a new session (and removes the previous one), so an engine never
mixes weights or batches of two runs; a running engine follows the new session.

Modules, each one concern, from the bottom up:
    directory.py         the error, atomic writes, numbered files, the session file
    npz.py               the file format: weight snapshots and batches as npz
    settings.py          the settings an engine must share with the learner, and their check
    heartbeat.py         the engine's heartbeat and the learner's watch on it
    transport_files.py   weight versions as npz files in the directory (`rollout.weight_transfer=file`)
    transport_device.py  weight versions device to device (`rollout.weight_transfer=device`)
    learner_end.py       the learner's end (`LearnerExchange`)
    engine_end.py        the engine's end (`EngineExchange`)
    engine_process.py    the engine process: `composer-jax rl-engine`
"""
