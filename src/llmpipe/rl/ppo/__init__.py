"""PPO on Accelerate (TRL ≥ 1.13 has no PPOTrainer): the losses and estimators (:mod:`.losses`) and the iteration
that rolls out, scores and updates (:mod:`.loop`)."""
