"""Reinforcement learning for language models, written on plain torch: :mod:`llmpipe.rl.ppo` holds the PPO
algorithm pieces (advantages, KL estimators, clipped losses, reward normalisation) as pure functions that the
unit tests pin against hand-computed values; :mod:`llmpipe.rl.prompts` loads the prompts and streams their
indices; :mod:`llmpipe.rl.ppo_trainer` composes the pieces into a PPO iteration on real models, which the
`ppo` stage drives."""
