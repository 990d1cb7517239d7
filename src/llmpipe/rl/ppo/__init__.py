"""PPO on Accelerate (TRL ≥ 1.13 has no PPOTrainer), all of it: the losses and estimators (:mod:`.losses`), the
rollout that samples, scores and computes advantages (:mod:`.rollout`), the run assembled on an `Accelerator`
(:mod:`.build`), and the iteration that updates, logs, checkpoints, resumes and summarises (:mod:`.loop`). The
`ppo` stage (:mod:`llmpipe.stages.ppo`) only loads the inputs and drives these."""
