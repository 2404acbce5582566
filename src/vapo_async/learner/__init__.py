"""vapo_async.learner: the Lightning learner (``python -m vapo_async.learner``).

    python -m vapo_async.learner                                   # the default run (tiny base, CPU)
    python -m vapo_async.learner algo=dapo trainer=fsdp trainer.devices=8 model=qwen2.5-7b data=dapo_math
    python -m vapo_async.learner name=x                          # runs/x; again: continues it

Modules (one stage each):
    config      LearnerConfig and its nodes (Hydra ConfigStore ``learner_schema``)
    trainer_config  the ``trainer`` node: every lightning.Trainer argument, typed
    errors      ConfigError: an invalid setting, printed as one line (``one_line``)
    model_presets  ``model.path=DIR`` alone means ``model=hf``; the tiny preset refuses a path
    __main__    setup -> run -> cleanup; compose_config; one-line configuration errors (exit code 2)
    prepare     setup: model directory, data, threads, strategy, Trainer, callbacks
    module      LearnerModule: the training step (thin; maths in update, algo)
    state       RunState: step, version, latest step record; owned by the module, read by callbacks
    rollouts    RolloutBatches: the endless IterableDataset of rollout batches the step pulls from
    rollout_stats  rollout/* and async/* figures of a batch; per-token staleness
    stopping    SIGTERM: stop at a batch boundary, checkpoint, exit 143 (watchdog: trainer.stop_grace_s)
    resume      name=NAME run directories; resume=null continues where last.ckpt exists; settings check
    supervise   restart dead local generators with backoff, within an hourly budget
    update      recompute pi_prox/values, decoupled GAE, PPO mini-batch updates on one rank
    batching    groups -> sequences -> mini-batches, token-balanced rank shares, micro-batches
    stream      rank 0 pulls groups from the controller; every rank gets its share (tensor scatter)
    models      actor/critic loading, FSDP2 sharding, forward helpers
    publish     gather the actor (FSDP2 full state dict on rank 0) and publish a weight version
    runtime     controller and local generators beside rank 0 (Lightning callback)
    launch      start/stop local generator processes (``python -m vapo_async.generator``)
    placement   GPU devices and memory shares of the node's engines (learner, generators, eval)
    metrics     TensorBoard scalars, histograms, sampled text; progress bar
    checkpoint  last.ckpt every N steps, atomic; optimiser-state fingerprint for exact resume
    evaluation  held-out accuracy (``eval/accuracy``) every M steps
"""
